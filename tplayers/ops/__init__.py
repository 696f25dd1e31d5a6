"""One front door per kernel: Triton on CUDA tensors, the pure-torch reference otherwise."""

from tplayers.ops.halo import (
    faces_overlap,
    pack_faces,
    pack_faces_reference,
    triton_available,
    unpack_faces,
    unpack_faces_reference,
)

__all__ = [
    "pack_faces",
    "unpack_faces",
    "pack_faces_reference",
    "unpack_faces_reference",
    "triton_available",
    "faces_overlap",
]
