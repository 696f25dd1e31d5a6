"""One front door per kernel: Triton on CUDA tensors, the pure-torch reference otherwise."""
