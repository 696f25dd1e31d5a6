"""Neighborhood-attention window arithmetic along one spatial axis (pure functions).

NATTEN's rule for an axis of length ``L``, kernel ``k`` and dilation ``d``:
positions split into ``d`` interleaved dilation groups (``p % d``); group ``g``
holds ``ceil((L - g) / d)`` positions, and inside a group, at in-group index
``n`` of a group of length ``Lg``:

* non-causal: the window is ``[s, s + k)`` with ``s = clamp(n - k // 2, 0, Lg - k)``,
  i.e. centred (``k // 2`` left, ``k // 2 + k % 2 - 1`` right) and *shifted to
  stay inside the axis*, never padded;
* causal: the window is ``[max(n - k + 1, 0), n]``, the ``k`` most recent.

In global positions a window member ``n'`` is ``g + d * n'``. Requires
``k * d <= L`` (so every group holds at least ``k`` positions), as NATTEN does.

The attention kernel works on *tiles*: ``t`` queries of one dilation group with
consecutive in-group indices share a *region* of ``t + k - 1`` consecutive
group members that holds every key of their windows. :func:`axis_tiles`
builds the index tables for that; :func:`key_span` says which keys a range of
queries needs (for domain-parallel halos). Queries and keys may be slices of
the global axis (``q_start``, ``k_start``), so the same tables serve a local
shard with halos.

>>> key_span(0, 3, length=10, kernel=3, dilation=1, causal=False)
(0, 4)
>>> key_span(9, 10, length=10, kernel=3, dilation=1, causal=False)
(7, 10)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple

import torch

__all__ = ["window_starts", "key_span", "axis_halos", "axis_plans", "AxisTiles", "axis_tiles", "DEFAULT_TILE"]

#: queries of one dilation group per tile along one axis (see ``axis_tiles``)
DEFAULT_TILE = 8


def _group_coords(pos: torch.Tensor, length: int, dilation: int):
    """In-group index, group id and group length of global positions ``pos``."""
    group = pos % dilation
    index = pos // dilation
    group_len = (length - group + dilation - 1) // dilation
    return index, group, group_len


def window_starts(pos: torch.Tensor, length: int, kernel: int, dilation: int, causal: bool):
    """``(first, count)``: in-group index of the first window member and the window size.

    ``pos`` holds global positions (int64). Non-causal windows have ``kernel``
    members; a causal window near the start of its group has fewer.
    """
    index, _, group_len = _group_coords(pos, length, dilation)
    if causal:
        first = (index - kernel + 1).clamp(min=0)
        return first, index - first + 1
    first = torch.minimum((index - kernel // 2).clamp(min=0), group_len - kernel)
    return first, torch.full_like(first, kernel)


def key_span(q_start: int, q_stop: int, *, length: int, kernel: int, dilation: int, causal: bool) -> Tuple[int, int]:
    """``[lo, hi)``: the global positions of all keys the queries ``[q_start, q_stop)`` attend to.

    An empty query range needs no keys and returns ``(q_start, q_start)``.
    """
    if q_stop <= q_start:
        return q_start, q_start
    pos = torch.arange(q_start, q_stop, dtype=torch.int64)
    first, count = window_starts(pos, length, kernel, dilation, causal)
    group = pos % dilation
    lo = group + dilation * first
    hi = group + dilation * (first + count - 1) + 1
    return int(lo.min()), int(hi.max())


@dataclass(frozen=True, eq=False)
class AxisTiles:
    """Index tables of one axis for the tiled kernel (all int64/bool tensors on the CPU).

    ``q_index`` (tiles, t): local query index of each tile slot (a padding slot
    repeats a real query of its tile). ``k_index`` (tiles, R): local key index of
    each region slot (clamped into range where no query uses it). ``mask``
    (tiles, t, R): key slot in the query's window. ``rel`` (tiles, t, R):
    ``(key - query) / dilation + kernel - 1`` (the relative-position-bias index,
    clamped where masked). ``out_pos`` (queries,): flat slot ``tile * t + m``
    computing each local query.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: torch.Tensor
    rel: torch.Tensor
    out_pos: torch.Tensor

    @property
    def tile(self) -> int:
        return self.q_index.shape[1]

    @property
    def region(self) -> int:
        return self.k_index.shape[1]

    @property
    def num_tiles(self) -> int:
        return self.q_index.shape[0]


@lru_cache(maxsize=256)
def axis_tiles(
    length: int,
    kernel: int,
    dilation: int,
    causal: bool,
    q_start: int,
    q_count: int,
    k_start: int,
    k_count: int,
    tile: int = DEFAULT_TILE,
) -> AxisTiles:
    """Tile tables for queries ``[q_start, q_start + q_count)`` of a global axis of ``length``.

    The key tensor holds global positions ``[k_start, k_start + k_count)``; every
    key a query needs must lie in it (``AssertionError`` otherwise: the caller
    sizes halos with :func:`key_span`). Results are cached (they depend only on
    these integers).
    """
    assert q_count >= 1 and kernel * dilation <= length
    pos = torch.arange(q_start, q_start + q_count, dtype=torch.int64)
    index, group, _ = _group_coords(pos, length, dilation)
    counts = torch.bincount(group, minlength=dilation)
    t = max(1, min(tile, int(counts.max())))
    region = t + kernel - 1
    # Order queries by (group, in-group index); tile each group separately.
    order = torch.argsort(group * (length + 1) + index)
    tiles_per_group = (counts + t - 1) // t
    group_first_tile = torch.cumsum(tiles_per_group, 0) - tiles_per_group
    group_first_q = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(q_count) - group_first_q[group[order]]
    slot = (group_first_tile[group[order]] + rank_in_group // t) * t + rank_in_group % t
    num_tiles = int(tiles_per_group.sum())
    # Fill every slot with a query: padding slots repeat the previous slot's query.
    filled = torch.zeros(num_tiles * t, dtype=torch.bool)
    filled[slot] = True
    q_slot = torch.zeros(num_tiles * t, dtype=torch.int64)
    q_slot[slot] = order
    marker = torch.where(filled, torch.arange(num_tiles * t), torch.zeros((), dtype=torch.int64))
    q_slot = q_slot[torch.cummax(marker, 0).values].view(num_tiles, t)
    out_pos = torch.empty(q_count, dtype=torch.int64)
    out_pos[order] = slot
    # Region of each tile: group members first(q of slot 0) + [0, region).
    q_pos = pos[q_slot]  # (tiles, t) global positions
    first, count = window_starts(q_pos, length, kernel, dilation, causal)
    q_index_in_group = q_pos // dilation
    tile_group = q_pos[:, :1] % dilation  # (tiles, 1)
    member = first[:, :1] + torch.arange(region)  # (tiles, R) in-group indices
    key_pos = tile_group + dilation * member  # (tiles, R) global positions
    off = member[:, None, :] - first[:, :, None]  # (tiles, t, R)
    mask = (off >= 0) & (off < count[:, :, None])
    rel = member[:, None, :] - q_index_in_group[:, :, None] + kernel - 1
    local_key = key_pos - k_start
    needed = mask.any(1)
    assert bool(((local_key >= 0) & (local_key < k_count))[needed].all()), "key halo too small"
    return AxisTiles(
        q_index=q_slot,
        k_index=local_key.clamp(0, k_count - 1),
        mask=mask,
        rel=rel.clamp(0, 2 * kernel - 2),
        out_pos=out_pos,
    )


def axis_plans(sizes, *, kernel: int, dilation: int, causal: bool, what: str = "H"):
    """Window-core plans (:class:`tplayers.domain.window_plan.AxisPlan`) of one sharded axis: each
    shard's queries stay local; its keys are the range :func:`key_span` gives (asymmetric; an edge
    shard's shifted window reaches further than ``k // 2``), from the adjacent shards only.
    ``ValueError`` when a neighbour is too small, or when ``kernel * dilation`` exceeds the length.
    """
    from tplayers.domain.window_plan import plan_ranges

    sizes = [int(s) for s in sizes]
    length = sum(sizes)
    if kernel * dilation > length:
        raise ValueError(f"kernel_size * dilation must be <= the global size along {what}: got kernel_size "
                         f"{kernel} * dilation {dilation} > {what}={length}")
    needs, start = [], 0
    for size in sizes:
        needs.append(key_span(start, start + size, length=length, kernel=kernel, dilation=dilation, causal=causal)
                     if size else None)
        start += size
    return plan_ranges(sizes, needs, sizes, mode="zeros", what=f"{what} (kernel {kernel}, dilation {dilation})")


def axis_halos(sizes, *, kernel: int, dilation: int, causal: bool, what: str = "H"):
    """Per-shard ``(start, recv, send)`` of one sharded axis (from :func:`axis_plans`).

    ``sizes``: every shard's length in mesh order (any partition). Shard ``c``
    holds queries ``[start, start + size)``; ``recv = (lo, hi)`` are the key rows
    it needs beyond its own, ``send = (lo, hi)`` what it gives its low / high
    neighbour (their ``recv`` facing it).

    >>> axis_halos([4, 6], kernel=3, dilation=1, causal=False)
    [(0, (0, 1), (0, 1)), (4, (1, 0), (1, 0))]
    >>> axis_halos([6, 2], kernel=5, dilation=1, causal=False)[1]
    (6, (3, 0), (2, 0))
    """
    plans = axis_plans(sizes, kernel=kernel, dilation=dilation, causal=causal, what=what)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    return [(starts[c], p.recv, p.send) for c, p in enumerate(plans)]
