"""The region guard's generic rules for torch calls on domain-sharded data, and the helpers every
rule module shares (see :mod:`~tplayers.region.guard`).

Here: pointwise ops (aten's ``pointwise`` tag plus a few), layout-keeping moves, metadata queries
and values. Views, indexing, ``cat`` / ``stack`` and ops along a dim are in
:mod:`tplayers.region.rules_views`; linear algebra, convolutions, norms, dropout and reductions in
:mod:`tplayers.region.rules_ops`; the calls routed to :mod:`tplayers.functional` in
:mod:`tplayers.region.rules_route`. :mod:`tplayers.region.dispatch` joins them into one table; a
name in none of them is an error (deny by default).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from tplayers.domain.layout import (
    broadcast_layouts,
    is_sharded,
    mesh_dims_of,
    permute_layout,
)
from tplayers.region.realign import realign
from tplayers.region.rules_slices import fit_operands, spans

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
    moved = realign(g, tensors)  # operands sharded along different dims: one layout first
    if any(a is not b for a, b in zip(moved, tensors)):
        swap = dict(zip(map(id, tensors), moved))
        args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        tensors = moved
    written = args[0] if args and getattr(func, "__name__", "").endswith("_") else None
    if spans(g, tensors):  # a replicated operand of a sharded dim's serial length (a grid): cut to the rank's rows
        # never the in-place target: its other references would keep the rows the other ranks wrote
        cut = dict(zip(map(id, tensors), fit_operands(g, tensors, keep=(written,))))
        args = tuple(cut.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: cut.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        tensors = [cut[id(t)] for t in tensors]
    # a fresh constant (torch.zeros(y.shape)) pairs one value with every row: broadcast like size 1;
    # its length is a local size (torch's own shape check may fail on some ranks only): agreed
    fresh = [g.uniform(t) for t in tensors]
    if any(fresh) or sum(g.layout(t) is not None for t in tensors) > 1:
        g.arm()  # sharded operands partitioned differently may have equal local sizes on some ranks only
    shapes = [(1,) * t.dim() if u else t.shape for t, u in zip(tensors, fresh)]
    out_layout = broadcast_layouts(shapes, [g.layout(t) for t in tensors])
    axes = mesh_dims_of(out_layout)
    swap = {id(t): g.bound(t, axes) for t in tensors if g.layout(t) is None}
    # A tensor sharded over some mesh dims only (a reduction's result over a 2-D mesh) is replicated
    # along the others: where it meets data sharded along those, its gradient is summed over them too.
    if len(axes) > 1:  # only a 2-D mesh has tensors sharded over part of it
        for t in tensors:
            lay = g.layout(t)
            missing = tuple(a for a in axes if lay is not None and a not in mesh_dims_of(lay))
            if missing and t is not written:
                swap[id(t)] = g.bound(t, missing)
    args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    target = args[0] if args else None
    in_place = isinstance(target, torch.Tensor) and g.layout(target) is None and not g.uniform(target)
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
