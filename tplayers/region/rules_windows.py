"""Views read as the serial model reads them: window partitions (Swin), windows folded into the batch.

A window-partitioned vision transformer (timm's and HF's Swin, MONAI's SwinUNETR) cuts the image
into ``ws x ws`` windows and folds them into the batch dim: ``x.view(B, H // ws, ws, W // ws, ws,
C)``, a ``permute``, ``.view(-1, ws * ws, C)``, attention per window, and ``window_reverse`` back.
Along a sharded ``H`` that view *splits* the sharded factor into (window rows, rows of a window).
When every rank's length along the dim is a multiple of ``ws`` (shard boundaries on window
boundaries), the windows never cross ranks: the window-row factor is sharded like the rows were
(each rank holds whole windows, a contiguous block of them) and the rows of a window are whole.
The batch dim of the windows then holds ``(B, window rows (sharded), window cols)`` folded together
(a *folded* entry: a whole factor before a sharded one), and everything per window is local.

Local shapes alone cannot read such views: a rank holding exactly one window row makes the same
local call as one inserting a size-1 dim, and a size the model computes from the serial window count
(timm: ``attn.view(-1, num_win, heads, N, N)`` with ``num_win`` the global number of windows, its
shift mask's length) is not this rank's. So a view whose sizes hold a length read from a sharded dim
(:class:`~tplayers.region.lengths.ShardLen`), or of a tensor with a folded entry, is read here as
the serial view: the input's serial shape (every sharded factor at its global length, one small
all-gather), the serial sizes (a ShardLen's serial value; a plain int as written, except one equal to
a folded entry's local length on every rank, which is that entry's length as read), placed factor by
factor as :func:`~tplayers.domain.layout.reshape_layout` does, and a sharded factor that spans several
new dims split into (sharded outer, whole inner) when the inner part fills whole new dims and divides
every rank's length (else a ``ValueError`` on every rank naming the multiple). The local call is then
the serial one with every sharded factor at its local length. A reading that does not fit (sizes
computed from local numbers: ``int(h)``) falls back to the local reading of
:mod:`tplayers.region.rules_views`. A dim whose size is a length read as is (``view(-1, H, W, C)``
in ``window_reverse``) and whose factors are a sharded factor followed by whole ones is that
sharded dim again (a contiguous block per rank: the window rows merged back).
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

from tplayers.comm.collectives import exchange_grid_table
from tplayers.domain.active import stepped_aside
from tplayers.domain.layout import Layout, LayoutError, prefix_of
from tplayers.region.lengths import MeshRoot, Root, ShardLen, is_read, serial

__all__ = ["wants_serial", "serial_view", "folded", "folded_root"]


def folded(entry) -> bool:
    """Whether a layout entry folds a whole factor (of size > 1) before a sharded one (windows in the batch)."""
    seen_whole = False
    for size, axis in entry or ():
        if axis is None:
            seen_whole = seen_whole or int(size) > 1
        elif seen_whole:
            return True
    return False


def wants_serial(g, lay: Layout, shape: Sequence) -> bool:
    """Whether a view of a tensor with layout ``lay`` to sizes ``shape`` is read as the serial view: a size
    is a length read from a sharded dim, or this call has split a sharded dim into windows already
    (``g.windows``). Decided from the code's sizes' types and the call's history, the same on every rank."""
    if any(prefix_of(e) for e in lay):
        return False
    return g.windows or any(isinstance(s, ShardLen) for s in shape)


def folded_root(g, t, d: int) -> Optional[Root]:
    """The :class:`~tplayers.region.lengths.Root` of a merged dim holding one sharded factor among whole ones
    (windows folded into the batch, ``(B, window rows, window cols)``; flattened pixels): its serial length
    is the sum of every rank's local length along that mesh dim (the whole factors are the same on every
    rank), so ``B_ // num_win`` reads as the serial model's batch. Its ``offset`` has no meaning (the rank's
    elements are strided); only its total is read (:func:`~tplayers.region.lengths.serial`). ``None`` for
    other dims (a plain dim's root is :meth:`RegionGuard.root`; prefixed entries stay plain). A dim holding
    factors sharded over both dims of a 2-D mesh: a :class:`~tplayers.region.lengths.MeshRoot` (the sum over
    the whole mesh)."""
    lay = g.layout(t)
    entry = lay[d] if lay is not None else None
    if entry is None or len(entry) < 2 or prefix_of(entry):
        return None
    axes = {a for _, a in entry if a is not None}
    if len(axes) != 1 and len(axes) != len(g.groups):
        return None
    key = (id(t), d, "folded")
    hit = g.roots.get(key)
    if hit is None or hit[0] is not t:
        with stepped_aside(g, settle=False):
            n = int(t.shape[d])
        if len(axes) == 1:
            axis = axes.pop()
            root = Root(n, g.groups[axis], axis)
            root.folded = True  # a merged dim: its length as read is not the plain sharded dim (_layout)
        else:
            root = MeshRoot(n, g.groups)
        hit = (t, root)
        g.roots[key] = hit
    return hit[1]


def _exchange(g, row: List[int]):
    """Every rank's ``row`` (one small all-gather per mesh dim), pending agreements settled first."""
    if getattr(g, "pending", 0):
        g.settle()
    with stepped_aside(g, settle=False):
        return exchange_grid_table(row, g.groups, "region.windows")


def _along(g, table, axis: int, j: int) -> List[int]:
    """Column ``j`` of every rank's row along mesh dim ``axis``, at this rank's coordinate on the others."""
    if g.mesh.ndim == 1:
        return [table[c][0][j] for c in range(len(table))]
    me = [g.mesh.get_local_rank(i) for i in range(g.mesh.ndim)]
    if axis == 0:
        return [table[c][me[1]][j] for c in range(len(table))]
    return [table[me[0]][c][j] for c in range(len(table[0]))]


def serial_view(g, x, lay: Layout, shape: Sequence) -> Optional[Tuple[Tuple[int, ...], Layout]]:
    """``(local shape, layout)`` of the serial ``x.view(shape)`` on this rank, or ``None`` when the sizes do
    not make a serial view of ``x`` (then the local reading decides). Raises :class:`LayoutError` (the same
    on every rank) when windows would cross shard boundaries."""
    local = [int(s) for s in x.shape]
    factors = []  # (local size, axis) in row-major order, whole size-1 factors dropped
    for size, entry in zip(local, lay):
        for s, a in entry if entry else ((size, None),):
            if a is None and int(s) == 1:
                continue
            factors.append((int(s), a))
    sharded = [i for i, (_, a) in enumerate(factors) if a is not None]
    # a plain size equal to the local length of a dim merging factors sharded over two mesh dims, on every
    # rank, is that length as read (other dims' lengths read as ShardLens: folded_root)
    entries = [(int(n), e) for n, e in zip(local, lay) if e is not None and len({a for _, a in e} - {None}) > 1]
    reads = [
        1 if not isinstance(s, ShardLen) and int(s) != -1 and any(int(s) == n for n, _ in entries) else 0 for s in shape
    ]
    table = _exchange(g, [factors[i][0] for i in sharded] + reads)
    sizes = {i: _along(g, table, factors[i][1], k) for k, i in enumerate(sharded)}
    rows = [r for plane in table for r in plane]
    read_all = [all(r[len(sharded) + k] for r in rows) for k in range(len(shape))]
    total = 1
    for i, (s, _) in enumerate(factors):
        total *= sum(sizes[i]) if i in sizes else s
    wanted = _resolved(local, shape)
    flagged = [k for k, r in enumerate(read_all) if r]
    found = None
    for n in range(len(flagged), -1, -1):  # lengths as read (most first), else as written
        for keep in itertools.combinations(flagged, n):
            read = [k in keep for k in range(len(shape))]
            new = _serial_shape(shape, read, entries, factors, sizes, total)
            out, split = (None, False) if new is None else _place(factors, sizes, new)
            if out is None:
                continue
            reading = (tuple(_prod(s for s, _ in e) if e else 1 for e in out), _layout(out, shape), split)
            if reading[0] == wanted:  # the reading under which the code's own local call is the serial one
                found = reading
                break
            if n == 0:  # no reading makes the local call: sizes of the serial model (timm's num_win)
                found = reading
        if found is not None and found[0] == wanted:
            break
    if found is None:
        return None
    g.windows = g.windows or found[2]  # windows fold into the batch from here on: every view is read serially
    return found[0], found[1]


def _resolved(local, shape) -> tuple:
    """``shape`` as a local view of a tensor of shape ``local`` resolves it (``-1`` filled in)."""
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = _prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = _prod(local) // known if known else 0
    return tuple(shape)


def _layout(out, shape) -> Layout:
    layout = []
    for k, e in enumerate(out):
        s = shape[k]
        if e and e[0][1] is not None and all(a is None for _, a in e[1:]) and len(e) > 1:
            if (
                is_read(s) and s.roots[0].axis == e[0][1] and not getattr(s.roots[0], "folded", False)
            ):  # the window rows merged back: the sharded dim again
                e = [(_prod(n for n, _ in e), e[0][1])]
        layout.append(tuple(e) if any(a is not None for _, a in e) else None)
    return tuple(layout)


def _serial_shape(shape, read, entries, factors, sizes, total) -> Optional[List[int]]:
    """The serial sizes of a view: ShardLens' serial values, lengths as read (``read``) their entries' serial
    lengths, ``-1`` filled in; ``None`` when they do not make the serial numel ``total``."""
    new: List[Optional[int]] = []
    for k, s in enumerate(shape):
        if isinstance(s, ShardLen):
            new.append(int(serial(s)))
        elif int(s) == -1:
            new.append(None)
        elif read[k]:
            hits = [e for n, e in entries if n == int(s)]
            if len({tuple(a for _, a in e) for e in hits}) != 1:
                return None
            new.append(_serial_len(hits[0], factors, sizes))
        else:
            new.append(int(s))
    if new.count(None) > 1:
        return None
    known = _prod(s for s in new if s is not None)
    if None in new:
        if not known or total % known:
            return None
        new[new.index(None)] = total // known
    return new if _prod(new) == total else None


def _serial_len(entry, factors, sizes) -> int:
    """The serial length of a folded entry of the input (the same factors, in order, as in ``factors``)."""
    n, j = 1, 0
    for s, a in entry:
        if a is None:
            n *= int(s)
            continue
        while factors[j][1] is None or factors[j][0] != int(s) or j not in sizes:
            j += 1
        n *= sum(sizes[j])
        j += 1
    return n


def _prod(vals) -> int:
    n = 1
    for v in vals:
        n *= int(v)
    return n


def _place(factors, sizes, new: List[int]):
    """``(each new dim's factors, whether a sharded factor was split)``: factors ``(local size, axis)``: whole runs cut at the new dims' bounds, a sharded factor
    placed in the one new dim that holds it, or split into (sharded outer, whole inner) when the inner part
    fills whole new dims; ``(None, False)`` when the serial sizes do not fit the factors."""
    bounds = [1]
    for t in new:
        bounds.append(bounds[-1] * t)
    n = len(new)
    out: List[list] = [[] for _ in range(n)]
    pos, run, split = 1, 1, False
    items = []
    for i, (s, a) in enumerate(factors):  # merge adjacent whole factors (whole dims split and merge freely)
        if a is None:
            run *= s
            continue
        if run > 1:
            items.append((run, None, None))
        run = 1
        items.append((s, a, sizes[i]))
    if run > 1:
        items.append((run, None, None))
    for s, a, every in items:
        glob = s if a is None else sum(every)
        end = pos * glob
        if a is None:
            if not _whole(out, bounds, pos, end):
                return None, False
            pos = end
            continue
        cands = [
            k
            for k in range(n)
            if bounds[k] <= pos and end <= bounds[k + 1] and pos % bounds[k] == 0 and bounds[k + 1] % end == 0
        ]
        if len(cands) == 1:
            out[cands[0]].append((s, a))
        elif cands:
            return None, False
        else:
            k = next((k for k in range(n) if bounds[k] <= pos < bounds[k + 1]), None)
            if k is None or pos % bounds[k] or bounds[k + 1] % pos:
                return None, False
            outer = bounds[k + 1] // pos
            if outer <= 1 or glob % outer:
                return None, False
            inner = glob // outer
            if bounds[k + 1] * inner not in bounds:
                return None, False  # the rows of a window must fill whole new dims
            bad = [c for c in every if c % inner]
            if bad:
                raise LayoutError(
                    f"a window partition splits a sharded dim of length {glob} into {outer} windows of {inner} rows, "
                    f"but the ranks hold {every} rows: a window would cross two ranks. Give every rank a multiple of "
                    f"{inner} rows along this dim (an input length per rank that is a multiple of {inner} times the "
                    "downsampling before this op: the patch size, patch merging), or use fewer ranks"
                )
            out[k].append((s // inner, a))
            split = True
            if not _whole(out, bounds, bounds[k + 1], bounds[k + 1] * inner):
                return None, False
        pos = end
    return out, split


def _whole(out, bounds, pos: int, end: int) -> bool:
    """Cut the whole run ``[pos, end)`` at the new dims' bounds into ``out``; ``False`` when a piece is not integral."""
    for k in range(len(out)):
        lo, hi = max(pos, bounds[k]), min(end, bounds[k + 1])
        if hi <= lo:
            continue
        if hi % lo:
            return False
        out[k].append((hi // lo, None))
    return True
