"""The runtime: everything that runs a plan, in rooms named for the design's words.

- :mod:`.memory`: the host store and the device's slots;
- :mod:`.optim`: AdamW settings, the host and device updates, the native host kernel;
- :mod:`.ops`: what each op of a schedule does, by op family (the handler table);
- :mod:`.layers`: templates and what runs inside a layer (gradient sink, tiles, router loss, kernels, dropout draws,
  probes);
- :mod:`.issue`: the issuers (program order, CUDA streams), a step's shared state, data parallel;
- :mod:`.state`: training states, HF weights in, safetensors streaming, seeded initialization.

The runtime reads the IR (:mod:`megatrain.ir`) and the layout (:mod:`megatrain.layout`), never the planner: a plan
comes to it whole (:class:`megatrain.planner.run_plan.RunPlan`).
"""
