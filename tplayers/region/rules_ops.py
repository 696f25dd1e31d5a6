"""Region-guard rules for reductions, linear algebra, convolutions, norms, dropout and routed calls.

The routed calls (reductions over sharded dims, ``F.interpolate``, functional pools and pads,
``F.group_norm`` / ``F.batch_norm`` / ``F.instance_norm``, attention over sharded tokens) run the
implementations of :mod:`tplayers.functional` on the guard's mesh; see :mod:`tplayers.region.rules`.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from tplayers.domain import reductions as R
from tplayers.domain.layout import drop_dims, mesh_dims_of, sharded_dims
from tplayers.layers._norm_core import DomainNormFn, update_running
from tplayers.region.rules import _mark_all, dims_arg, op_name, run_pointwise

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


def _softmax(g, func, args, kwargs):
    """``softmax`` / ``log_softmax`` along a sharded dim (smp MAnet's softmax over every pixel pair): the
    global maximum (no gradient: the result does not depend on it) and the global sum of exponentials,
    each one all-reduce; along a whole dim, local."""
    functional = func is torch.nn.functional.softmax or func is torch.nn.functional.log_softmax
    names = ("input", "dim", "_stacklevel", "dtype") if functional else ("input", "dim", "dtype")
    a = _bind(args, kwargs, names, {"dim": None, "dtype": None})
    x, lay = a["input"], g.layout(a["input"])
    if a["dim"] is None or int(a["dim"]) % x.dim() not in sharded_dims(lay):
        return g.mark(func(*args, **kwargs), lay)
    d = int(a["dim"]) % x.dim()
    axes = mesh_dims_of(lay, (d,))
    groups = _groups(g, axes)
    g.acted = True
    y = x if a["dtype"] is None else x.to(a["dtype"])
    with torch.no_grad():
        top = R.extreme_over(y, (d,), True, groups, True)
    shifted = y - top.masked_fill(~torch.isfinite(top), 0.0)
    total = g.bound(R.sum_over(shifted.exp(), (d,), True, groups), axes)  # meets every rank's rows: summed
    out = shifted - total.log() if func.__name__ == "log_softmax" else shifted.exp() / total
    return g.mark(out, lay)


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
LOCAL = (_conv, _layer_norm, _dropout, _where, _prelu)

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
        "softmax": _softmax,
        "log_softmax": _softmax,
        "prelu": _prelu,
    }
)
