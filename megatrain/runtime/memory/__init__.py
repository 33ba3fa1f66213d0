"""Where the model's state lives between steps: the host store (per layer one flat fp32 block of master weights and
Adam moments, and the host gradient buffers a plan's gradients pass through) and the device's slots and what stays
on the device from one step to the next."""
