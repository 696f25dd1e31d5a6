"""Copy a stored checkpoint piece into a model tensor along torch's fastest path.

Version 1-2 checkpoints stored pieces shard dim first, so such a piece of a tensor
sharded on dim ``d > 0`` reaches the model as ``stored.movedim(0, d)``: a transpose
(version 3 stores pieces in their natural layout; their copies are plain). On the CPU,
``dst.copy_(src)`` of such a view is fast (torch's blocked 2-D transpose, ~4-5
GB/s on one core of the CI machine) only when ``dst`` is contiguous and ``src``
is exactly a transposed contiguous matrix; any other strided copy runs
elementwise at ~0.7 GB/s. :func:`copy_into` recasts every "stored block moved
back" copy as that 2-D transpose: ``(S, P, Q) -> (P, S, Q)`` is a transpose of
``(S, P)`` matrices of ``Q``-element items, reinterpreted as one 2-, 4- or
8-byte integer each when ``Q > 1``; a destination that is not contiguous (a
narrowed block of a fused layer, a resharded range) gets the transpose into a
reused contiguous buffer first and then a row copy. Bits are copied exactly
(integer views: NaN payloads and -0.0 survive).

Example::

    >>> import torch
    >>> stored = torch.arange(24.).reshape(4, 6)      # a piece stored dim 1 first
    >>> dst = torch.zeros(6, 4)
    >>> copy_into(dst, stored.movedim(0, 1))
    >>> torch.equal(dst, stored.t())
    True
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["copy_into", "moved_dim", "dense_from"]

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def moved_dim(src: torch.Tensor) -> Optional[int]:
    """The dim ``d > 0`` with ``src.movedim(d, 0)`` contiguous (``src`` is a stored block moved back), or None."""
    if src.dim() < 2 or src.is_contiguous():
        return None
    for d in range(1, src.dim()):
        if src.shape[d] > 1 and src.movedim(d, 0).is_contiguous():
            return d
    return None


def _as_matrix(stored: torch.Tensor, s: int, p: int, q: int) -> Optional[torch.Tensor]:
    """Contiguous ``stored`` (``s * p * q`` items) as an ``(s, p)`` matrix of ``q``-item units, or None."""
    if q == 1:
        return stored.reshape(s, p)
    unit = q * stored.element_size()
    if unit not in _INT or stored.dtype.is_complex:
        return None
    flat = stored.reshape(s, p * q)
    try:
        return flat.view(torch.uint8).view(_INT[unit]).reshape(s, p)
    except RuntimeError:  # storage offset not aligned to the wider unit
        return None


def copy_into(dst: torch.Tensor, src: torch.Tensor, buffer: Optional[list] = None) -> None:
    """``dst.copy_(src)`` (same shape, dtype and device), as a blocked 2-D transpose when ``src`` is a
    contiguous stored block with its first dim moved back (see the module docstring).

    ``buffer``: an optional one-item list holding a reusable uint8 scratch tensor
    (grown as needed), for destinations that are not contiguous.
    """
    same = src.dtype == dst.dtype and src.device == dst.device and src.device.type == "cpu"
    if not same or src.numel() < 4096 or src.dim() < 2 or src.is_contiguous():
        dst.copy_(src)
        return
    d = moved_dim(src)
    if d is None:
        if dst.is_contiguous() and not src.is_contiguous() and _store(dst, src, buffer):
            return
        dst.copy_(src)
        return
    shape = src.shape
    s, p, q = shape[d], math.prod(shape[:d]), math.prod(shape[d + 1 :])
    mat = _as_matrix(src.movedim(d, 0), s, p, q)
    if mat is None:
        dst.copy_(src)
        return
    if dst.is_contiguous():
        try:
            out = dst.view(torch.uint8).view(mat.dtype).view(p, s) if q > 1 else dst.view(p, s)
        except RuntimeError:  # dst not aligned to the wider unit: through the buffer below
            out = None
        if out is not None:
            out.copy_(mat.t())
            return
    nbytes = src.numel() * src.element_size()
    if buffer is None:
        buffer = [None]
    if buffer[0] is None or buffer[0].numel() < nbytes:
        buffer[0] = torch.empty(nbytes, dtype=torch.uint8)
    tmp = buffer[0][:nbytes].view(mat.dtype).view(p, s)
    tmp.copy_(mat.t())
    dst.copy_(tmp.view(torch.uint8).view(src.dtype).view(shape))


def _store(dst: torch.Tensor, src: torch.Tensor, buffer: Optional[list]) -> bool:
    """The save direction: contiguous ``dst`` gets ``src = natural.movedim(d, 0)`` (``natural`` contiguous,
    or narrowed along ``d``: copied row-wise into the buffer first). False if ``src`` is not of that form."""
    for d in range(1, src.dim()):
        natural = src.movedim(0, d)
        s, p, q = src.shape[0], math.prod(natural.shape[:d]), math.prod(natural.shape[d + 1 :])
        if not dense_from(natural, d):  # any d is correct; this one makes the staging copy row-wise
            continue
        if not natural.is_contiguous():
            nbytes = natural.numel() * natural.element_size()
            if buffer is None:
                buffer = [None]
            if buffer[0] is None or buffer[0].numel() < nbytes:
                buffer[0] = torch.empty(nbytes, dtype=torch.uint8)
            natural = buffer[0][:nbytes].view(src.dtype).view(natural.shape).copy_(natural)
        mat = _as_matrix(natural, p, s, q)
        if mat is None:
            return False
        try:
            out = dst.view(torch.uint8).view(mat.dtype).view(s, p) if q > 1 else dst.view(s, p)
        except RuntimeError:
            return False
        out.copy_(mat.t())
        return True
    return False


def dense_from(t: torch.Tensor, d: int) -> bool:
    """The dims from ``d`` on are dense: ``t`` is a narrow along ``d`` of a contiguous tensor, or (``d = 1``)
    rows of contiguous runs, such as a column band."""
    expect = 1
    for i in range(t.dim() - 1, d - 1, -1):
        if t.shape[i] != 1 and t.stride(i) != expect:
            return False
        expect *= t.shape[i]
    return True
