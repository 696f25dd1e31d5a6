"""Region-guard routes: ``F.interpolate``, functional pools and pads, and attention over sharded tokens.

``F.interpolate``'s ``size`` and adaptive pools' ``output_size`` mean what they mean in the serial
model and in the modules (``nn.Upsample(size=)``, ``nn.AdaptiveAvgPool2d(7)``): the global size;
a size derived from a sharded tensor's local shape (``size=skip.shape[2:]``) is recognised as the
ranks' shares, and a size that could be either is refused on every rank
(:mod:`tplayers.region.sizes`). Kernel sizes and strides are global, as written.
"""

from __future__ import annotations

import torch

import tplayers.functional as TF
from tplayers.domain.layout import mesh_dims_of, prefix_of, region_layout, sharded_dims
from tplayers.region.lengths import serial
from tplayers.region.rules import op_name
from tplayers.region.rules_ops import _bind, _reduction, _simple
from tplayers.region.rules_window_attn import window_sdpa
from tplayers.region.sizes import global_sizes

__all__ = ["TABLE"]


def _spatial(g, x, lay, what):
    dims = _simple(g, lay, what)
    if min(dims) < 2:
        raise g.error(f"{what} with a sharded batch or channel dim", lay)
    return dims


def _interpolate(g, func, args, kwargs):
    g.acted = True
    a = _bind(
        args,
        kwargs,
        ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias"),
        {
            "size": None,
            "scale_factor": None,
            "mode": "nearest",
            "align_corners": None,
            "recompute_scale_factor": None,
            "antialias": False,
        },
    )
    x = a.pop("input")
    lay = g.layout(x)
    dims = _spatial(g, x, lay, "F.interpolate")
    if a["size"] is not None:
        a["size"] = global_sizes(g, x, dims, a["size"], "F.interpolate")
    out = TF.interpolate(x, **a, mesh=g.mesh, shard_dims=dims, cache=g.routes)
    return g.mark(out, region_layout(out.shape, dims))


def _pool(g, func, args, kwargs):
    g.acted = True
    name = func.__name__.replace("_with_indices", "").lstrip("_")
    x, lay = args[0], g.layout(args[0])
    if name.startswith("adaptive_avg_pool") and _to_one(args, kwargs, int(name[-2])):  # a mean: any layout
        nd = int(name[-2])  # (flattened tokens pooled by HF's Swin: a dim merging two sharded dims)
        return _reduction(g, torch.mean, (x, tuple(range(x.dim() - nd, x.dim())), True), {})
    dims = _spatial(g, x, lay, op_name(func))
    fn = getattr(TF, name, None)
    if fn is None:
        raise g.error(f"{op_name(func)} over sharded dims", lay)
    if not name.startswith("adaptive"):
        out = fn(*args, **kwargs, mesh=g.mesh, shard_dims=dims, cache=g.routes)
        return g.mark(out, region_layout(out.shape, dims))
    a = _bind(args[1:], kwargs, ("output_size", "return_indices"), {})
    size = global_sizes(g, x, dims, a.pop("output_size"), f"F.{name}")
    out = fn(x, size, **a, mesh=g.mesh, shard_dims=dims, cache=g.routes)
    kept = tuple(d for d in dims if size[d - 2] != 1)  # size 1 along a sharded dim: a global reduction
    return g.mark(out, tuple(((out.shape[d], dims.index(d)),) if d in kept else None for d in range(out.dim())))


def _to_one(args, kwargs, nd: int) -> bool:
    """Whether an adaptive pool's ``output_size`` is 1 along every pooled dim."""
    size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
    size = (size,) * nd if isinstance(size, int) else tuple(size or ())
    return len(size) == nd and all(s == 1 for s in size)


def _pad(g, func, args, kwargs):
    g.acted = True
    a = _bind(args, kwargs, ("input", "pad", "mode", "value"), {"mode": "constant", "value": None})
    x, lay = a["input"], g.layout(a["input"])
    n = x.dim()
    pads = [int(serial(p)) for p in a["pad"]]  # amounts derived from lengths read: their serial values
    for d in sharded_dims(lay):
        k = n - 1 - d
        if 2 * k + 1 < len(pads) and (pads[2 * k] or pads[2 * k + 1]):
            if len(lay[d]) != 1 or pads[2 * k] < 0 or pads[2 * k + 1] < 0 or a["mode"] != "constant":
                raise g.error(
                    f"F.pad (mode {a['mode']!r}, pad {tuple(pads)}) along sharded dim {d}",
                    lay,
                    "Constant padding of a plain sharded dim is routed; for reflect / replicate / circular "
                    "use a convolution twin's padding_mode.",
                )
    shard_dims = [-1] * len(g.groups)  # mesh dim i -> its padded tensor dim (-1: none is padded)
    for d in sharded_dims(lay):
        if len(lay[d]) == 1:
            shard_dims[lay[d][0][1]] = d
    out = TF.pad(x, pads, a["mode"], a["value"], mesh=g.mesh, shard_dims=shard_dims)
    layout = tuple(((out.shape[d], e[0][1]),) if e is not None and len(e) == 1 else e for d, e in enumerate(lay))
    return g.mark(out, layout)


# ------------------------------------------------------------------ attention
def _token_info(g, t, dim, what):
    """(factors, positions-maker) of the token dim ``dim`` of ``t``; ``None`` when replicated."""
    lay = g.layout(t)
    if lay is None:
        return None
    d = dim % t.dim()
    others = [e for i, e in enumerate(lay) if i != d and e is not None]
    if others:
        raise g.error(f"{what} on a tensor sharded along a non-token dim", lay)
    factors = lay[d]
    if mesh_dims_of(lay) != tuple(range(len(g.groups))):
        raise g.error(f"{what} on tokens sharded over part of the mesh only", lay)
    return factors


def _positions(g, factors):
    if prefix_of(factors):
        raise g.error(
            "attention with a mask or is_causal over tokens with a prefix (a CLS token before sharded pixels)",
            advice="Unmasked attention over such tokens is routed.",
        )
    return TF.token_positions([s for s, _ in factors], [a for _, a in factors], g.mesh)


def _sdpa(g, func, args, kwargs):
    local = window_sdpa(g, args, kwargs)  # windows folded into the batch: attention per window is local
    if local is not None:
        return local
    g.acted = True
    a = _bind(
        args,
        kwargs,
        ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
        {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False},
    )
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    qf = _token_info(g, q, -2, "F.scaled_dot_product_attention")
    kf, vf = _token_info(g, k, -2, "F.scaled_dot_product_attention"), _token_info(g, v, -2, "attention")
    lay = g.layout(q) or g.layout(k)
    if qf is None or (kf is None) != (vf is None) or (kf is not None and kf != vf):
        raise g.error(
            "F.scaled_dot_product_attention with replicated queries or differently sharded keys / values", lay
        )
    axes = mesh_dims_of(g.layout(q))
    mask = a["attn_mask"]
    q_pos = kv_pos = None
    if a["is_causal"] or mask is not None:
        q_pos, q_len = _positions(g, qf)
        kv_pos = _positions(g, kf)[0] if kf is not None else None
        if mask is not None and g.layout(mask) is None and mask.dim() >= 2 and mask.shape[-2] != 1:
            if mask.shape[-2] != q_len:
                raise g.error(f"an attn_mask with {mask.shape[-2]} query rows for {q_len} global queries", lay)
            mask = mask.index_select(-2, q_pos)
    k2, v2 = (k, v) if kf is not None else (g.bound(k, axes), g.bound(v, axes))
    mask = g.bound(mask, axes) if isinstance(mask, torch.Tensor) and mask.is_floating_point() else mask
    out = TF.scaled_dot_product_attention(
        q,
        k2,
        v2,
        mask,
        a["dropout_p"],
        a["is_causal"],
        a["scale"],
        a["enable_gqa"],
        mesh=g.mesh,
        kv_sharded=kf is not None,
        q_positions=q_pos,
        kv_positions=kv_pos,
    )
    return g.mark(out, g.layout(q)[:-1] + (None,))


_MHA = (
    "query",
    "key",
    "value",
    "embed_dim_to_check",
    "num_heads",
    "in_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
    "add_zero_attn",
    "dropout_p",
    "out_proj_weight",
    "out_proj_bias",
    "training",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "use_separate_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "static_k",
    "static_v",
    "average_attn_weights",
    "is_causal",
)


def _mha(g, func, args, kwargs):
    g.acted = True
    a = _bind(args, kwargs, _MHA, {})
    q, k = a["query"], a["key"]
    qf = _token_info(g, q, 0, "F.multi_head_attention_forward")
    kf = _token_info(g, k, 0, "F.multi_head_attention_forward")
    lay = g.layout(q)
    if qf is None:
        raise g.error("nn.MultiheadAttention with replicated queries and sharded keys", g.layout(k))
    axes = mesh_dims_of(lay)
    for key in (
        "in_proj_weight",
        "in_proj_bias",
        "bias_k",
        "bias_v",
        "out_proj_weight",
        "out_proj_bias",
        "q_proj_weight",
        "k_proj_weight",
        "v_proj_weight",
    ):
        if isinstance(a.get(key), torch.Tensor):
            a[key] = g.bound(a[key], axes)
    if kf is None:
        a["key"], a["value"] = g.bound(a["key"], axes), g.bound(a["value"], axes)
    q_pos = kv_pos = None
    if a.get("is_causal") or a.get("attn_mask") is not None or a.get("key_padding_mask") is not None:
        q_pos = _positions(g, qf)[0]
        kv_pos = _positions(g, kf)[0] if kf is not None else None
    out = TF.multi_head_attention_forward(
        **a, mesh=g.mesh, kv_sharded=kf is not None, q_positions=q_pos, kv_positions=kv_pos
    )
    attn, weights = out
    g.mark(attn, lay[:1] + (None,) * (attn.dim() - 1))
    if isinstance(weights, torch.Tensor) and weights.dim() >= 2:
        g.mark(weights, (None,) * (weights.dim() - 2) + (lay[0], None))
    return out


TABLE = {
    "interpolate": _interpolate,
    "upsample": _interpolate,
    "pad": _pad,
    "scaled_dot_product_attention": _sdpa,
    "multi_head_attention_forward": _mha,
}
for _n in (1, 2, 3):
    for _kind in ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"):
        TABLE[f"{_kind}{_n}d"] = _pool
        TABLE[f"{_kind}{_n}d_with_indices"] = _pool
        TABLE[f"_{_kind}{_n}d"] = _pool
