"""A layer as the runtime runs it: weightless templates bound to views of a weight slot (:mod:`.templates`), weight
gradients written straight into the gradient slot (:mod:`.grad_sink`), MLPs over tiles of long sequences
(:mod:`.tiling`), the router's load-balancing loss (:mod:`.router_aux`), the Triton kernels put into the templates
(:mod:`.kernel_rewrite`), the random draws of stochastic layers (:mod:`.rng`), and the probes that measure what a
layer's forward keeps on this device (:mod:`.probe`)."""
