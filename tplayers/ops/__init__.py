"""One front door per kernel: Triton on CUDA tensors, the pure-torch reference otherwise."""

from tplayers.ops import halo as _halo
from tplayers.ops.halo import (
    faces_overlap,
    pack_faces,
    pack_faces_reference,
    triton_available,
    unpack_faces,
    unpack_faces_reference,
)
from tplayers.ops.na import na2d, neighborhood_attention_2d

__all__ = list(_halo.__all__) + ["na2d", "neighborhood_attention_2d"]
