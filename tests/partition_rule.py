"""Which partitions of a sharded dim a window op can run on, decided by the tests, not by the library.

The parity grids draw random partitions; if they asked the library's own planner which ones are
valid, a planner that started refusing valid partitions would just run fewer cases. These rules are
written from the documented contract instead (the partition rule of docs/domain-parallel.md, the
module docstring of ``tplayers.window_plan`` and its error messages), with no tplayers import:

* output rows: a window op whose output length equals its input length keeps the input's partition,
  any other gives the balanced one (the first ``n % parts`` shards one row longer);
* output row ``o`` reads the extended input rows ``o*stride - pad_lo + [0, dilation*(kernel-1)]``;
  rows outside ``[0, L)`` are boundary rows: padded locally by the shard (zeros, a constant,
  reflected, replicated), or, for a periodic (circular) dim, the wrapped rows of the other end;
* a shard receives every row between its own rows and the farthest row its outputs read (a halo on
  each side), and halos come from the adjacent shard only: each halo must fit in that neighbour
  (an edge shard has no outer neighbour unless the dim is periodic);
* reflect / replicate boundary rows are padded from the rows the shard holds after its halo
  exchange, so the rows they copy (``1..p`` reflected, row 0 replicated; likewise at the far end)
  must be among them.

Neighborhood attention (:func:`na_partition_ok`) reads the keys NATTEN's own rule gives
(``na_oracle.natten_mask_1d``, written from NATTEN, not from tplayers); with ``tile`` each shard
needs a contiguous tile around its queries that, taken as a whole image, gives every one of its
queries its global window. (The library's tile search grows the tile from the key span one dilation
step at a time and can overshoot a tile that fits: e.g. ``[1, 3, 1, 0]``, kernel 2, dilation 2, tile
``(0, 4)`` fits shard 0 but the search takes ``(0, 5)`` and refuses; about 1.5% of the random valid
tile cases. No grid seed here draws one today; one that did would fail as "refused a partition the
rule calls feasible", rightly.)
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from na_oracle import natten_mask_1d


def balanced(n: int, parts: int) -> list:
    """``n`` rows over ``parts`` shards, the first ``n % parts`` one row longer."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _starts(sizes: Sequence[int]) -> list:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _halos_fit(sizes: Sequence[int], c: int, first: int, stop: int, periodic: bool) -> bool:
    """Shard ``c`` reads the rows ``[first, stop)`` (beyond its ends when ``periodic``: wrapped):
    the rows between them and its own rows must fit in its adjacent neighbours."""
    n, start = len(sizes), _starts(sizes)[c]
    end = start + sizes[c]
    need_lo, need_hi = max(0, start - first), max(0, stop - end)
    lo_nb = c - 1 if c > 0 else (n - 1 if periodic else None)
    hi_nb = c + 1 if c < n - 1 else (0 if periodic else None)
    if need_lo and (lo_nb is None or need_lo > sizes[lo_nb]):
        return False
    if need_hi and (hi_nb is None or need_hi > sizes[hi_nb]):
        return False
    return True


def window_partition_ok(
    sizes: Sequence[int], out_len: int, kernel: int, stride: int, dilation: int, pad_lo: int, mode: str
) -> bool:
    """Whether a convolution / pooling window (``mode``: zeros, fill, circular, reflect, replicate)
    can run with its input sharded as ``sizes`` along the dim, by the rules of the module docstring.
    ``out_len`` is the serial output length (the caller checks that the serial op accepts the case)."""
    sizes = [int(s) for s in sizes]
    n, length = len(sizes), sum(sizes)
    if out_len <= 0:
        return False
    outs = sizes if out_len == length else balanced(out_len, n)
    starts, out_starts = _starts(sizes), _starts(outs)
    periodic = mode == "circular"
    for c in range(n):
        if not outs[c]:
            continue  # owns no output row: reads nothing
        first = out_starts[c] * stride - pad_lo  # first extended row read
        last = (out_starts[c] + outs[c] - 1) * stride - pad_lo + dilation * (kernel - 1)  # last one (inclusive)
        if periodic:
            lo_row, hi_row = first, last + 1  # rows beyond the ends are the other end's, wrapped
        else:
            lo_row, hi_row = min(max(first, 0), length), min(max(last + 1, 0), length)  # real rows only
        if not _halos_fit(sizes, c, lo_row, hi_row, periodic):
            return False
        if mode in ("reflect", "replicate"):
            held = range(min(starts[c], lo_row), max(starts[c] + sizes[c], hi_row))  # after the exchange
            copied = []
            if first < 0:
                copied += list(range(1, -first + 1)) if mode == "reflect" else [0]
            if last >= length:
                over = last - length + 1
                copied += list(range(length - 1 - over, length - 1)) if mode == "reflect" else [length - 1]
            if any(r not in held for r in copied):
                return False
    return True


@lru_cache(maxsize=None)
def _mask(length: int, kernel: int, stride: int, dilation: int, causal: bool):
    return natten_mask_1d(length, kernel, stride, dilation, causal)


def na_partition_ok(
    sizes: Sequence[int], kernel: int, stride: int, dilation: int, causal: bool, tile: bool = False
) -> bool:
    """Whether neighborhood attention along a dim sharded as ``sizes`` can run: every shard's keys
    (NATTEN's windows of its queries) within reach of its adjacent neighbours; with ``tile``, some
    tile within that reach reproduces every one of its queries' windows as a whole image."""
    sizes = [int(s) for s in sizes]
    n, length = len(sizes), sum(sizes)
    if kernel * dilation > length:
        return False  # NATTEN's own requirement
    mask = _mask(length, kernel, stride, dilation, causal)
    starts = _starts(sizes)
    for c in range(n):
        s, e = starts[c], starts[c] + sizes[c]
        if s == e:
            continue  # no queries
        keys = mask[s:e].any(0).nonzero().flatten().tolist()
        lo, hi = min(keys[0], s), max(keys[-1] + 1, e)
        if not tile:
            if not _halos_fit(sizes, c, lo, hi, False):
                return False
            continue
        reach_lo = starts[c - 1] if c > 0 else 0
        reach_hi = starts[c + 1] + sizes[c + 1] if c < n - 1 else length
        # any tile within reach (tplayers.ops.na_layout.tile_span searches from the key span outwards,
        # one dilation step at a time, and misses some of these: see the module docstring)
        if not any(
            _tile_ok(mask, s, e, a, b, kernel, stride, dilation, causal)
            for a in range(reach_lo, lo + 1)
            for b in range(hi, reach_hi + 1)
        ):
            return False
    return True


def _tile_ok(mask, s: int, e: int, a: int, b: int, kernel: int, stride: int, dilation: int, causal: bool) -> bool:
    """The rows ``[a, b)``, as a whole image, give queries ``[s, e)`` their global windows."""
    if (b - a) < kernel * dilation:
        return False
    local = _mask(b - a, kernel, stride, dilation, causal)
    return bool((local[s - a : e - a] == mask[s:e, a:b]).all())
