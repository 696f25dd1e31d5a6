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

Stride ``s`` (NATTEN's strided NA): in-group indices are cut into runs of ``s``
(``[s*m, s*m + s)``) and every query of a run takes the window of the run's *leader*,
clamped to the group (``min(leader, Lg - 1)``): non-causal, the centre query
``s*m + s // 2`` (the right one of the two when ``s`` is even), whose window is the one above;
causal, the last query ``s*m + s - 1``, and the query attends the keys of the leader's
window up to itself: ``[max(leader - k + 1, 0), n]``.

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

from tplayers.window_plan import plan_ranges

__all__ = [
    "window_starts",
    "key_span",
    "tile_span",
    "axis_halos",
    "axis_plans",
    "AxisTiles",
    "axis_tiles",
    "merge_axes",
    "DEFAULT_TILE",
]

#: queries of one dilation group per tile along one axis (see ``axis_tiles``)
DEFAULT_TILE = 8


def _group_coords(pos: torch.Tensor, length: int, dilation: int):
    """In-group index, group id and group length of global positions ``pos``."""
    group = pos % dilation
    index = pos // dilation
    group_len = (length - group + dilation - 1) // dilation
    return index, group, group_len


def window_starts(pos: torch.Tensor, length: int, kernel: int, dilation: int, causal: bool, stride: int = 1):
    """``(first, count)``: in-group index of the first window member and the window size.

    ``pos`` holds global positions (int64). Non-causal windows have ``kernel``
    members; a causal window near the start of its group (or before its stride leader) has fewer.
    """
    index, _, group_len = _group_coords(pos, length, dilation)
    run = index // stride * stride
    if causal:
        leader = torch.minimum(run + stride - 1, group_len - 1)
        first = (leader - kernel + 1).clamp(min=0)
        return first, index - first + 1
    leader = torch.minimum(run + stride // 2, group_len - 1)
    first = torch.minimum((leader - kernel // 2).clamp(min=0), group_len - kernel)
    return first, torch.full_like(first, kernel)


def key_span(
    q_start: int, q_stop: int, *, length: int, kernel: int, dilation: int, causal: bool, stride: int = 1
) -> Tuple[int, int]:
    """``[lo, hi)``: the global positions of all keys the queries ``[q_start, q_stop)`` attend to.

    An empty query range needs no keys and returns ``(q_start, q_start)``.
    """
    if q_stop <= q_start:
        return q_start, q_start
    pos = torch.arange(q_start, q_stop, dtype=torch.int64)
    first, count = window_starts(pos, length, kernel, dilation, causal, stride)
    group = pos % dilation
    lo = group + dilation * first
    hi = group + dilation * (first + count - 1) + 1
    return int(lo.min()), int(hi.max())


def tile_span(
    q_start: int, q_stop: int, *, length: int, kernel: int, dilation: int, causal: bool, stride: int = 1
) -> Tuple[int, int]:
    """``[a, b)``: a range of the axis holding the queries ``[q_start, q_stop)`` and their keys such
    that NATTEN's rule applied to the range *as a whole image* (its own borders, dilation groups and
    stride runs) gives each of those queries its global window. A kernel that only runs whole
    images (natten's fused kernels) computes a shard's exact outputs on such a tile: an internal
    shard edge must not look like an image border (that would shift the window), and the stride
    runs and dilation groups must line up. Starts from the key span and grows the side whose
    windows differ by one dilation step at a time (the whole axis always qualifies).

    >>> tile_span(4, 8, length=20, kernel=5, dilation=1, causal=False)  # the key span suffices
    (2, 10)
    >>> tile_span(5, 6, length=20, kernel=5, dilation=1, causal=False, stride=5)  # query 5's leader is 7
    (5, 10)
    """
    if q_stop <= q_start:
        return q_start, q_start
    lo, hi = key_span(q_start, q_stop, length=length, kernel=kernel, dilation=dilation, causal=causal, stride=stride)
    a, b = min(lo, q_start), max(hi, q_stop)
    pos = torch.arange(q_start, q_stop, dtype=torch.int64)
    first, count = window_starts(pos, length, kernel, dilation, causal, stride)
    want = pos % dilation + dilation * first  # global position of each window's first key
    while True:
        if b - a >= kernel * dilation:
            local = pos - a
            l_first, l_count = window_starts(local, b - a, kernel, dilation, causal, stride)
            got = a + local % dilation + dilation * l_first
            if bool((got == want).all()) and bool((l_count == count).all()):
                return a, b
            grow_lo = bool((got > want).any() | (l_count != count).any()) or b == length
            grow_hi = bool((got < want).any()) or a == 0
        else:
            grow_lo = grow_hi = True
        a = max(0, a - dilation) if grow_lo else a
        b = min(length, b + dilation) if grow_hi else b


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
    stride: int = 1,
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
    first, count = window_starts(q_pos, length, kernel, dilation, causal, stride)
    # first is non-decreasing along a tile: slot 0's is the least; with stride > 1 a tile's windows
    # may span more than t + k - 1 members (a run's leader lies ahead of its queries)
    region = max(t + kernel - 1, int(((first + count).max(1).values - first[:, 0]).max()))
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


def merge_axes(a: AxisTiles, b: AxisTiles, b_queries: int, b_keys: int, b_rel: int) -> AxisTiles:
    """Two axes' tiles as the tiles of one merged axis (``a`` outer, ``b`` inner): local query
    ``ia * b_queries + ib``, key ``ja * b_keys + jb``, bias index ``rel_a * b_rel + rel_b``. A
    3-D (or higher) window is the product of its axes' windows, so the leading axes merged into
    one "row" axis run on the 2-D kernels unchanged.

    >>> d = axis_tiles(6, 3, 1, False, 0, 6, 0, 6, 1)
    >>> h = axis_tiles(5, 3, 1, False, 0, 5, 0, 5, 1)
    >>> dh = merge_axes(d, h, 5, 5, 5)
    >>> tuple(dh.k_index.shape), tuple(dh.mask.shape)
    ((30, 9), (30, 1, 9))
    """
    na, nb, ta, tb = a.num_tiles, b.num_tiles, a.tile, b.tile

    def outer(x, y, scale):  # (na, ta|Ra...), (nb, tb|Rb...) -> (na*nb, ...) with x * scale + y
        return (x[:, None, :, None] * scale + y[None, :, None, :]).reshape(na * nb, -1)

    mask = (a.mask[:, None, :, None, :, None] & b.mask[None, :, None, :, None, :]).reshape(
        na * nb, ta * tb, a.region * b.region
    )
    rel = (a.rel[:, None, :, None, :, None] * b_rel + b.rel[None, :, None, :, None, :]).reshape(
        na * nb, ta * tb, a.region * b.region
    )
    tile_a, slot_a = a.out_pos // ta, a.out_pos % ta
    tile_b, slot_b = b.out_pos // tb, b.out_pos % tb
    out_pos = ((tile_a[:, None] * nb + tile_b[None, :]) * (ta * tb) + slot_a[:, None] * tb + slot_b[None, :]).flatten()
    return AxisTiles(
        q_index=outer(a.q_index, b.q_index, b_queries),
        k_index=outer(a.k_index, b.k_index, b_keys),
        mask=mask,
        rel=rel,
        out_pos=out_pos,
    )


def axis_plans(
    sizes, *, kernel: int, dilation: int, causal: bool, what: str = "H", stride: int = 1, tile: bool = False
):
    """Window-core plans (:class:`tplayers.window_plan.AxisPlan`) of one sharded axis: each
    shard's queries stay local; its keys are the range :func:`key_span` gives (asymmetric; an edge
    shard's shifted window reaches further than ``k // 2``), from the adjacent shards only.
    ``ValueError`` when a neighbour is too small, or when ``kernel * dilation`` exceeds the length.
    With ``tile``, a shard's rows are its :func:`tile_span` instead (a whole-image kernel's tile:
    queries, keys and values all extended to it).
    """
    sizes = [int(s) for s in sizes]
    length = sum(sizes)
    if kernel * dilation > length:
        raise ValueError(
            f"kernel_size * dilation must be <= the global size along {what}: got kernel_size "
            f"{kernel} * dilation {dilation} > {what}={length}"
        )
    needs, start = [], 0
    for size in sizes:
        span = tile_span if tile else key_span
        needs.append(
            span(start, start + size, length=length, kernel=kernel, dilation=dilation, causal=causal, stride=stride)
            if size
            else None
        )
        start += size
    return plan_ranges(sizes, needs, sizes, mode="zeros", what=f"{what} (kernel {kernel}, dilation {dilation})")


def axis_halos(sizes, *, kernel: int, dilation: int, causal: bool, what: str = "H", stride: int = 1):
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
    plans = axis_plans(sizes, kernel=kernel, dilation=dilation, causal=causal, what=what, stride=stride)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    return [(starts[c], p.recv, p.send) for c, p in enumerate(plans)]
