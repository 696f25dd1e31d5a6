"""Which dims of a tensor inside a domain region are domain-sharded: the layout the region guard follows.

A *layout* has one entry per tensor dim: ``None`` for a dim that is whole on every rank, or a
tuple of *factors* ``((local_size, mesh_dim), ...)`` in row-major order for a dim that holds a
sharded dim of the region, possibly merged with whole ones by a reshape (``mesh_dim`` is the
mesh dim a factor is sharded over, or ``None``). ``x.flatten(2)`` of an ``(N, C, H, W)`` tensor
sharded along H gives ``(None, None, ((H_local, 0), (W, None)))``: the token dim of an attention over
pixels, whose local tokens are a contiguous block of the global row-major order; along W they are
strided. Layouts are canonical (:func:`canonical_layout`): whole factors of size 1 (a batch or
channel dim of size 1) are dropped and adjacent whole factors merged, so two layouts describing the
same sharding compare equal. Everything here is arithmetic on Python ints: no communication, no
torch calls.

*Prefix tokens* (a ViT's CLS token, DeiT's distillation token, registers): ``cat((cls, tokens), 1)``
of ``k`` replicated tokens before tokens sharded along the flattened pixels. In the serial model
the token dim is ``[k prefix tokens, then the pixels in row-major order]``; the prefix tokens live
on the *first* rank (coordinate 0 along every mesh dim of the entry's sharded factors), before its
own pixels, so every token lives on exactly one rank. The entry is then
``((k, PREFIX), *factors)``: its local length is ``k + prod(factors)`` on the first rank and
``prod(factors)`` on the others (the prefix factor adds, the others multiply). A prefixed dim is
moved by views as a whole (:func:`reshape_layout` splits and merges the other dims around it) and
never merged with another dim; :func:`prefix_of` / :func:`drop_prefix` / :func:`add_prefix` read and
build such entries, and :func:`mesh_dims_of` never lists ``PREFIX``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Factor = Tuple[int, Optional[int]]  # (local size, mesh dim or None)
Layout = Tuple[Optional[Tuple[Factor, ...]], ...]

__all__ = [
    "Factor",
    "Layout",
    "LayoutError",
    "region_layout",
    "sharded_dims",
    "mesh_dims_of",
    "is_sharded",
    "reshape_layout",
    "flatten_layout",
    "unflatten_layout",
    "canonical_layout",
    "permute_layout",
    "broadcast_layouts",
    "drop_dims",
    "insert_dim",
    "PREFIX",
    "prefix_of",
    "drop_prefix",
    "add_prefix",
    "contiguous_blocks",
]

#: the mesh dim of a prefix factor ``(k, PREFIX)``: ``k`` tokens held by the entry's first rank (module docstring)
PREFIX = -1


class LayoutError(ValueError):
    """An op would mix a sharded dim in a way the guard cannot prove exact (the message says how)."""


def region_layout(shape: Sequence[int], shard_dims: Sequence[int]) -> Layout:
    """The layout of a region input: tensor dim ``shard_dims[i]`` sharded over mesh dim ``i``."""
    return tuple(((int(shape[d]), shard_dims.index(d)),) if d in shard_dims else None for d in range(len(shape)))


def sharded_dims(layout: Layout) -> Tuple[int, ...]:
    """Tensor dims holding a sharded factor."""
    return tuple(d for d, f in enumerate(layout) if f is not None and any(a is not None for _, a in f))


def mesh_dims_of(layout: Layout, dims: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """Mesh dims the given tensor dims (default all) are sharded over, sorted."""
    dims = range(len(layout)) if dims is None else dims
    return tuple(sorted({a for d in dims if layout[d] for _, a in layout[d] if a is not None and a != PREFIX}))


def prefix_of(entry) -> int:
    """The number of prefix tokens of a layout entry (0 for a plain or whole entry)."""
    return int(entry[0][0]) if entry and entry[0][1] == PREFIX else 0


def drop_prefix(entry):
    """``entry`` without its prefix factor (the sharded pixel tokens alone)."""
    return tuple(entry[1:]) if prefix_of(entry) else entry


def add_prefix(entry, k: int):
    """The entry of ``k`` replicated tokens concatenated before tokens of the sharded ``entry``."""
    if prefix_of(entry) or not entry or not any(a is not None for _, a in entry):
        raise LayoutError("prefix tokens go before a sharded entry without a prefix")
    return ((int(k), PREFIX),) + tuple(entry)


def _opaque(layout: Layout, shape: Sequence[int]):
    """``layout`` with each prefixed entry replaced by one sharded factor of a unique placeholder mesh dim
    (so views move it as a whole), and the map back."""
    back, out = {}, []
    for d, e in enumerate(layout):
        if prefix_of(e):
            axis = -100 - d
            back[axis] = e
            out.append(((int(shape[d]), axis),))
        else:
            out.append(e)
    return tuple(out), back


def _restore(layout: Layout, back) -> Layout:
    out = []
    for e in layout:
        hits = [a for _, a in e or () if a in back]
        if hits and len(e) != 1:
            raise LayoutError(
                "a view merges the token dim holding prefix tokens (a CLS token) with other dims; keep it whole"
            )
        out.append(back[hits[0]] if hits else e)
    return tuple(out)


def is_sharded(layout: Optional[Layout]) -> bool:
    return layout is not None and bool(sharded_dims(layout))


def _factors(shape: Sequence[int], layout: Layout) -> List[Factor]:
    out: List[Factor] = []
    for size, entry in zip(shape, layout):
        out.extend(entry if entry else ((int(size), None),))
    return out


def _canonical(factors: Sequence[Factor]) -> List[Factor]:
    """The one spelling of a factor list: whole factors of size 1 dropped (they hold nothing: a batch
    or channel dim of size 1) and adjacent whole factors merged (whole dims split and merge freely).
    Sharded factors are kept as they are, size 1 included (a rank holding a single row)."""
    out: List[Factor] = []
    for size, axis in factors:
        size = int(size)
        if axis is None:
            if size == 1:
                continue
            if out and out[-1][1] is None:
                out[-1] = (out[-1][0] * size, None)
                continue
        out.append((size, axis))
    return out


def _entry(factors: Sequence[Factor]) -> Optional[Tuple[Factor, ...]]:
    factors = _canonical(factors)
    return tuple(factors) if any(a is not None for _, a in factors) else None


def canonical_layout(layout: Optional[Layout]) -> Optional[Layout]:
    """``layout`` with every entry in its one spelling (see :func:`_canonical`), so that layouts
    describing the same sharding compare equal: ``((1, None), (4, 0), (4, None))`` and
    ``((4, 0), (2, None), (2, None))`` are both ``((4, 0), (4, None))``."""
    if layout is None:
        return None
    return tuple(None if not e else _entry(e) for e in layout)


def _prod(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def reshape_layout(shape: Sequence[int], layout: Layout, new_shape: Sequence[int]) -> Layout:
    """Layout of ``x.reshape(new_shape)``: whole dims may be split and merged freely, a sharded factor
    only moved as a whole (merged with whole dims, as ``flatten`` does); else :class:`LayoutError`.

    Each factor is placed by its row-major position: a factor of local size ``s`` starting at
    position ``p`` (the product of the local sizes before it) lands in the new dim whose span
    ``[C_k, C_k * new_shape[k])`` holds ``[p, p * s)``. Whole factors of size 1 (a batch or channel
    dim of size 1) carry nothing and are dropped. A *sharded* factor of local size 1 (a rank holding
    a single row) sitting exactly on the boundary between new dims could belong to either: with
    ``h == 1`` on this rank, ``x.view(n, c, h * w)`` and ``x.view(n, c * h, w)`` make the same local
    call but shard different dims of the serial result. That is refused (:class:`LayoutError`), not
    guessed; ``flatten`` / ``unflatten`` name their dims and are never ambiguous
    (:func:`flatten_layout`, :func:`unflatten_layout`).
    """
    new_shape = [int(s) for s in new_shape]
    if any(prefix_of(e) for e in layout):  # a prefixed dim moves as a whole
        surrogate, back = _opaque(layout, shape)
        return _restore(reshape_layout(shape, surrogate, new_shape), back)
    if -1 in new_shape:
        known = 1
        for s in new_shape:
            known *= s if s != -1 else 1
        new_shape[new_shape.index(-1)] = _prod(shape) // known if known else 0
    raw = _factors(shape, layout)
    if any(s == 0 for s, _ in raw):
        raise LayoutError(
            f"a reshape of an empty shard {tuple(shape)} -> {tuple(new_shape)} cannot be matched to the "
            "sharded dims (give every rank at least one row)"
        )
    todo = _canonical(raw)
    if _prod(new_shape) != _prod(s for s, _ in todo):
        raise LayoutError(f"reshape {tuple(shape)} -> {tuple(new_shape)} does not match the factors")
    bounds = [1]
    for t in new_shape:
        bounds.append(bounds[-1] * t)
    n = len(new_shape)
    out: List[List[Factor]] = [[] for _ in range(n)]
    pos = 1
    for size, axis in todo:
        end = pos * size
        if axis is None:  # a run of whole dims: cut it at the new dims' boundaries
            for k in range(n):
                lo, hi = max(pos, bounds[k]), min(end, bounds[k + 1])
                if hi <= lo:
                    continue
                if hi % lo:
                    raise LayoutError(
                        f"reshape {tuple(shape)} -> {tuple(new_shape)} groups a sharded dim's rows "
                        "with a fraction of a whole dim, which does not follow the serial layout"
                    )
                out[k].append((hi // lo, None))
        else:
            cands = [
                k
                for k in range(n)
                if bounds[k] <= pos and end <= bounds[k + 1] and pos % bounds[k] == 0 and bounds[k + 1] % end == 0
            ]
            if not cands:
                raise LayoutError(
                    f"reshape {tuple(shape)} -> {tuple(new_shape)} splits a sharded dim (local size {size}) across "
                    "several dims, which would interleave rows that live on different ranks"
                )
            if len(cands) > 1:  # only a 1-row shard on a boundary (a factor of size > 1 spans a unique dim)
                raise LayoutError(
                    f"reshape {tuple(shape)} -> {tuple(new_shape)} is ambiguous: this rank holds a single row of a "
                    f"sharded dim (local size 1), and that row could belong to new dim {cands[0]} or "
                    f"{' or '.join(str(k) for k in cands[1:])}, which shard different dims of the serial result "
                    "(with h == 1, x.view(n, c, h * w) and x.view(n, c * h, w) make the same local call). Give every "
                    "rank at least 2 rows along the sharded dims (fewer ranks or a larger input), or use "
                    "flatten / unflatten, which name the dims they merge"
                )
            out[cands[0]].append((size, axis))
        pos = end
    return tuple(_entry(e) for e in out)


def flatten_layout(shape: Sequence[int], layout: Layout, start: int, end: int) -> Layout:
    """Layout of ``x.flatten(start, end)``: the entries of dims ``start..end`` merged (never ambiguous:
    the call names the dims it merges, a 1-row shard included)."""
    n = len(shape)
    if n == 0:
        return tuple(layout)
    start, end = start % n, end % n
    if start > end:
        raise LayoutError(f"flatten: start_dim {start} after end_dim {end}")
    if start < end and any(prefix_of(layout[d]) for d in range(start, end + 1)):
        raise LayoutError("flatten merges the token dim holding prefix tokens (a CLS token) with other dims")
    merged: List[Factor] = []
    for d in range(start, end + 1):
        merged.extend(layout[d] if layout[d] else ((int(shape[d]), None),))
    return tuple(layout[:start]) + (_entry(merged),) + tuple(layout[end + 1 :])


def unflatten_layout(shape: Sequence[int], layout: Layout, dim: int, sizes: Sequence[int]) -> Layout:
    """Layout of ``x.unflatten(dim, sizes)``: ``dim``'s entry reshaped to ``sizes`` (see
    :func:`reshape_layout`; the other dims are untouched)."""
    dim = dim % len(shape)
    part = reshape_layout((int(shape[dim]),), (layout[dim],), sizes)
    return tuple(layout[:dim]) + part + tuple(layout[dim + 1 :])


def contiguous_blocks(layout: Optional[Layout]) -> Optional[Layout]:
    """``layout`` with every entry made of one sharded factor followed by whole factors only, ``((s, a), (w,
    None), ...)``, written as the one sharded factor ``((s * w * ..., a),)``: the rank holds a contiguous
    block of the merged dim's rows either way (the whole factors are the same on every rank), so a twin that
    shards a plain dim takes it (flattened pixels pooled over, the window rows merged back)."""
    if layout is None:
        return None
    out = []
    for e in layout:
        if e and len(e) > 1 and e[0][1] is not None and e[0][1] != PREFIX and all(a is None for _, a in e[1:]):
            e = ((_size(e), e[0][1]),)
        out.append(e)
    return tuple(out)


def permute_layout(layout: Layout, order: Sequence[int]) -> Layout:
    return tuple(layout[d] for d in order)


def drop_dims(layout: Layout, dims: Sequence[int]) -> Layout:
    """Layout with ``dims`` removed (a reduction without keepdim, ``select``)."""
    gone = {d % len(layout) for d in dims} if layout else set()
    return tuple(e for d, e in enumerate(layout) if d not in gone)


def insert_dim(layout: Layout, dim: int) -> Layout:
    """Layout with a new whole dim at ``dim`` (``unsqueeze``)."""
    n = len(layout) + 1
    dim = dim % n
    return layout[:dim] + (None,) + layout[dim:]


def broadcast_layouts(shapes: Sequence[Sequence[int]], layouts: Sequence[Optional[Layout]]) -> Layout:
    """Layout of a broadcasting (pointwise) op. Sharded operands must agree dim by dim; a replicated
    operand (layout ``None``) may only have size 1 along a sharded dim (it is then broadcast over the
    shard); else :class:`LayoutError`."""
    ndim = max(len(s) for s in shapes)
    out: List[Optional[Tuple[Factor, ...]]] = [None] * ndim
    for d in range(ndim):
        entries = []
        for shape, layout in zip(shapes, layouts):
            k = d - (ndim - len(shape))
            if k < 0 or layout is None:
                continue
            entries.append(layout[k])
        sharded = [e for e in entries if e is not None and any(a is not None for _, a in e)]
        if not sharded:
            continue
        axes = {tuple(a for _, a in e) for e in sharded}
        if len(axes) > 1:
            raise LayoutError(f"operands are sharded differently along dim {d - ndim}")
        out[d] = max(sharded, key=lambda e: _size(e))
        for shape, layout in zip(shapes, layouts):
            k = d - (ndim - len(shape))
            if k < 0:
                continue
            entry = None if layout is None else layout[k]
            if (entry is None or not any(a is not None for _, a in entry)) and int(shape[k]) != 1:
                raise LayoutError(
                    f"a replicated operand of shape {tuple(shape)} spans the sharded dim {d - ndim} with size "
                    f"{shape[k]}: it would pair the same values with every rank's rows (make it size 1 there, or "
                    "shard it the same way)"
                )
    return tuple(out)


def _size(entry) -> int:
    n = 1
    for s, _ in entry:
        n *= s
    return n
