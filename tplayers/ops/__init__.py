"""One front door per kernel: Triton on CUDA tensors, the pure-torch reference otherwise."""

from tplayers.ops.halo import (
    faces_overlap,
    pack_faces,
    pack_faces_reference,
    triton_available,
    unpack_faces,
    unpack_faces_reference,
)
from tplayers.ops.na import na1d, na2d, na3d, neighborhood_attention

__all__ = [
    "pack_faces",
    "unpack_faces",
    "pack_faces_reference",
    "unpack_faces_reference",
    "triton_available",
    "faces_overlap",
    "na1d",
    "na2d",
    "na3d",
    "neighborhood_attention",
]
