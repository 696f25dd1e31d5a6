"""Region-guard rules for reductions, linear algebra, convolutions, norms, dropout and routed calls.

The routed calls (reductions over sharded dims, ``F.interpolate``, functional pools and pads,
``F.group_norm`` / ``F.batch_norm`` / ``F.instance_norm``, attention over sharded tokens) run the
implementations of :mod:`tplayers.functional` on the guard's mesh; see :mod:`tplayers.region.rules`.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from tplayers.domain import reductions as R
from tplayers.domain.layout import LayoutError, broadcast_layouts, drop_dims, mesh_dims_of, sharded_dims
from tplayers.layers._norm_core import DomainNormFn, update_running
from tplayers.region.rules import _mark_all, dims_arg, first_sharded, op_name, run_pointwise
from tplayers.region.rules_slices import fit

__all__ = ["TABLE", "LOCAL"]


def _bind(args, kwargs, names: Sequence[str], defaults: Dict[str, object]) -> Dict[str, object]:
    out = dict(defaults)
    out.update(zip(names, args))
    out.update(kwargs)
    return out


def _groups(g, axes) -> list:
    return [g.groups[a] for a in axes if g.groups[a].size() > 1]


def _simple(g, lay, what: str) -> Tuple[int, ...]:
    """Tensor dims of a layout whose sharded dims are plain (one factor each), in mesh-dim order."""
    dims: List[int] = [None] * len(g.groups)
    for d in sharded_dims(lay):
        factors = lay[d]
        if len(factors) != 1:
            raise g.error(f"{what} on a dim that merges a sharded dim with others", lay)
        dims[factors[0][1]] = d
    if any(d is None for d in dims):
        raise g.error(f"{what} on a tensor sharded over part of the mesh only", lay)
    return tuple(dims)


# ------------------------------------------------------------------ reductions
_ROUTED = {"sum", "nansum", "mean", "nanmean", "amax", "amin", "max", "min", "var", "std", "norm", "vector_norm"}


def _reduction(g, func, args, kwargs):
    name = func.__name__
    x, lay = args[0], g.layout(args[0])
    if name in ("max", "min") and (len(args) > 1 and isinstance(args[1], torch.Tensor) or "other" in kwargs):
        return run_pointwise(g, func, args, kwargs)
    p = None
    correction = 1.0
    if name in ("var", "std", "var_mean", "std_mean"):
        rest = list(args[1:])
        if rest and isinstance(rest[0], bool):
            correction = 1.0 if rest.pop(0) else 0.0
        dim = kwargs.get("dim", rest[0] if rest else None)
        if len(rest) > 1:
            correction = 1.0 if rest[1] else 0.0
        keepdim = kwargs.get("keepdim", rest[2] if len(rest) > 2 else False)
        if "unbiased" in kwargs:
            correction = 1.0 if kwargs["unbiased"] else 0.0
        if kwargs.get("correction") is not None:
            correction = float(kwargs["correction"])
    elif name in ("norm", "vector_norm"):
        a = _bind(args[1:], kwargs, ("ord" if name == "vector_norm" else "p", "dim", "keepdim"), {})
        p = a.get("ord", a.get("p", 2))
        dim, keepdim = a.get("dim"), a.get("keepdim", False)
    elif name == "count_nonzero":
        dim, keepdim = kwargs.get("dim", args[1] if len(args) > 1 else None), False
    else:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    dims = dims_arg(dim, x.dim())
    hit = set(dims) & set(sharded_dims(lay))
    out_layout = lay if keepdim else drop_dims(lay, dims)
    if keepdim:
        out_layout = tuple(None if d in dims else e for d, e in enumerate(lay))
    if not hit:
        return _mark_all(g, func(*args, **kwargs), out_layout)
    indices = name in ("max", "min") and dim is not None
    if name not in _ROUTED and name not in ("var_mean", "std_mean") or indices:
        raise g.error(
            f"{op_name(func)} over sharded dim {sorted(hit)}",
            lay,
            "Supported over sharded dims: sum, mean, amax, amin, max/min (values only), var, std, "
            "norm; use them, or move this op outside the domain region.",
        )
    if p is not None and not isinstance(p, (int, float)) and p != "fro":
        raise g.error(f"{op_name(func)} with ord {p!r} over sharded dims", lay)
    groups = _groups(g, mesh_dims_of(lay, dims))
    dtype = kwargs.get("dtype")
    g.acted = True
    if name in ("sum", "nansum"):
        src = x.nan_to_num(0.0, posinf=float("inf"), neginf=float("-inf")) if name == "nansum" else x
        out = R.sum_over(src, dims, keepdim, groups, dtype)
    elif name in ("mean", "nanmean"):
        if name == "nanmean":
            raise g.error("nanmean over sharded dims", lay)
        out = R.mean_over(x, dims, keepdim, groups, dtype)
    elif name in ("amax", "max"):
        out = R.extreme_over(x, dims, keepdim, groups, True)
    elif name in ("amin", "min"):
        out = R.extreme_over(x, dims, keepdim, groups, False)
    elif name in ("var", "std", "var_mean", "std_mean"):
        out = R.var_over(x, dims, keepdim, groups, correction)
        if name.startswith("std"):
            out = out.sqrt()
        if name.endswith("_mean"):
            out = (out, R.mean_over(x, dims, keepdim, groups))
    else:
        out = R.norm_over(x, p, dims, keepdim, groups, dtype)
    return _mark_all(g, out, out_layout)


# ------------------------------------------------------------------ linear algebra
def _linear(g, func, args, kwargs):
    a = _bind(args, kwargs, ("input", "weight", "bias"), {"bias": None})
    x, lay = a["input"], g.layout(a["input"])
    if lay is None or x.dim() - 1 in sharded_dims(lay) or g.layout(a["weight"]) is not None:
        raise g.error("F.linear contracting a sharded dim", lay or g.layout(a["weight"]))
    axes = mesh_dims_of(lay)
    w = g.bound(a["weight"], axes)
    b = None if a["bias"] is None else g.bound(a["bias"], axes)
    return g.mark(func(x, w, b), lay[:-1] + (None,))


def _matmul_layout(g, func, la, lb, sa, sb):
    if len(sa) < 2 or len(sb) < 2:
        raise LayoutError("a 1-D operand")
    if (la and la[-1]) or (lb and lb[-2]):
        raise LayoutError("it contracts a sharded dim (a matmul over flattened pixels)")
    row = la[-2] if la else None
    col = lb[-1] if lb else None
    if row is not None and col is not None:
        raise LayoutError(
            "both operands' sharded rows meet (attention scores over sharded tokens; "
            "use F.scaled_dot_product_attention, which is routed)"
        )
    batch = broadcast_layouts([sa[:-2], sb[:-2]], [la[:-2] if la else None, lb[:-2] if lb else None])
    return tuple(batch) + (row, col)


def _matmul(g, func, args, kwargs):
    name = func.__name__
    if name in ("baddbmm", "addmm", "addbmm"):
        inp, a, b = args[0], args[1], args[2]
    else:
        inp, (a, b) = None, args[:2]
    la, lb = g.layout(a), g.layout(b)
    out_layout = _matmul_layout(g, func, la, lb, a.shape, b.shape)
    if inp is not None:
        shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (a.shape[-2], b.shape[-1])
        out_layout = broadcast_layouts([inp.shape, shape], [g.layout(inp), out_layout])
    axes = mesh_dims_of(out_layout)
    swap = {id(t): g.bound(t, axes) for t in (inp, a, b) if isinstance(t, torch.Tensor) and g.layout(t) is None}
    args = tuple(swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in args)
    return g.mark(func(*args, **kwargs), out_layout)


def _einsum(g, func, args, kwargs):
    eq = args[0]
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    if "..." in eq or "->" not in eq:
        raise g.error("torch.einsum without an explicit '->' output (or with '...')", first_sharded(g, ops, {})[1])
    ins, out = eq.replace(" ", "").split("->")
    letters: Dict[str, object] = {}
    owner: Dict[str, Tuple[torch.Tensor, int]] = {}  # a sharded letter -> an operand and dim holding it
    specs = ins.split(",")
    for spec, t in zip(specs, ops):
        lay = g.layout(t)
        for i, c in enumerate(spec):
            e = lay[i] if lay is not None else None
            if e is not None:
                if c in letters and letters[c] not in (None, e):
                    raise g.error("torch.einsum pairing differently sharded dims", lay)
                letters[c] = e
                owner.setdefault(c, (t, i))
            letters.setdefault(c, None)
    ops, done = list(ops), [set() for _ in ops]  # done: mesh dims a cut operand's gradient is summed over
    for k, (spec, t) in enumerate(zip(specs, ops)):  # a replicated operand with a sharded dim's full length: cut
        if g.layout(t) is not None:
            continue
        for i, c in enumerate(spec):
            if c in owner and t.shape[i] != 1:
                cut = fit(g, ops[k], i, *owner[c])
                if cut is None:
                    raise g.error(f"torch.einsum: a replicated operand spans sharded dim {c!r}", letters[c])
                ops[k] = cut
                done[k].add(g.root(*owner[c]).axis)
    for c, e in letters.items():
        if e is not None and c not in out:
            raise g.error(f"torch.einsum contracting sharded dim {c!r} ({eq})", None)
    out_layout = tuple(letters[c] for c in out)
    axes = [a for e in out_layout if e for _, a in e if a is not None]
    if len(axes) != len(set(axes)):
        raise g.error(
            f"torch.einsum '{eq}' pairs sharded rows of two operands (a score matrix over sharded "
            "tokens; use F.scaled_dot_product_attention, which is routed)",
            None,
        )
    swap = [g.bound(t, sorted(set(axes) - d)) if g.layout(t) is None else t for t, d in zip(ops, done)]
    return g.mark(func(eq, *swap), out_layout)


# ------------------------------------------------------------------ conv / norms / dropout
def per_dim(v, n: int):
    """A convolution's ``stride`` / ``padding`` / ``dilation`` argument per spatial dim (a padding string as is)."""
    return v if isinstance(v, str) else (int(v),) * n if isinstance(v, int) else tuple(int(i) for i in v)


def _conv(g, func, args, kwargs):
    a = _bind(
        args,
        kwargs,
        ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    )
    x, lay, w = a["input"], g.layout(a["input"]), a["weight"]
    n = w.dim() - 2
    k, s, p = tuple(w.shape[2:]), per_dim(a["stride"], n), per_dim(a["padding"], n)
    for d in sharded_dims(lay):
        i = d - 2
        if i < 0 or k[i] != 1 or s[i] != 1 or (not isinstance(p, str) and p[i] != 0) or "transpose" in func.__name__:
            raise g.error(
                f"{op_name(func)} with a window along sharded dim {d}",
                lay,
                "Use nn.ConvNd modules (DomainParallel swaps them) or tplayers.DistributedConvNd.",
            )
    if 1 in sharded_dims(lay):
        raise g.error(f"{op_name(func)} over a sharded channel dim", lay)
    axes = mesh_dims_of(lay)
    args = (
        x,
        g.bound(w, axes),
        None if a["bias"] is None else g.bound(a["bias"], axes),
        a["stride"],
        a["padding"],
        a["dilation"],
        a["groups"],
    )
    return g.mark(func(*args), lay)


def _layer_norm(g, func, args, kwargs):
    a = _bind(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"), {"weight": None, "bias": None})
    x, lay = a["input"], g.layout(a["input"])
    shape = a["normalized_shape"]
    k = 1 if isinstance(shape, int) else len(shape)
    if set(range(x.dim() - k, x.dim())) & set(sharded_dims(lay)):
        raise g.error(f"{op_name(func)} over a sharded dim", lay)
    axes = mesh_dims_of(lay)
    for key in ("weight", "bias"):
        if isinstance(a.get(key), torch.Tensor):
            a[key] = g.bound(a[key], axes)
    return g.mark(
        func(**a)
        if func.__name__ == "layer_norm"
        else func(*[a[n] for n in ("input", "normalized_shape", "weight", "eps")]),
        lay,
    )


def _domain_norm(g, func, args, kwargs):
    name = func.__name__
    x, lay = args[0], g.layout(args[0])
    if 0 in sharded_dims(lay) or 1 in sharded_dims(lay):
        raise g.error(f"{op_name(func)} over a sharded batch or channel dim", lay)
    groups = [g.groups[a] for a in mesh_dims_of(lay)]
    g.acted = True
    if name == "group_norm":
        a = _bind(
            args, kwargs, ("input", "num_groups", "weight", "bias", "eps"), {"weight": None, "bias": None, "eps": 1e-5}
        )
        return g.mark(
            DomainNormFn.apply(x, a["weight"], a["bias"], int(a["num_groups"]), False, float(a["eps"]), groups)[0], lay
        )
    if name == "batch_norm":
        a = _bind(
            args,
            kwargs,
            ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
            {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
        )
        stats = a["training"]
    else:  # instance_norm
        a = _bind(
            args,
            kwargs,
            ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
            {
                "running_mean": None,
                "running_var": None,
                "weight": None,
                "bias": None,
                "use_input_stats": True,
                "momentum": 0.1,
                "eps": 1e-5,
            },
        )
        stats = a["use_input_stats"]
    if not stats:  # running statistics: a per-pixel affine map
        axes = mesh_dims_of(lay)
        call = dict(a)
        for key in ("weight", "bias"):
            if isinstance(call.get(key), torch.Tensor):
                call[key] = g.bound(call[key], axes)
        return g.mark(func(**call), lay)
    per_channel = name == "batch_norm"
    rm, rv, mom = a["running_mean"], a["running_var"], a["momentum"]
    update = None
    if rm is not None and rv is not None:

        def update(mean, var, _count):  # inside the statistics' forward, as torch's kernel (DomainNormFn)
            if not per_channel:
                mean, var = mean.reshape(x.shape[0], -1).mean(0), var.reshape(x.shape[0], -1).mean(0)
            update_running(rm, rv, mean, var, 0.0 if mom is None else float(mom))

    y = DomainNormFn.apply(x, a["weight"], a["bias"], x.shape[1], per_channel, float(a["eps"]), groups, update)[0]
    return g.mark(y, lay)


def _dropout(g, func, args, kwargs):
    a = _bind(args, kwargs, ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False})
    if func is torch.dropout or func is torch.dropout_:  # torch.dropout(input, p, train)
        a["training"] = args[2] if len(args) > 2 else kwargs.get("train", True)
    if float(a["p"]) == 0.0 or not a["training"]:
        return _mark_all(g, func(*args, **kwargs), g.layout(args[0]))
    raise g.error(
        f"{op_name(func)} with p={a['p']} in training",
        g.layout(args[0]),
        "Its local mask would not be the serial mask's slice: use tplayers.ParallelDropout, or p=0.",
    )


def _where(g, func, args, kwargs):
    if len(args) + len(kwargs) == 1:
        raise g.error("torch.where(condition) (indices of the local slab)", g.layout(args[0]))
    return run_pointwise(g, func, args, kwargs)


def _prelu(g, func, args, kwargs):
    x, w = args[0], args[1]
    lay = g.layout(x)
    return g.mark(func(x, g.bound(w, mesh_dims_of(lay))), lay)


#: rules that never communicate (a guard settles before the others; see tplayers.region.dispatch)
LOCAL = (_linear, _matmul, _einsum, _conv, _layer_norm, _dropout, _where, _prelu)

TABLE = {
    n: _reduction
    for n in (
        "sum",
        "nansum",
        "mean",
        "nanmean",
        "amax",
        "amin",
        "max",
        "min",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "norm",
        "vector_norm",
        "prod",
        "logsumexp",
        "argmax",
        "argmin",
        "all",
        "any",
        "count_nonzero",
        "median",
        "nanmedian",
        "mode",
        "aminmax",
    )
}
TABLE.update(
    {
        "linear": _linear,
        "matmul": _matmul,
        "__matmul__": _matmul,
        "mm": _matmul,
        "bmm": _matmul,
        "baddbmm": _matmul,
        "addmm": _matmul,
        "einsum": _einsum,
        "conv1d": _conv,
        "conv2d": _conv,
        "conv3d": _conv,
        "conv_transpose1d": _conv,
        "conv_transpose2d": _conv,
        "conv_transpose3d": _conv,
        "layer_norm": _layer_norm,
        "rms_norm": _layer_norm,
        "group_norm": _domain_norm,
        "batch_norm": _domain_norm,
        "instance_norm": _domain_norm,
        "dropout1d": _dropout,
        "dropout2d": _dropout,
        "dropout3d": _dropout,
        "alpha_dropout": _dropout,
        "feature_alpha_dropout": _dropout,
        "where": _where,
        "prelu": _prelu,
    }
)
