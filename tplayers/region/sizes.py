"""One meaning for a size: ``F.interpolate(size=)`` and adaptive pools' ``output_size`` inside a region.

A size is the serial model's number: global, as ``nn.Upsample(size=)`` and
``nn.AdaptiveAvgPool2d(7)`` (twins) always read it. Inside a region, though, shapes are local
(``x.shape`` is this rank's slice), so a size derived from a sharded tensor's shape (``size=
skip.shape[2:]`` in a U-Net decoder, ``size=input.shape[-2:]`` in a segmentation head) is this
rank's share of the target. Along each sharded dim the routed call tells the two apart from every
rank's size, its input length and whether its size is a local length along that dim that the
region's code has read (``x.shape``, ``x.size()``; :meth:`RegionGuard.note_read`), all exchanged in
one small all-gather per mesh dim, so every rank takes the same decision from the same table:

* the sizes differ between ranks: a global size is the same on every rank, so they are the ranks'
  shares; the global size is their sum, and they must be the partition the window core produces
  (the input's when the length is kept, else the balanced one), else ``ValueError``;
* the same size on every rank, and on some rank it is not a local length the code read: global;
* the same size on every rank, and on every rank a local length the code read or a small multiple
  or fraction of one (an even partition of a skip, ``size=(2 * h, 2 * w)`` from ``x.shape``, or a
  constant that happens to be so everywhere): the readings differ (``ranks x`` the rows against the
  rows) and cannot be told apart: ``ValueError`` on every rank, naming the op, the size and the fixes.

A size the code derived from a length it read (``skip.shape[2:]``, ``2 * h``, ``h // 2 + 1``) is a
:class:`~tplayers.region.lengths.ShardLen` that carries its serial value: it is read as that, never
ambiguous. The table below is for sizes that lost it (``int(h)``, a size computed in numpy).

Recognised arithmetic (for those): the length itself, multiples and fractions of it up to 8x (``h * 2``,
``h // 4``); other arithmetic on local lengths that comes out the same on every rank is read as
global (write ``scale_factor=`` for it).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from tplayers.comm.collectives import exchange_grid_table
from tplayers.region.lengths import ShardLen, serial
from tplayers.window_plan import out_partition

__all__ = ["global_sizes"]

_NONE = -1  # an adaptive pool's ``None`` (keep the length)


def _raw(size, n_sp: int) -> list:
    return list(size) if isinstance(size, (list, tuple, torch.Size)) else [size] * n_sp


def _per_dim(size, n_sp: int) -> List[Optional[int]]:
    return [None if s is None else int(serial(s)) for s in _raw(size, n_sp)]


def _lines(table, axis: int) -> List[list]:
    """The rows of ``table`` (``table[c0][c1]``) grouped into lines along mesh dim ``axis``."""
    if axis == 0:
        return [[table[c0][c1] for c0 in range(len(table))] for c1 in range(len(table[0]))]
    return [list(line) for line in table]


def _local_total(lines, i: int) -> Optional[int]:
    """The global length if column ``i`` of every line is its ranks' shares of one, as the window core
    partitions it (the input's partition when kept, else balanced); else ``None``."""
    totals = set()
    for line in lines:
        want, have = [r[i] for r in line], [r[i + 1] for r in line]
        total = sum(want)
        if want != out_partition(have, total):
            return None
        totals.add(total)
    return totals.pop() if len(totals) == 1 else None


def _derived(s: int, r: int) -> bool:
    """Whether ``s`` may come from the read local length ``r`` by the arithmetic models do on it: ``r``
    itself, a small multiple (``2 * h``) or a small fraction (``h // 2``)."""
    if s == r:
        return True
    if r <= 0 or s <= 1:  # 1: a global pooling's size, not a fraction of a length
        return False
    return (s % r == 0 and s // r <= _RATIO) or (r % s == 0 and r // s <= _RATIO)


_RATIO = 8  # the largest scale a size derived from a local length is recognised at (2x, 4x, 8x and back)


def global_sizes(g, x: torch.Tensor, dims: Sequence[int], size, what: str) -> Tuple[Optional[int], ...]:
    """Global target sizes of every spatial dim of ``x`` for the routed ``what`` (see the module docstring).
    ``dims[i]`` is the tensor dim sharded over mesh dim ``i``; ``size`` as the op takes it."""
    n_sp = x.dim() - 2
    per = _per_dim(size, n_sp)
    traced = [isinstance(v, ShardLen) for v in _raw(size, n_sp)]  # carries its serial value: never ambiguous
    if len(per) != n_sp:
        raise g.error(f"{what}: size {size!r} has {len(per)} entries for {n_sp} spatial dims")
    row = []
    for axis, d in enumerate(dims):
        s = per[d - 2]
        hit = s is not None and not traced[d - 2] and any(_derived(s, r) for r in g.reads.get(axis, ()))
        row += [_NONE if s is None else s, int(x.shape[d]), int(hit)]
    table = exchange_grid_table(row, g.groups, "region.sizes")
    cells = [r for line in table for r in line]
    out = list(per)
    for axis, d in enumerate(dims):
        i = 3 * axis
        wants = sorted({r[i] for r in cells})
        if wants == [_NONE]:
            continue
        shown = f"{what}: size {tuple(size) if isinstance(size, (list, tuple)) else size!r}"
        if _NONE in wants:
            raise g.error(f"{shown}: None along sharded dim {d} on some ranks only")
        k = g.groups[axis].size()
        local = _local_total(_lines(table, axis), i) if k > 1 else None
        if len(wants) > 1:
            if local is None:
                ranks = [r[i] for r in cells]
                raise g.error(
                    f"{shown}: along sharded dim {d} the ranks ask for {ranks}, which is neither a "
                    "global size (the same on every rank) nor the ranks' shares of the partition "
                    "the window core produces",
                    advice=_ADVICE,
                )
            out[d - 2] = local
            continue
        s = wants[0]
        if local is not None and all(r[i + 2] for r in cells):
            raise g.error(
                f"{shown} is {s} along sharded dim {d} on every rank, and {s} is a local length along "
                f"that dim that this region's code read (x.shape, x.size()), or a small multiple or "
                f"fraction of one, on every rank: "
                f"read as this rank's share it means {local} rows in all, read as the global size "
                f"(as nn.Upsample / nn.AdaptiveAvgPool modules read it) {s} rows. The two cannot be "
                "told apart",
                advice=_ADVICE,
            )
        out[d - 2] = s
    return tuple(out)


_ADVICE = (
    "For a global size: build the module (nn.Upsample(size=...), nn.AdaptiveAvgPool2d(...)) in __init__, "
    "whose size is always global, or call tplayers.functional's form with mesh= and shard_dims=. For a "
    "size derived from a sharded tensor (skip.shape[2:]): use scale_factor= (with recompute_scale_factor="
    "True when the ratio is not an integer); shares that differ between ranks are always read as local."
)
