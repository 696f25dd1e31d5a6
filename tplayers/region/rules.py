"""What the region guard does with each torch call on domain-sharded data (see :mod:`~tplayers.region.guard`).

:func:`handle` looks the call up by name in one table (:func:`_table`), lazily built: pointwise ops
(aten's ``pointwise`` tag plus a few), layout-keeping moves, metadata queries, views and indexing
(:mod:`tplayers.domain.layout` decides whether each sharded dim stays whole), reductions and
scans along a dim, ``cat``/``stack``, and the ops of :mod:`tplayers.region.rules_ops` (linear
algebra, convolutions, norms, dropout, and the calls routed to :mod:`tplayers.functional`).
A name not in the table is an error (deny by default).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from tplayers.domain.layout import (
    broadcast_layouts,
    drop_dims,
    flatten_layout,
    insert_dim,
    is_sharded,
    mesh_dims_of,
    permute_layout,
    reshape_layout,
    sharded_dims,
    unflatten_layout,
)
from tplayers.region.rules_index import index_layout

__all__ = ["op_name", "dims_arg", "run_pointwise", "first_sharded"]


def op_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    owner = getattr(func, "__qualname__", name).split(".")[0]
    return f"Tensor.{name}" if owner in ("TensorBase", "Tensor") else f"torch.{name}" if name.startswith("_") else name


def first_sharded(g, args, kwargs):
    """The first sharded tensor argument and its layout."""
    for a in list(args) + list(kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            lay = g.layout(t)
            if lay is not None:
                return t, lay
    return None, None


def dims_arg(dim, ndim: int) -> Tuple[int, ...]:
    """``dim`` (int, sequence or None = all) as sorted non-negative dims."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(int(d) % max(ndim, 1) for d in dim))


def _tensors(args, kwargs):
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]


def run_pointwise(g, func, args, kwargs, tensors=None):
    """Broadcasting op: check the operands' layouts, sum replicated gradients where they meet shards."""
    tensors = _tensors(args, kwargs) if tensors is None else tensors
    out_layout = broadcast_layouts([t.shape for t in tensors], [g.layout(t) for t in tensors])
    axes = mesh_dims_of(out_layout)
    swap = {id(t): g.bound(t, axes) for t in tensors if g.layout(t) is None}
    args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    target = args[0] if args else None
    in_place = isinstance(target, torch.Tensor) and g.layout(target) is None
    out = func(*args, **kwargs)
    if out is target and in_place and is_sharded(out_layout):
        raise g.error(f"{op_name(func)} writes sharded values into a replicated tensor in place", out_layout)
    return _mark_all(g, out, out_layout)


def _mark_all(g, out, layout):
    if isinstance(out, torch.Tensor):
        if out.dim() == len(layout):
            g.mark(out, layout)
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            _mark_all(g, o, layout)
    return out


def _preserve(g, func, args, kwargs):
    layout = g.layout(args[0]) if args else None
    out = func(*args, **kwargs)
    return _mark_all(g, out, layout) if layout is not None else out


def _passthrough(g, func, args, kwargs):
    return func(*args, **kwargs)


def _refuse_value(g, func, args, kwargs):
    t, lay = first_sharded(g, args, kwargs)
    raise g.error(
        f"{op_name(func)} reads the values of a sharded tensor into Python",
        lay,
        "Reduce it first (x.sum(), x.mean(), ... are global inside a region).",
    )


def _getter(g, func, args, kwargs):
    prop = getattr(func.__self__, "__name__", "")
    out = func(*args, **kwargs)
    lay = g.layout(args[0])
    if prop in ("data", "real", "imag", "grad") and isinstance(out, torch.Tensor):
        g.mark(out, lay)
    elif prop in ("T", "mT", "mH", "H") and isinstance(out, torch.Tensor):
        n = len(lay)
        order = list(range(n))[::-1] if prop in ("T", "H") else list(range(n - 2)) + [n - 1, n - 2]
        g.mark(out, permute_layout(lay, order))
    return out


# ------------------------------------------------------------------ views
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
    new = reshape_layout(x.shape, lay, shape)
    return g.mark(func(*args, **kwargs), new)


def _flatten(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
    out = func(*args, **kwargs)
    if not x.dim():
        return out
    start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
    end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
    if isinstance(start, int) and isinstance(end, int):  # the dims it merges are named: never ambiguous
        return g.mark(out, flatten_layout(x.shape, lay, start, end))
    return g.mark(out, reshape_layout(x.shape, lay, out.shape))


def _unflatten(g, func, args, kwargs):
    x, lay = args[0], g.layout(args[0])
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
        raise g.error("assignment to a slice along a sharded dim", lay)
    if isinstance(value, torch.Tensor):
        shape = x[idx].shape
        broadcast_layouts([shape, value.shape], [part, g.layout(value)])
    return func(*args, **kwargs)


def _cat(g, func, args, kwargs):
    tensors = list(args[0]) if args else list(kwargs.get("tensors"))
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    lays = [g.layout(t) for t in tensors]
    ref = next(la for la in lays if la is not None)
    stack = func.__name__ == "stack"
    d = dim % (len(ref) + (1 if stack else 0))
    if not stack and d in sharded_dims(ref):
        raise g.error(f"{op_name(func)} along sharded dim {d}", ref)
    for t, la in zip(tensors, lays):
        if la is None or [e for i, e in enumerate(la) if i != d or stack] != [
            e for i, e in enumerate(ref) if i != d or stack
        ]:
            raise g.error(f"{op_name(func)} of tensors sharded differently (or sharded with replicated ones)", ref)
    out = func(*args, **kwargs)
    return g.mark(out, insert_dim(ref, d) if stack else ref)


@functools.lru_cache(maxsize=None)
def _pointwise_names() -> frozenset:
    names = set()
    for name in dir(torch.ops.aten):
        pkt = getattr(torch.ops.aten, name)
        try:
            if any(torch.Tag.pointwise in getattr(pkt, o).tags for o in pkt.overloads()):
                names.add(name)
        except (AttributeError, RuntimeError):
            continue
    names |= {
        "hardswish",
        "hardswish_",
        "hardsigmoid",
        "relu6",
        "masked_fill_",
        "copy_",
        "fill_",
        "zero_",
        "gelu_",
        "silu_",
        "mish_",
        "hardtanh_",
        "leaky_relu_",
        "elu_",
        "celu_",
        "selu_",
        "rrelu",
        "logsigmoid",
        "softsign",
        "tanhshrink",
        "softshrink",
        "hardshrink",
        "threshold_",
        "__and__",
        "__or__",
        "__xor__",
        "__invert__",
        "__lshift__",
        "__rshift__",
        "__mod__",
        "__rmod__",
        "__floordiv__",
        "__rfloordiv__",
        "__rtruediv__",
        "__rdiv__",
        "__rpow__",
        "__rmatmul__",
        "__radd__",
        "__rmul__",
        "__rsub__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ipow__",
        "__eq__",
        "__ne__",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__neg__",
        "__abs__",
        "__pos__",
        "__pow__",
        "__truediv__",
        "__add__",
        "__sub__",
        "__mul__",
        "__div__",
        "true_divide",
        "true_divide_",
        "float_power",
        "addcdiv_",
        "addcmul_",
        "lerp_",
        "clamp_",
        "clamp_min_",
        "clamp_max_",
        "clip",
        "clip_",
        "where",
    } - {"dropout"}
    return frozenset(names)


_PRESERVE = {
    "to",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "cpu",
    "cuda",
    "contiguous",
    "clone",
    "detach",
    "detach_",
    "requires_grad_",
    "type_as",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "pin_memory",
    "alias",
    "__deepcopy__",
    "conj",
    "resolve_conj",
    "resolve_neg",
    "positive",
    "as_strided_",
}
_PASS = {
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "__len__",
    "element_size",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "stride",
    "storage_offset",
    "data_ptr",
    "get_device",
    "__format__",
    "__repr__",
    "__str__",
    "register_hook",
    "retain_grad",
    "__hash__",
    "untyped_storage",
    "_is_view",
    "is_shared",
    "is_pinned",
    "has_names",
    "__reduce_ex__",
    "backward",
    "is_nonzero",
    "__contains__",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "new_tensor",
    "is_set_to",
    "is_inference",
    "__dir__",
    "__sizeof__",
    "_version",
    "is_same_size",
    "is_signed",
    "dim_order",
    "__array__",
    "__torch_function__",
    "__get__",
}
_VALUES = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"}
_VIEWS = {
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
_ALONG = {
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
