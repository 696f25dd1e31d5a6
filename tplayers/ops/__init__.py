"""One front door per kernel: Triton on CUDA tensors, the pure-torch reference otherwise."""

from tplayers.ops.na import na2d, neighborhood_attention_2d

__all__ = ["na2d", "neighborhood_attention_2d"]
