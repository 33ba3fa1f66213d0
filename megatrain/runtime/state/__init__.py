"""The model's state on disk: the training state a run goes on from (:mod:`.train_state`, its directories in
:mod:`.state_dirs`), HF safetensors weights read into the store (:mod:`.hf_weights`), safetensors files read and
written a chunk at a time (:mod:`.safetensors_stream`), and the store filled by the model's own initializer
(:mod:`.init`)."""
