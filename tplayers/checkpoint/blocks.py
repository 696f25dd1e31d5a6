"""How a stored tensor is cut into hashed blocks: row blocks, and bands along a shard dim.

Every stored tensor is hashed in **row blocks**: runs of whole rows along its
stored dim 0, about ``block_bytes`` each. A reader that needs rows ``[a, b)``
reads the covering blocks and checks exactly those.

A piece of a tensor sharded on a dim ``d > 0`` is stored in its natural layout
(index version 3), so the rows of a reader that holds only part of the piece's
range of ``d`` are not one span. Such a piece is also hashed in **bands**: the
piece viewed as ``(P, S, Q)`` (``S`` its length along ``d``) is cut along ``S``
into bands of ``band`` indices, and each band's digest is taken over its
elements in row-major order (the band copied to a contiguous buffer first). A
resharding reader checks the bands it reads; a reader of the whole piece checks
its row blocks, which hash straight from the mapped file.

Example::

    >>> import torch
    >>> t = torch.arange(24.).reshape(2, 12)            # a piece sharded on dim 1: P=2, S=12, Q=1
    >>> band_width(t.shape, 1, t.element_size(), 32)    # 32 bytes per band = 2 rows x 4 columns x 4 bytes
    4
    >>> [tuple(b.shape) for b in bands(t, 1, 4)]
    [(2, 4), (2, 4), (2, 4)]
"""

from __future__ import annotations

import ctypes
import math
from typing import Callable, Iterator, List, Optional, Sequence

import torch

__all__ = ["byte_view", "block_rows", "row_blocks", "band_width", "bands", "band_digests"]


def byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor (no numpy: it is not a dependency).

    The view keeps ``t`` alive: the ctypes array it exports holds a reference.
    """
    assert t.device.type == "cpu" and t.is_contiguous(), "byte_view needs a contiguous CPU tensor"
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._owner = t  # the memory stays valid while any view of ``arr`` lives
    return memoryview(arr).cast("B")


def block_rows(shape: Sequence[int], elem_bytes: int, block_bytes: int) -> int:
    """Rows (along dim 0) per hashed block of a tensor of ``shape``; at least 1."""
    row = elem_bytes
    for s in shape[1:]:
        row *= int(s)
    return max(1, block_bytes // row) if row > 0 else max(1, int(shape[0]) if shape else 1)


def row_blocks(t: torch.Tensor, rows_per_block: int) -> List[memoryview]:
    """Bytes of each block of ``rows_per_block`` rows of contiguous ``t`` (a 0-d tensor is 1 row)."""
    mv = byte_view(t)
    rows = t.shape[0] if t.dim() else 1
    row = len(mv) // rows if rows else 0
    return [mv[i * row : min(i + rows_per_block, rows) * row] for i in range(0, rows, rows_per_block)]


def band_width(shape: Sequence[int], dim: int, elem_bytes: int, block_bytes: int) -> int:
    """Indices of ``dim`` per hashed band of a tensor of ``shape`` (about ``block_bytes`` a band); at least 1."""
    per_index = elem_bytes * math.prod(int(s) for i, s in enumerate(shape) if i != dim)
    return max(1, block_bytes // per_index) if per_index > 0 else max(1, int(shape[dim]))


def bands(t: torch.Tensor, dim: int, width: int) -> Iterator[torch.Tensor]:
    """Views of ``t``'s consecutive bands of ``width`` indices along ``dim`` (the last may be narrower)."""
    for i in range(0, t.shape[dim], width):
        yield t.narrow(dim, i, min(width, t.shape[dim] - i))


def band_digests(
    t: torch.Tensor, dim: int, width: int, digest: Callable[[object], bytes], scratch: Optional[list] = None
) -> List[bytes]:
    """The digest of each band of ``t`` (any strides), over the band's elements in row-major order.

    ``scratch``: an optional one-item list holding a reusable uint8 buffer (grown as needed).
    """
    scratch = [None] if scratch is None else scratch
    out = []
    for band in bands(t, dim, width):
        n = band.numel() * band.element_size()
        if band.is_contiguous():
            out.append(digest(byte_view(band)))
            continue
        if scratch[0] is None or scratch[0].numel() < n:
            scratch[0] = torch.empty(max(n, 1), dtype=torch.uint8)
        dense = scratch[0][:n].view(band.dtype).view(band.shape)
        dense.copy_(band)
        out.append(digest(byte_view(dense)))
    return out
