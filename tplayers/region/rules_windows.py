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
(:class:`~tplayers.region.lengths.ShardLen`), and every view after a window partition in the same call
(``g.windows``), is read here as the serial view: the input's serial shape (every sharded factor at its
global length, one small all-gather), the serial sizes (a ShardLen's serial value, a plain int as
written; after model code made a length a plain number, ``g.lost``, a plain int equal to a sharded
dim's local length on every rank is also tried as that length), placed factor by factor as
:func:`~tplayers.domain.layout.reshape_layout` does, and a sharded factor that spans several new dims
split into (sharded outer, whole inner) when the inner part fills whole new dims. Of the readings that
fit, the one under which the code's own local call is the serial one; else the serial sizes. Where the
inner part does not divide every rank's length (a window across two ranks), the dim is moved to
whole-window shares first (:func:`move_windows`, :class:`~tplayers.comm.reshard.ReshardAlongDim`);
fewer windows than ranks is a ``ValueError`` on every rank naming the multiple. A reading that does not
fit falls back to the local reading of :mod:`tplayers.region.rules_views`. A dim whose size is a length
read as is (``view(-1, H, W, C)`` in ``window_reverse``) and whose factors are a sharded factor followed
by whole ones is that sharded dim again (the window rows merged back), moved back to the partition of
that length where the windows were moved. The length of a merged dim holding sharded factors reads as
a ShardLen of its serial length (:func:`folded_root`).
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

from tplayers.comm.collectives import exchange_grid_table
from tplayers.comm.reshard import ReshardAlongDim
from tplayers.domain.active import stepped_aside
from tplayers.domain.layout import Layout, LayoutError, prefix_of
from tplayers.region.lengths import MeshRoot, Root, ShardLen, is_read, serial

__all__ = ["wants_serial", "serial_view", "move_windows", "folded_root"]


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


def serial_view(g, x, lay: Layout, shape: Sequence):
    """:func:`_serial_view`, its outcome (no serial view, a serial view, refused) agreed by every rank on a
    partition's first call: it reads this rank's place in the grid of windows, and ranks that read the view
    differently would go on to different collectives (one moving windows, one refusing). A split outcome
    is refused on every rank (one small all-gather, first calls only: later calls decide the same)."""
    try:
        found, code = _serial_view(g, x, lay, shape), 1
        code = 0 if found is None else 1
    except LayoutError as e:
        found, code = e, 2
    if g.check:
        codes = sorted(set(_flat(_exchange(g, [code]))))
        if len(codes) > 1:
            raise LayoutError(
                f"a view of a tensor holding windows reads differently on different ranks (outcomes {codes}: 0 "
                "local, 1 serial, 2 refused): windows cannot be given whole to every rank with this partition; "
                "use a partition whose shares are window multiples"
            )
    if code == 2:
        raise found
    return found


def _flat(table) -> List[int]:
    return [v for t in table for v in _flat(t)] if isinstance(table, (list, tuple)) else [int(table)]


def _serial_view(g, x, lay: Layout, shape: Sequence):
    """The serial ``x.view(shape)`` on this rank: ``(local shape, layout, before, after)``, or ``None`` when the
    sizes do not make a serial view of ``x`` (then the local reading decides). ``before``: ``(tensor dim,
    mesh dim, old sizes, new sizes)`` moves of ``x`` to a partition of whole windows first; ``after``: ``(dim,
    mesh dim, sizes, sizes)`` moves of the result back to the partition of the length the code read (window
    rows merged back). Raises :class:`LayoutError` (the same on every rank) when windows cannot be given
    whole to the ranks."""
    local = [int(s) for s in x.shape]
    factors, dims = [], []  # (local size, axis) in row-major order (whole size-1 factors dropped), tensor dim
    for d, (size, entry) in enumerate(zip(local, lay)):
        for s, a in entry if entry else ((size, None),):
            if a is None and int(s) == 1:
                continue
            factors.append((int(s), a))
            dims.append(d if entry is not None and len(entry) == 1 else None)  # a plain sharded dim: movable
    sharded = [i for i, (_, a) in enumerate(factors) if a is not None]
    # Every length read from x is a ShardLen (folded_root). A plain size equal to the local length of a
    # sharded dim of x, on every rank, may be one that model code made a plain number (g.lost): tried both
    # ways then, else a plain size is the serial model's
    entries = [(int(n), e) for n, e in zip(local, lay) if e is not None and any(a is not None for _, a in e)]
    reads = [
        1 if g.lost and not isinstance(s, ShardLen) and int(s) != -1 and any(int(s) == n for n, _ in entries) else 0
        for s in shape
    ]
    table = _exchange(g, [factors[i][0] for i in sharded] + reads)
    sizes = {i: _along(g, table, factors[i][1], k) for k, i in enumerate(sharded)}
    rows = [r for plane in table for r in plane]
    flagged = [k for k in range(len(shape)) if all(r[len(sharded) + k] for r in rows)]
    total = 1
    for i, (s, _) in enumerate(factors):
        total *= sum(sizes[i]) if i in sizes else s
    me = {a: g.mesh.get_local_rank(a) for a in range(g.mesh.ndim)}
    wanted = _resolved(local, shape)
    matching, plain = [], None
    for n in range(len(flagged) + 1):
        for keep in itertools.combinations(flagged, n):
            read = [k in keep for k in range(len(shape))]
            new = _serial_shape(shape, read, entries, factors, sizes, total)
            placed = None if new is None else _place(factors, sizes, new, dims, me)
            if placed is None:
                continue
            out, every, moves, split = placed
            layout, after = _layout(out, every, shape)
            reading = (tuple(_prod(s for s, _ in e) if e else 1 for e in out), layout, moves, after, split)
            if reading[0] == wanted and not moves:  # the code's own local call is the serial one
                matching.append(reading)
            elif n == 0:
                plain = reading
    if len({r[1] for r in matching}) > 1:
        raise LayoutError(
            f"view {tuple(int(v) for v in shape)} of a tensor holding windows is ambiguous: a size equal to this "
            f"rank's length is a number the model made local ({g.lost}) or the serial model's; keep the length "
            "as read (x.shape, no int())"
        )
    # no reading makes the local call: the serial model's sizes (timm's num_win), unless a plain size may
    # be a number the model made local
    found = matching[0] if matching else plain if not flagged else None
    if found is None:
        return None
    shape_l, layout, moves, after, split = found
    before = [(dims[i], factors[i][1], sizes[i], new) for i, new in moves]
    g.windows = g.windows or split  # windows fold into the batch from here on: every view is read serially
    return shape_l, layout, before, after


def move_windows(g, func, args, kwargs, x, shape, local, layout, before, after):
    """Run a view read by :func:`serial_view`: ``x`` moved to whole-window shares first (``before``), the view
    with this rank's serial sizes, the result moved back to the partition the code read (``after``); each
    move one all-gather of the dim (:class:`~tplayers.comm.reshard.ReshardAlongDim`), its adjoint in backward."""
    if before or after:
        g.settle()
    with stepped_aside(g, settle=False):
        for d, axis, old, new in before:
            x = ReshardAlongDim.apply(x, d, old, new, g.groups[axis])
        if not before and _resolved([int(v) for v in x.shape], shape) == tuple(local):
            out = func(*args, **kwargs)
        else:  # not the code's own call: a compiled region (no guard) would make the code's, so refused there
            g.acted = True
            out = x.reshape(local) if func.__name__ == "reshape" else x.view(local)
        for d, axis, old, new in after:
            g.acted = True
            out = ReshardAlongDim.apply(out, d, old, new, g.groups[axis])
    return out


def _resolved(local, shape) -> tuple:
    """``shape`` as a local view of a tensor of shape ``local`` resolves it (``-1`` filled in)."""
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = _prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = _prod(local) // known if known else 0
    return tuple(shape)


def _layout(out, every, shape):
    """``(layout, after)`` of a placement: a dim whose size is a length read as is from a plain sharded dim and
    whose factors are a sharded factor followed by whole ones is that sharded dim again (the window rows
    merged back); ``after`` lists the moves back to the partition of the length read where the windows
    were moved to whole-window shares (:func:`_place`)."""
    layout, after = [], []
    for k, e in enumerate(out):
        s = shape[k]
        if e and e[0][1] is not None and all(a is None for _, a in e[1:]) and len(e) > 1:
            root = s.roots[0] if is_read(s) else None
            if root is not None and root.axis == e[0][1] and not getattr(root, "folded", False):
                inner = _prod(n for n, _ in e[1:])
                held = [c * inner for c in every[k]]
                if held != root.sizes():  # whole-window shares: back to the partition the code read
                    after.append((k, e[0][1], held, root.sizes()))
                e = [(int(s), e[0][1])]
        layout.append(tuple(e) if any(a is not None for _, a in e) else None)
    return tuple(layout), after


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
    """The serial length of a sharded entry of the input (its sharded factors, in order, are in ``factors``)."""
    n, j = 1, 0
    for s, a in entry:
        if a is None:
            n *= int(s)
            continue
        while factors[j] != (int(s), a) or j not in sizes:
            j += 1
        n *= sum(sizes[j])
        j += 1
    return n


def _prod(vals) -> int:
    n = 1
    for v in vals:
        n *= int(v)
    return n


def _place(factors, sizes, new: List[int], dims, me):
    """``(each new dim's factors, each new dim's sharded factor's sizes on every rank, moves, split)`` or
    ``None`` when the serial sizes do not fit the factors. Factors ``(local size, axis)``: whole runs cut at
    the new dims' bounds, a sharded factor placed in the one new dim that holds it, or split into (sharded
    outer, whole inner) when the inner part fills whole new dims. When the inner part does not divide every
    rank's length (a window across two ranks), the factor's dim (a plain sharded dim: ``dims``) is moved to
    whole-window shares first (``moves``: ``(factor index, new sizes)``, balanced in windows)."""
    bounds = [1]
    for t in new:
        bounds.append(bounds[-1] * t)
    n = len(new)
    out: List[list] = [[] for _ in range(n)]
    every_out: List[Optional[List[int]]] = [None] * n
    moves, split = [], False
    pos, run = 1, 1
    items = []
    for i, (s, a) in enumerate(factors):  # merge adjacent whole factors (whole dims split and merge freely)
        if a is None:
            run *= s
            continue
        if run > 1:
            items.append((run, None, None, None))
        run = 1
        items.append((s, a, sizes[i], i))
    if run > 1:
        items.append((run, None, None, None))
    for s, a, every, i in items:
        glob = s if a is None else sum(every)
        end = pos * glob
        if a is None:
            if not _whole(out, bounds, pos, end):
                return None
            pos = end
            continue
        cands = [
            k
            for k in range(n)
            if bounds[k] <= pos and end <= bounds[k + 1] and pos % bounds[k] == 0 and bounds[k + 1] % end == 0
        ]
        if len(cands) == 1:
            out[cands[0]].append((s, a))
            every_out[cands[0]] = list(every)
        elif cands:
            return None
        else:
            k = next((k for k in range(n) if bounds[k] <= pos < bounds[k + 1]), None)
            if k is None or pos % bounds[k] or bounds[k + 1] % pos:
                return None
            outer = bounds[k + 1] // pos
            if outer <= 1 or glob % outer:
                return None
            inner = glob // outer
            if bounds[k + 1] * inner not in bounds:
                return None  # the rows of a window must fill whole new dims
            if any(c % inner for c in every):
                every = _whole_windows(every, outer, inner, dims[i])
                moves.append((i, every))
                s = every[me[a]]
            out[k].append((s // inner, a))
            every_out[k] = [c // inner for c in every]
            split = True
            if not _whole(out, bounds, bounds[k + 1], bounds[k + 1] * inner):
                return None
        pos = end
    return out, every_out, moves, split


def _whole_windows(every, windows: int, inner: int, dim) -> List[int]:
    """Every rank's rows when ``windows`` windows of ``inner`` rows are shared out as evenly as possible (the
    first ranks one more); a :class:`LayoutError` when a rank would hold none or the dim merges others."""
    ranks = len(every)
    if dim is None or windows < ranks:
        raise LayoutError(
            f"a window partition splits a sharded dim of length {sum(every)} into {windows} windows of {inner} rows, "
            f"but the ranks hold {list(every)} rows: a window would cross two ranks"
            + (f", and {windows} windows cannot give each of {ranks} ranks one" if dim is not None else "")
            + f". Give every rank a multiple of {inner} rows along this dim (a length per rank that is a multiple "
            f"of {inner} times the downsampling before this op: the patch size, patch merging), or use fewer ranks"
        )
    return [(windows // ranks + (1 if r < windows % ranks else 0)) * inner for r in range(ranks)]


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
