"""Issuing a schedule: in program order (:mod:`.executor`, the CPU and plain CUDA) or on CUDA streams with a host
optimizer thread (:mod:`.streams`: its copies in :mod:`.stream_copies`, the order between steps in
:mod:`.step_order`, all of CUDA it uses in :mod:`.cuda_api`, its timer in :mod:`.timing`); what one step's ops share
(:mod:`.step`); data parallel ranks (:mod:`.data_parallel`)."""
