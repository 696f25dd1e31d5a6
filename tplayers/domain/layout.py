"""Which dims of a tensor inside a domain region are domain-sharded: the layout the region guard follows.

A *layout* has one entry per tensor dim: ``None`` for a dim that is whole on every rank, or a
tuple of *factors* ``((local_size, mesh_dim), ...)`` in row-major order for a dim that holds a
sharded dim of the region, possibly merged with whole ones by a reshape (``mesh_dim`` is the
mesh dim a factor is sharded over, or ``None``). ``x.flatten(2)`` of an ``(N, C, H, W)`` tensor
sharded along H gives ``(None, None, ((H_local, 0), (W, None)))``: the token dim of an attention over
pixels, whose local tokens are a contiguous block of the global row-major order; along W they are
strided. Everything here is arithmetic on Python ints: no communication, no torch calls.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Factor = Tuple[int, Optional[int]]  # (local size, mesh dim or None)
Layout = Tuple[Optional[Tuple[Factor, ...]], ...]

__all__ = ["Factor", "Layout", "LayoutError", "region_layout", "sharded_dims", "mesh_dims_of", "is_sharded",
           "reshape_layout", "permute_layout", "broadcast_layouts", "drop_dims", "insert_dim"]


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
    return tuple(sorted({a for d in dims if layout[d] for _, a in layout[d] if a is not None}))


def is_sharded(layout: Optional[Layout]) -> bool:
    return layout is not None and bool(sharded_dims(layout))


def _factors(shape: Sequence[int], layout: Layout) -> List[Factor]:
    out: List[Factor] = []
    for size, entry in zip(shape, layout):
        out.extend(entry if entry else ((int(size), None),))
    return out


def _entry(factors: List[Factor]) -> Optional[Tuple[Factor, ...]]:
    return tuple(factors) if any(a is not None for _, a in factors) else None


def reshape_layout(shape: Sequence[int], layout: Layout, new_shape: Sequence[int]) -> Layout:
    """Layout of ``x.reshape(new_shape)``: whole dims may be split and merged freely, a sharded factor
    only moved as a whole (merged with whole dims, as ``flatten`` does); else :class:`LayoutError`."""
    new_shape = [int(s) for s in new_shape]
    if -1 in new_shape:
        known = 1
        for s in new_shape:
            known *= s if s != -1 else 1
        total = 1
        for s in shape:
            total *= int(s)
        new_shape[new_shape.index(-1)] = total // known if known else 0
    todo = _factors(shape, layout)
    if any(s == 0 for s, _ in todo):
        raise LayoutError(f"a reshape of an empty shard {tuple(shape)} -> {tuple(new_shape)} cannot be matched to the "
                          "sharded dims (give every rank at least one row)")
    out: List[Optional[Tuple[Factor, ...]]] = []
    i = 0
    for t in new_shape:
        cur: List[Factor] = []
        prod = 1
        while prod != t:
            if i == len(todo):
                raise LayoutError(f"reshape {tuple(shape)} -> {tuple(new_shape)} does not match the factors")
            size, axis = todo[i]
            if size == 1:
                cur.append(todo[i])
                i += 1
            elif t % (prod * size) == 0:
                cur.append(todo[i])
                prod *= size
                i += 1
            elif axis is None and size % (t // prod) == 0 and t % prod == 0:
                part = t // prod
                cur.append((part, None))
                todo[i] = (size // part, None)
                prod = t
            else:
                raise LayoutError(
                    f"reshape {tuple(shape)} -> {tuple(new_shape)} splits a sharded dim (local size {size}) across "
                    "several dims, which would interleave rows that live on different ranks")
        while i < len(todo) and todo[i][0] == 1 and todo[i][1] is not None:  # keep a 1-row shard's factor
            cur.append(todo[i])
            i += 1
        out.append(_entry(cur))
    rest = todo[i:]
    if any(a is not None for _, a in rest) or any(s != 1 for s, _ in rest):
        raise LayoutError(f"reshape {tuple(shape)} -> {tuple(new_shape)} drops a sharded dim")
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
                    "shard it the same way)")
    return tuple(out)


def _size(entry) -> int:
    n = 1
    for s, _ in entry:
        n *= s
    return n
