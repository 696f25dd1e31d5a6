"""The geometry of one neighborhood-attention call, any spatial rank, as the kernels see it.

A call is described per spatial axis by :class:`Axis` (the global length, the window arguments,
the query and key ranges this call holds, the tile size). The kernels are 2-D: a *row* axis and
a *column* axis. The last spatial axis is the column axis; the leading axes are merged into one
row axis (:func:`~tplayers.ops.na_layout.merge_axes`: a window is the product of its axes'
windows, so merging is exact), and 1-D runs with a row axis of length 1. The geometry travels
as one flat list of ints (:func:`geometry_args`; also a custom-op argument for
``torch.compile``).

>>> geo = geometry_args([Axis(6, 3), Axis(5, 3), Axis(7, 3)], 1 << 17, 1 << 15)
>>> [a.length for a in split_geometry(geo)[0]]
[6, 5, 7]
>>> merged_kernel(geo)
(9, 3)
"""

from __future__ import annotations

import math
from functools import lru_cache, wraps
from typing import List, NamedTuple, Sequence, Tuple

import torch

from tplayers.ops.na_layout import AxisTiles, axis_tiles, merge_axes

__all__ = ["Axis", "geometry_args", "split_geometry", "row_tiles", "merged_kernel", "kernel_tables", "kernel_dims"]


class Axis(NamedTuple):
    """One spatial axis of a call: global ``length``; ``kernel``, ``stride``, ``dilation``,
    ``causal`` (0/1); queries ``[q_start, q_start + q_count)`` and keys ``[k_start, k_start +
    k_count)`` held (global positions); ``tile``: queries per tile along it (tile kernel).
    ``q_count`` / ``k_count`` of -1 mean the whole axis."""

    length: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    causal: int = 0
    q_start: int = 0
    q_count: int = -1
    k_start: int = 0
    k_count: int = -1
    tile: int = 8

    def full(self) -> "Axis":
        """With ``q_count`` / ``k_count`` of -1 replaced by the axis length."""
        return self._replace(
            q_count=self.length if self.q_count < 0 else self.q_count,
            k_count=self.length if self.k_count < 0 else self.k_count,
        )

    def tiles(self, tile: int) -> AxisTiles:
        return axis_tiles(
            self.length,
            self.kernel,
            self.dilation,
            bool(self.causal),
            self.q_start,
            self.q_count,
            self.k_start,
            self.k_count,
            tile,
            self.stride,
        )


FIELDS = len(Axis._fields)


def geometry_args(axes: Sequence[Axis], fwd_chunk: int, bwd_chunk: int) -> List[int]:
    """Everything that decides the kernels' tables, as one list of ints: the rank, each axis's
    fields, the forward and backward chunk sizes (score elements per chunk, tile kernel)."""
    return list(_geometry_tuple(tuple(axes), fwd_chunk, bwd_chunk))  # a fresh list: callers may keep it


def eager_cached(maxsize: int):
    """``lru_cache(maxsize)`` for eager calls; where ``torch.compile`` traces the function it runs
    uncached (Dynamo warns on an ``lru_cache`` wrapper and traces through it anyway). For the
    per-call front door of the kernels: small pure functions of hashable arguments."""

    def wrap(fn):
        cached = lru_cache(maxsize=maxsize)(fn)

        @wraps(fn)
        def call(*args):
            return (fn if torch.compiler.is_compiling() else cached)(*args)

        return call

    return wrap


@eager_cached(256)
def _geometry_tuple(axes: Tuple[Axis, ...], fwd_chunk: int, bwd_chunk: int) -> Tuple[int, ...]:
    return (len(axes), *(int(x) for axis in axes for x in axis.full()), int(fwd_chunk), int(bwd_chunk))


def split_geometry(geo: Sequence[int]) -> Tuple[Tuple[Axis, ...], int, int]:
    """``(axes, fwd_chunk, bwd_chunk)`` of a :func:`geometry_args` list."""
    rank = geo[0]
    axes = tuple(Axis(*geo[1 + FIELDS * i : 1 + FIELDS * (i + 1)]) for i in range(rank))
    return axes, geo[1 + FIELDS * rank], geo[2 + FIELDS * rank]


@lru_cache(maxsize=64)
def row_tiles(axes: Tuple[Axis, ...], tile_one: bool = False) -> AxisTiles:
    """The leading axes' tiles merged into one row axis (outermost first); ``tile_one``: one
    query per tile (the C kernel's per-query tables) instead of each axis's ``tile``."""
    merged = None
    for axis in axes:
        tiles = axis.tiles(1 if tile_one else axis.tile)
        merged = tiles if merged is None else merge_axes(merged, tiles, axis.q_count, axis.k_count, 2 * axis.kernel - 1)
    return merged


def merged_kernel(geo: Sequence[int]) -> Tuple[int, int]:
    """Window slots along the merged row axis and along the column axis."""
    axes = split_geometry(geo)[0]
    return math.prod(a.kernel for a in axes[:-1]), axes[-1].kernel


@lru_cache(maxsize=64)
def kernel_tables(geo: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The C kernel's per-query window tables, rows and columns: ``(3, Q, k)`` int32 of (local
    key index, valid, bias index) per query and slot."""
    axes = split_geometry(geo)[0]

    def table(t: AxisTiles) -> torch.Tensor:
        slot = t.out_pos  # one query per tile: the tile of each query
        return torch.stack([t.k_index[slot], t.mask[slot, 0].long(), t.rel[slot, 0]]).to(torch.int32).contiguous()

    return table(row_tiles(axes[:-1], True)), table(axes[-1].tiles(1))


def kernel_dims(geo: Sequence[int], batch: int, heads: int, dim: int, dim_v: int) -> torch.Tensor:
    """The C kernel's ``dims``: B, heads, query rows, query columns, key rows, key columns, D, Dv,
    row slots, column slots, bias-table rows (int64)."""
    axes = split_geometry(geo)[0]
    rows, col = axes[:-1], axes[-1]
    return torch.tensor(
        [
            batch,
            heads,
            math.prod(a.q_count for a in rows),
            col.q_count,
            math.prod(a.k_count for a in rows),
            col.k_count,
            dim,
            dim_v,
            math.prod(a.kernel for a in rows),
            col.kernel,
            math.prod(2 * a.kernel - 1 for a in rows),
        ],
        dtype=torch.int64,
    )
