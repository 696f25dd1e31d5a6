"""Front door of the halo pack/unpack kernels: Triton on CUDA, the torch reference otherwise.

A *face* is a slab ``x.narrow(dim, start, length)``. :func:`pack_faces` copies
several faces of one tensor into one contiguous 1-D buffer (face after face,
each in row-major order of the slab); :func:`unpack_faces` writes (or, with
``accumulate=True``, adds) consecutive buffer segments into faces of a tensor.
Unpack is the adjoint of pack: ``<pack(x), b> == <x, unpack_add(b)>``.

The torch reference (:func:`pack_faces_reference`, :func:`unpack_faces_reference`)
is the oracle of the Triton kernels in ``tplayers.kernels.halo_pack``; the
kernels run for CUDA tensors when Triton is importable (one launch for all the
faces of one exchange). ``TPLAYERS_HALO_BACKEND=reference|triton`` forces a path
(``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``; used by the tests).

>>> import torch
>>> x = torch.arange(12.).reshape(3, 4)
>>> pack_faces(x, 1, [(0, 1), (3, 1)])
tensor([ 0.,  4.,  8.,  3.,  7., 11.])
"""

from __future__ import annotations

import os
from typing import Sequence, Tuple

import torch

__all__ = [
    "pack_faces",
    "unpack_faces",
    "pack_faces_reference",
    "unpack_faces_reference",
    "triton_available",
    "faces_overlap",
]

Face = Tuple[int, int]  # (start, length) along the face dim

_TRITON = None  # imported once, lazily: no import-time side effects


def triton_available() -> bool:
    """Whether ``tplayers.kernels.halo_pack`` (hence Triton) can be imported."""
    global _TRITON
    if _TRITON is None:
        try:
            from tplayers.kernels import halo_pack
        except ImportError:  # Triton missing or broken: the reference serves
            halo_pack = False
        _TRITON = halo_pack
    return _TRITON is not False


def _use_triton(x: torch.Tensor) -> bool:
    mode = os.environ.get("TPLAYERS_HALO_BACKEND", "auto")
    if mode == "reference":
        return False
    if mode == "triton":
        if not triton_available():
            raise RuntimeError("TPLAYERS_HALO_BACKEND=triton but Triton cannot be imported; pip install triton")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "TPLAYERS_HALO_BACKEND=triton: Triton's kernels take CUDA tensors (CPU tensors only in its "
                f"interpreter, TRITON_INTERPRET=1); got a tensor on {x.device}"
            )
        return True
    return x.is_cuda and triton_available()


def _check_faces(x: torch.Tensor, dim: int, faces: Sequence[Face]) -> None:
    n = x.size(dim)
    for start, length in faces:
        assert 0 <= start and 0 <= length and start + length <= n, (start, length, n)


def _face_numel(x: torch.Tensor, dim: int, length: int) -> int:
    return x.numel() // max(x.size(dim), 1) * length if x.size(dim) else 0


def pack_faces_reference(x: torch.Tensor, dim: int, faces: Sequence[Face]) -> torch.Tensor:
    """Torch reference of :func:`pack_faces`."""
    if len(faces) == 1:  # one copy (a halo exchange with one neighbour sends one face)
        return x.narrow(dim, *faces[0]).clone(memory_format=torch.contiguous_format).view(-1)
    parts = [x.narrow(dim, s, n).reshape(-1) for s, n in faces]
    if not parts:
        return x.new_empty(0)
    return torch.cat(parts)


def unpack_faces_reference(
    buf: torch.Tensor, out: torch.Tensor, dim: int, faces: Sequence[Face], accumulate: bool = False
) -> torch.Tensor:
    """Torch reference of :func:`unpack_faces` (faces applied in order, so overlaps add up)."""
    offset = 0
    for start, length in faces:
        view = out.narrow(dim, start, length)
        count = view.numel()
        seg = buf[offset : offset + count].view(view.shape)
        if accumulate:
            view.add_(seg)
        else:
            view.copy_(seg)
        offset += count
    return out


def pack_faces(x: torch.Tensor, dim: int, faces: Sequence[Face]) -> torch.Tensor:
    """Copy the faces ``x.narrow(dim, start, length)`` into one contiguous 1-D buffer.

    Any strides (non-contiguous, channels_last) are read directly; one kernel
    launch on the Triton path.
    """
    dim = dim % x.dim()
    faces = [(int(s), int(n)) for s, n in faces]
    _check_faces(x, dim, faces)
    if _use_triton(x):
        return _TRITON.pack(x, dim, faces)
    return pack_faces_reference(x, dim, faces)


def unpack_faces(
    buf: torch.Tensor, out: torch.Tensor, dim: int, faces: Sequence[Face], accumulate: bool = False
) -> torch.Tensor:
    """Write (or add, ``accumulate=True``) consecutive segments of ``buf`` into faces of ``out``.

    ``out`` is modified in place and returned. Overlapping faces with
    ``accumulate=True`` add up (the Triton path then uses one launch per face).
    """
    dim = dim % out.dim()
    faces = [(int(s), int(n)) for s, n in faces]
    _check_faces(out, dim, faces)
    need = sum(_face_numel(out, dim, n) for _, n in faces)
    assert buf.dim() == 1 and buf.numel() >= need and buf.dtype == out.dtype, (buf.shape, need, buf.dtype, out.dtype)
    if _use_triton(out):
        if accumulate and faces_overlap(faces):  # one launch per face so shared rows add up
            offset = 0
            for face in faces:
                _TRITON.unpack(buf[offset:], out, dim, [face], True)
                offset += _face_numel(out, dim, face[1])
            return out
        return _TRITON.unpack(buf, out, dim, faces, accumulate)
    return unpack_faces_reference(buf, out, dim, faces, accumulate)


def faces_overlap(faces: Sequence[Face]) -> bool:
    """Whether any two faces share a row (used to split accumulating launches)."""
    spans = sorted((s, s + n) for s, n in faces if n)
    return any(a[1] > b[0] for a, b in zip(spans, spans[1:]))
