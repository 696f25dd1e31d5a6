"""Region-guard rules for views, indexing, ``cat`` / ``stack`` and ops along one dim.

Whether each sharded dim stays whole decides (:mod:`tplayers.domain.layout`, and
:mod:`tplayers.region.rules_index` for indexing): a view that keeps every sharded dim whole runs
locally with its layout carried over; an op along a sharded dim (softmax, cumsum, sort, roll, ...)
is refused. The guard's table (:mod:`tplayers.region.dispatch`) takes :data:`VIEWS` and
:data:`ALONG` from here.
"""

from __future__ import annotations

import math

import torch

from tplayers.domain.layout import (
    broadcast_layouts,
    drop_dims,
    flatten_layout,
    insert_dim,
    permute_layout,
    prefix_of,
    reshape_layout,
    sharded_dims,
    unflatten_layout,
)
from tplayers.region.lengths import ShardLen
from tplayers.region.rules import _mark_all, _preserve, dims_arg, op_name
from tplayers.region.rules_index import index_layout
from tplayers.region.rules_slices import fit_operands, getitem, global_index
from tplayers.region.rules_windows import move_windows, serial_view, wants_serial

__all__ = ["VIEWS", "ALONG"]


def _shape_args(args, start=1):
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return tuple(rest[0])
    return tuple(rest)


def _reshape(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    name = func.__name__
    if name in ("view_as", "reshape_as"):
        shape = tuple(args[1].shape)
    elif name == "view" and len(args) == 2 and isinstance(args[1], torch.dtype):
        return _preserve(g, func, args, kwargs)
    else:
        shape = _shape_args(args) if len(args) > 1 else tuple(kwargs.get("shape", kwargs.get("size", ())))
    if name in ("view", "reshape") and (
        wants_serial(g, lay, shape) or _serial_count(g, x, lay, shape)
    ):  # rules_windows
        found = serial_view(g, x, lay, shape)
        if found is not None:
            return g.mark(move_windows(g, func, args, kwargs, x, shape, *found), found[1])
    g.arm()  # decided from local sizes (a 1-row or empty shard): agreed on a region's first call
    new = reshape_layout(x.shape, lay, shape)
    for i, s in enumerate(shape):  # a length read from a sharded dim must stay sharded: else the serial
        if isinstance(s, ShardLen) and new[i] is None and any(r.group is None or r.group.size() > 1 for r in s.roots):
            raise g.refuse(  # reshape puts other elements there (MAnet's (B, HW, C) -> (B, C, H, W))
                g.error(
                    f"{op_name(func)} {tuple(int(n) for n in x.shape)} -> {tuple(int(n) for n in shape)}: the "
                    f"length {int(s)} read from a sharded dim sizes dim {i}, which the reshape of this rank's "
                    "elements leaves whole: the serial reshape places other elements there (rows of the "
                    "serial tensor move across ranks, e.g. tokens into channels)",
                    lay,
                    "Permute the sharded rows to where the new shape puts them before reshaping "
                    "(x.transpose(1, 2).reshape(...)).",
                )
            )
    return g.mark(func(*args, **kwargs), new)


def _serial_count(g, x, lay, shape) -> bool:
    """Whether plain sizes are the serial tensor's view (MONAI UNETR's ``proj_feat`` views its tokens with the
    configured global grid, ``x.view(B, H/p, W/p, hidden)``): read as the serial view
    (:func:`~tplayers.region.rules_windows.serial_view`), each sharded factor keeping this rank's rows. Their
    product is the serial element count; it is this rank's count too only where the rank holds every row
    (the others none: they read the view serially, and so must this rank, to meet them in its collective)
    or where model code made the sizes from local numbers (``g.lost``: read locally on every rank)."""
    if any(prefix_of(e) for e in lay) or any(isinstance(s, ShardLen) for s in shape):
        return False
    sizes = [int(s) for s in shape]
    if -1 in sizes:
        return False
    return math.prod(sizes) != x.numel() or not g.lost


def _flatten(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
    end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
    named = isinstance(start, int) and isinstance(end, int)  # the dims it merges are named: never ambiguous
    if not named:
        g.arm()
    out = func(*args, **kwargs)
    if not x.dim():
        return out
    if named:
        return g.mark(out, flatten_layout(x.shape, lay, start, end))
    return g.mark(out, reshape_layout(x.shape, lay, out.shape))


def _unflatten(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    g.arm()  # a 1-row shard split into two dims is ambiguous on that rank only
    out = func(*args, **kwargs)
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, int):
        d = dim % x.dim()
        k = out.dim() - x.dim() + 1
        return g.mark(out, unflatten_layout(x.shape, lay, d, out.shape[d : d + k]))
    return g.mark(out, reshape_layout(x.shape, lay, out.shape))


def _permute(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    n = x.dim()
    name = func.__name__
    if name == "permute":
        order = _shape_args(args) if len(args) > 1 else tuple(kwargs["dims"])
        order = [d % n for d in order]
    elif name in ("transpose", "swapaxes", "swapdims", "transpose_"):
        a = kwargs.get("dim0", args[1] if len(args) > 1 else None) % n
        b = kwargs.get("dim1", args[2] if len(args) > 2 else None) % n
        order = list(range(n))
        order[a], order[b] = b, a
    elif name == "t":
        order = list(range(n))[::-1]
    else:  # movedim / moveaxis
        src = kwargs.get("source", args[1])
        dst = kwargs.get("destination", args[2])
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [s % n for s in src], [d % n for d in dst]
        rest = [d for d in range(n) if d not in src]
        order = [None] * n
        for s, d in zip(src, dst):
            order[d] = s
        it = iter(rest)
        order = [o if o is not None else next(it) for o in order]
    return g.mark(func(*args, **kwargs), permute_layout(lay, order))


def _squeeze(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    sharded = sharded_dims(lay)
    if dim is None:  # serial squeeze removes dims of global size 1: never a sharded one
        dims = tuple(d for d in range(x.dim()) if x.shape[d] == 1 and d not in sharded)
        out = x.squeeze(dims) if dims else x.view_as(x)
    else:
        dims = tuple(d for d in dims_arg(dim, x.dim()) if x.shape[d] == 1)
        if set(dims_arg(dim, x.dim())) & set(sharded):
            raise g.error(f"{op_name(func)} of a sharded dim", lay)
        out = func(*args, **kwargs)
    return g.mark(out, drop_dims(lay, dims))


def _unsqueeze(g, func, args, kwargs):
    lay = g.layout(args[0])
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return g.mark(func(*args, **kwargs), insert_dim(lay, dim))


def _expand(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    g.arm()  # a 1-row shard expands where the others cannot
    out = func(*args, **kwargs)
    new = out.dim() - x.dim()
    for d in sharded_dims(lay):
        if out.shape[new + d] != x.shape[d]:
            raise g.error(f"{op_name(func)} expands a sharded dim", lay)
    return g.mark(out, (None,) * new + tuple(lay))


def _repeat(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    reps = _shape_args(args)
    new = len(reps) - x.dim()
    if any(reps[new + d] != 1 for d in sharded_dims(lay)):
        raise g.error(f"{op_name(func)} repeats a sharded dim", lay)
    return g.mark(func(*args, **kwargs), (None,) * new + tuple(lay))


def _along(position: int, default=None, kw: str = "dim"):
    """An op along one whole dim (split, chunk, select, softmax, cumsum, ...)."""

    def handler(g, func, args, kwargs):
        x, lay = args[0], g.layout(args[0])
        dim = kwargs.get(kw, args[position] if len(args) > position else default)
        dims = dims_arg(dim, x.dim()) if dim is not None else tuple(range(x.dim()))
        hit = set(dims) & set(sharded_dims(lay))
        if hit:
            raise g.error(
                f"{op_name(func)} along sharded dim {sorted(hit)}",
                lay,
                "Keep this op on whole dims (channels), or move it outside the domain region.",
            )
        out = func(*args, **kwargs)
        if func.__name__ in ("select", "unbind"):
            return _mark_all(g, out, drop_dims(lay, dims))
        return _mark_all(g, out, lay)

    return handler


def _getitem(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    if len(args) > 1 and g.layout(args[1]) is not None:
        raise g.error("indexing with a sharded index tensor", lay)
    new = index_layout(x, lay, args[1])
    if new is None:
        found = global_index(g, x, args[1])
        if found is not None:
            return getitem(g, x, found)
        raise g.error(
            "indexing (a slice, step, integer or index tensor) along a sharded dim",
            lay,
            "Index whole dims only (x[:, :3] selects channels), or move it outside the region.",
        )
    return g.mark(func(*args, **kwargs), new)


def _setitem(g, func, args, kwargs):
    x, idx, value = args[0], args[1], args[2]
    lay = g.layout(x)
    if lay is None:
        raise g.error("assigning sharded values into a replicated tensor", g.layout(value))
    part = index_layout(x, lay, idx)
    if part is None:
        found = global_index(g, x, idx, gather=False)
        if found is None:
            raise g.error("assignment to a slice along a sharded dim", lay)
        idx, part, _, picks = found
        if picks and isinstance(value, torch.Tensor) and value.dim():
            raise g.error(
                "assignment of a tensor into an integer index along a sharded dim (write x[:, :, i:i+1])", lay
            )
        if isinstance(value, torch.Tensor):
            value = _fit_value(g, x, idx, part, value)
        g.arm()  # the value's rows must be this rank's rows of the slice: a shape error on some ranks only
        args = (x, idx, value) + tuple(args[3:])
    if isinstance(value, torch.Tensor):
        shape = x[idx].shape
        broadcast_layouts([shape, value.shape], [part, g.layout(value)])
    return func(*args, **kwargs)


def _fit_value(g, x, idx, part, value):
    """A value whole along a sliced sharded dim with the serial slice's length there, cut to this rank's rows."""
    view = x[idx]
    g.mark(view, part)
    return fit_operands(g, [view, value])[1]


def _cat(g, func, args, kwargs):
    g.arm()  # operands partitioned differently may have equal local sizes on some ranks only
    tensors = list(args[0]) if args else list(kwargs.get("tensors"))
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    lays = [g.layout(t) for t in tensors]
    ref = next(la for la in lays if la is not None)
    stack = func.__name__ == "stack"
    d = dim % (len(ref) + (1 if stack else 0))
    if not stack and d in sharded_dims(ref):
        raise g.error(f"{op_name(func)} along sharded dim {d}", ref)
    if not stack and any(la is None for la in lays):  # a replicated operand of the serial length: cut (a grid)
        first = tensors[lays.index(ref)]
        for i, (t, la) in enumerate(zip(tensors, lays)):
            if la is None:
                cut = fit_operands(g, [first, t], skip=(d - t.dim(),))[1]
                if cut is not t:
                    tensors[i], lays[i] = cut, ref
        args = (tensors,) + tuple(args[1:]) if args else args
        kwargs = kwargs if args else {**kwargs, "tensors": tensors}
    for t, la in zip(tensors, lays):
        if la is None or [e for i, e in enumerate(la) if i != d or stack] != [
            e for i, e in enumerate(ref) if i != d or stack
        ]:
            raise g.error(f"{op_name(func)} of tensors sharded differently (or sharded with replicated ones)", ref)
    out = func(*args, **kwargs)
    return g.mark(out, insert_dim(ref, d) if stack else ref)


VIEWS = {
    "view": _reshape,
    "reshape": _reshape,
    "view_as": _reshape,
    "reshape_as": _reshape,
    "flatten": _flatten,
    "unflatten": _unflatten,
    "permute": _permute,
    "transpose": _permute,
    "swapaxes": _permute,
    "swapdims": _permute,
    "t": _permute,
    "movedim": _permute,
    "moveaxis": _permute,
    "squeeze": _squeeze,
    "unsqueeze": _unsqueeze,
    "expand": _expand,
    "expand_as": _expand,
    "broadcast_to": _expand,
    "repeat": _repeat,
    "__getitem__": _getitem,
    "__setitem__": _setitem,
    "cat": _cat,
    "concat": _cat,
    "concatenate": _cat,
    "stack": _cat,
}
ALONG = {
    "select": _along(1),
    "narrow": _along(1),
    "chunk": _along(2, 0),
    "split": _along(2, 0),
    "tensor_split": _along(2, 0),
    "split_with_sizes": _along(2, 0),
    "unbind": _along(1, 0),
    "softmax": _along(1),
    "log_softmax": _along(1),
    "softmin": _along(1),
    "cumsum": _along(1),
    "cumprod": _along(1),
    "cummax": _along(1),
    "cummin": _along(1),
    "logcumsumexp": _along(1),
    "sort": _along(1, -1),
    "argsort": _along(1, -1),
    "topk": _along(2, -1),
    "kthvalue": _along(2, -1),
    "glu": _along(1, -1),
    "normalize": _along(2, 1),
    "gumbel_softmax": _along(4, -1),
    "index_select": _along(1),
    "diff": _along(2, -1),
    "roll": _along(2, None, "dims"),
    "flip": _along(1, None, "dims"),
    "rot90": _along(2, (0, 1), "dims"),
    "fliplr": _along(9, (1,)),
    "flipud": _along(9, (0,)),
}
