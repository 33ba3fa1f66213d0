"""Triton kernels, each with a launcher, an autograd Function and a pure-torch reference."""
