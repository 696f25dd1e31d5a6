"""Layouts of ``x[idx]`` for the region guard: indexing is exact while every sharded dim stays whole."""

from __future__ import annotations

from typing import Optional

import torch

from tplayers.domain.layout import Layout

__all__ = ["index_layout"]


def _whole(s: slice) -> bool:
    return s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _consumes(item) -> int:
    if item is None or item is Ellipsis:
        return 0
    if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
        return max(item.dim(), 1)
    return 1


def index_layout(x: torch.Tensor, layout: Layout, idx) -> Optional[Layout]:
    """Layout of ``x[idx]``, or ``None`` when the index reads a sharded dim partially (a slice with a
    start, stop or step, an integer, an index tensor) and so would not be the serial result's slice."""
    items = idx if isinstance(idx, tuple) else (idx,)
    used = sum(_consumes(i) for i in items)
    advanced = [
        i for i in items if isinstance(i, (torch.Tensor, list)) and not (isinstance(i, torch.Tensor) and i.dim() == 0)
    ]
    if len(advanced) > 1:
        return None
    out = []
    d = 0
    for item in items:
        if item is Ellipsis:
            for _ in range(x.dim() - used):
                out.append(layout[d])
                d += 1
        elif item is None:
            out.append(None)
        elif isinstance(item, slice):
            if layout[d] is not None and not _whole(item):
                return None
            out.append(layout[d])
            d += 1
        elif isinstance(item, bool):
            out.append(None)
        elif isinstance(item, (torch.Tensor, list)) and not (isinstance(item, torch.Tensor) and item.dim() == 0):
            k = _consumes(item)
            if any(layout[d + j] is not None for j in range(k)):
                return None
            out.append(None)
            d += k
        else:  # an integer (or a 0-d tensor): the dim goes away
            if layout[d] is not None:
                return None
            d += 1
    out.extend(layout[d:])
    return tuple(out)
