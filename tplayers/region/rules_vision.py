"""Region-guard rules for vision ops: dropout (element-wise and per channel), pixel shuffle, mirrored pads.

* ``F.dropout`` (``nn.Dropout``, ``torch.dropout``) on sharded data in training draws the serial mask:
  torch's CPU dropout is ``x * empty_like(x).bernoulli_(1 - p).div_(1 - p)``, so every rank (the
  generator in the same state everywhere, as for the channel masks below) draws the noise of the
  serial tensor's shape and strides and multiplies its slice of it: exact, gradients included, and
  the generator advances as the serial model's. The cost is one serial-size noise tensor while the
  call runs; :class:`tplayers.ParallelDropout` draws only the local mask (the same distribution, a
  different model). ``p == 1`` draws nothing (torch multiplies by zero). Flattened pixels (a merged dim
  whose sharded factor leads) are one contiguous block per rank and take the same route; prefix tokens
  and dims merging factors of several mesh dims are refused.
* ``F.dropout1d`` / ``dropout2d`` / ``dropout3d`` / ``feature_alpha_dropout`` (``nn.Dropout2d``, ...)
  draw one mask entry per ``(N, C)``: torch draws it as a ``(N, C, 1, ...)`` tensor whose shape does
  not depend on the spatial sizes, so with the generator in the same state on every rank (the same
  ``torch.manual_seed`` everywhere, as :class:`tplayers.ParallelDropout` needs; tplayers advances the
  generator as the serial model does) every rank draws the serial mask and its slice is exact. The
  batch and channel dims must be whole. A rank whose slice is empty would skip the draw and fall out
  of step: refused on every rank (agreed, :meth:`~tplayers.region.guard.RegionGuard.arm`).
* ``F.pixel_shuffle`` with factor ``r`` maps each local row to ``r`` rows: rank ``k``'s rows
  ``[s, s + h)`` become the serial output's rows ``[r s, r (s + h))``; the result is tagged with the
  local lengths times ``r``. ``F.pixel_unshuffle`` is exact when every rank's length along each
  sharded dim is a multiple of ``r`` (then every start is too); else refused on every rank.
* ``F.pad`` in ``reflect`` / ``replicate`` mode (``nn.ReflectionPad2d``, ``nn.ReplicationPad2d``, ...)
  along a sharded dim: both modes are separable by dim and read only rows at the global edge, so the
  first rank along the dim pads its slice's near edge, the last rank its far edge, and the others
  nothing: exact (gradients included: the mirrored rows' gradients flow back into the edge rank's
  rows) when the edge rank holds more rows than the pad (``reflect``) or at least one
  (``replicate``); else refused on every rank. ``circular`` (``nn.CircularPad2d``): the first rank's
  low rows are the last rank's last rows and back, one periodic halo exchange between the two
  (:class:`~tplayers.comm.halo_grad.HaloExchange1d`, its adjoint in backward; dims one after the
  other, so corners travel with the later dim), exact when the edge ranks hold the rows they send.
  Constant padding is routed as before (:mod:`tplayers.region.rules_route`).
* ``y.new_zeros(y.shape)`` / ``new_ones`` / ``new_full`` (and ``torch.zeros`` / ``ones`` / ``full``,
  marked by the guard itself) are fresh constants: one value everywhere, so one of a sharded
  tensor's local shape is the slice of the serial constant, and it broadcasts against sharded data
  as a size-1 operand does (``torch.zeros(y.shape) + y``, ``c = y.new_zeros(y.shape); c += y``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tplayers.comm.collectives import exchange_grid_table
from tplayers.comm.halo_grad import HaloExchange1d
from tplayers.domain.active import stepped_aside
from tplayers.domain.layout import prefix_of, sharded_dims
from tplayers.region import rules_route
from tplayers.region.lengths import Root, serial
from tplayers.region.rules import op_name
from tplayers.region.rules_ops import _bind

__all__ = ["TABLE", "LOCAL"]

#: ops whose input has no batch dim at this rank (``dropout1d`` of ``(C, L)``, ``dropout3d`` of ``(C, D, H, W)``)
_UNBATCHED = {"dropout1d": 2, "dropout3d": 4}


def _channel_dropout(g, func, args, kwargs):
    name = func.__name__
    training = name != "feature_alpha_dropout"  # F.feature_alpha_dropout's default is training=False
    a = _bind(args, kwargs, ("input", "p", "training", "inplace"), {"p": 0.5, "training": training})
    x, lay = a["input"], g.layout(a["input"])
    out_lay = lay
    if float(a["p"]) == 0.0 or not a["training"]:
        return g.mark(func(*args, **kwargs), out_lay)
    whole = 1 if _UNBATCHED.get(name) == x.dim() else 2  # the dims the mask has one entry along
    hit = [d for d in sharded_dims(lay) if d < whole]
    if hit:
        raise g.error(
            f"{op_name(func)} with p={a['p']} in training, sharded along dim {hit[0]} (its mask has one entry "
            "per batch and channel)",
            lay,
            "Shard spatial dims only, or use tplayers.ParallelDropout.",
        )
    g.arm()  # an empty slice skips the draw on this rank only: agreed on a region's first call
    if x.numel() == 0 and float(a["p"]) != 1.0:
        raise g.refuse(
            g.error(
                f"{op_name(func)} with p={a['p']} in training on an empty slice (shape {tuple(x.shape)}): "
                "this rank would not draw the mask and its random generator would fall out of step",
                lay,
                "Give every rank at least one row.",
            )
        )
    return g.mark(func(*args, **kwargs), out_lay)


def _noise_like(x: torch.Tensor, shape) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` laid out as ``empty_like(x)`` lays out one of ``x``'s shape:
    ``x``'s stride order when ``x`` is dense, else its suggested memory format."""
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    dense = all(x.stride(order[i]) == x.stride(order[i + 1]) * x.shape[order[i + 1]] for i in range(x.dim() - 1))
    if x.dim() and dense and x.stride(order[-1]) == 1:
        base = torch.empty([shape[d] for d in order], dtype=x.dtype, device=x.device)
        return base.permute([order.index(d) for d in range(x.dim())])
    fmt = torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        fmt = torch.channels_last
    elif x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        fmt = torch.channels_last_3d
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)


def _dropout(g, func, args, kwargs):
    a = _bind(args, kwargs, ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False})
    if func is torch.dropout or func is torch.dropout_:  # torch.dropout(input, p, train)
        a["training"] = args[2] if len(args) > 2 else kwargs.get("train", True)
        a["inplace"] = func is torch.dropout_
    x, lay, p = a["input"], g.layout(a["input"]), float(a["p"])
    if p == 0.0 or not a["training"] or lay is None or p == 1.0:  # p == 1: torch multiplies by zero, no draw
        return g.mark(func(*args, **kwargs), lay)
    cuts = {}  # sharded dim -> per factor (serial length, this rank's offset, local length)
    for d in sharded_dims(lay):
        if prefix_of(lay[d]):
            raise g.error(
                f"{op_name(func)} with p={p} in training along dim {d}, which holds prefix tokens (a CLS token "
                "before sharded pixels)",
                lay,
                "Use tplayers.ParallelDropout.",
            )
        roots = (
            [g.root(x, d)]
            if len(lay[d]) == 1
            else [None if a is None else Root(int(s), g.groups[a], a) for s, a in lay[d]]
        )
        cuts[d] = [
            (int(s), 0, int(s)) if r is None else (r.total(), r.offset(), r.local) for (s, _), r in zip(lay[d], roots)
        ]
    shape = [math.prod(n for n, _, _ in cuts[d]) if d in cuts else x.shape[d] for d in range(x.dim())]
    with torch.no_grad():
        noise = _noise_like(x, shape).bernoulli_(1 - p).div_(1 - p)
    for d in sorted(cuts, reverse=True):  # flattened factors (pixels of a 2x2 mesh): each factor's block
        noise = noise.unflatten(d, [n for n, _, _ in cuts[d]]) if len(cuts[d]) > 1 else noise
        for i, (_, offset, local) in enumerate(cuts[d]):
            noise = noise.narrow(d + i, offset, local)
        noise = noise.flatten(d, d + len(cuts[d]) - 1) if len(cuts[d]) > 1 else noise
    return g.mark(x.mul_(noise) if a["inplace"] else x * noise, lay)


def _factor(g, func, args, kwargs, key):
    a = _bind(args, kwargs, ("input", key), {})
    x, lay, r = a["input"], g.layout(a["input"]), int(a[key])
    n = x.dim()
    for d in sharded_dims(lay):
        if d == n - 3:
            raise g.error(f"{op_name(func)} with the channel dim sharded", lay)
        if d >= n - 2 and len(lay[d]) != 1:
            raise g.error(f"{op_name(func)} on a dim that merges a sharded dim with others", lay)
    return x, lay, r, n


def _pixel_shuffle(g, func, args, kwargs):
    x, lay, r, n = _factor(g, func, args, kwargs, "upscale_factor")
    out = func(*args, **kwargs)
    layout = tuple(((e[0][0] * r, e[0][1]),) if d >= n - 2 and e is not None else e for d, e in enumerate(lay))
    return g.mark(out, layout)


def _pixel_unshuffle(g, func, args, kwargs):
    x, lay, r, n = _factor(g, func, args, kwargs, "downscale_factor")
    g.arm()  # decided from local lengths: agreed on a region's first call
    for d in sharded_dims(lay):
        if d >= n - 2 and r > 0 and x.shape[d] % r:
            raise g.refuse(
                g.error(
                    f"{op_name(func)} with factor {r} along sharded dim {d}, where this rank holds "
                    f"{x.shape[d]} rows (not a multiple of {r}): its output rows would take input rows "
                    "of two ranks",
                    lay,
                    f"Partition dim {d} in multiples of {r} (tplayers.shard_sizes with a multiple of {r} rows per rank).",
                )
            )
    out = func(*args, **kwargs)
    layout = tuple(((e[0][0] // r, e[0][1]),) if d >= n - 2 and e is not None else e for d, e in enumerate(lay))
    return g.mark(out, layout)


def _agree_amounts(g, x, pads) -> None:
    """On a partition's first call, every rank's constant-pad amounts along the sharded dims must be the
    same: amounts that differ were computed from local lengths (timm's ``pad_same`` of ``x.size()``) and
    would pad the global edges by a rank's own amount. One small all-gather per mesh dim, first calls
    only (later calls with the partition make the same decisions); ``ValueError`` on every rank."""
    lay = g.layout(x)
    if not g.check or lay is None:
        return
    row = [-1] * (2 * len(g.groups))
    n = x.dim()
    for d in sharded_dims(lay):
        k = n - 1 - d
        if len(lay[d]) == 1 and 2 * k + 1 < len(pads):
            axis = lay[d][0][1]
            row[2 * axis : 2 * axis + 2] = pads[2 * k], pads[2 * k + 1]
    with stepped_aside(g, settle=False):
        table = exchange_grid_table(row, g.groups, "region.pad")
    cells = [r for line in table for r in line]
    for axis in range(len(g.groups)):
        seen = sorted({tuple(r[2 * axis : 2 * axis + 2]) for r in cells})
        if len(seen) > 1:
            raise g.error(
                f"F.pad (constant) along the dim sharded over mesh dim {axis} by amounts that differ between "
                f"ranks {seen}: they were computed from local lengths (x.size() is this rank's slice), so no "
                "rank pads the serial model's amount",
                lay,
                "Compute the padding from the global length, or use a convolution twin's padding (an "
                "nn.ConvNd subclass padding to TensorFlow 'SAME' is swapped for DistributedConv2dSame).",
            )


def _pad(g, func, args, kwargs):
    a = _bind(args, kwargs, ("input", "pad", "mode", "value"), {"mode": "constant", "value": None})
    if a["mode"] not in ("reflect", "replicate", "circular"):
        _agree_amounts(g, a["input"], [int(serial(p)) for p in a["pad"]])  # derived from lengths: serial
        return rules_route._pad(g, func, args, kwargs)
    g.acted = True  # not the plain call's result (which pads every rank's edges): compiling refuses it
    x, lay, mode = a["input"], g.layout(a["input"]), a["mode"]
    n, pads = x.dim(), [int(serial(p)) for p in a["pad"]]
    local = list(pads)
    short, wraps = [], []
    g.arm()  # whether the edge rank holds enough rows is read from local sizes
    for d in sharded_dims(lay):
        k = n - 1 - d  # F.pad lists the last dim first
        if 2 * k + 1 >= len(pads) or not (pads[2 * k] or pads[2 * k + 1]):
            continue
        if len(lay[d]) != 1 or min(pads[2 * k], pads[2 * k + 1]) < 0:
            raise g.refuse(
                g.error(
                    f"F.pad (mode {mode!r}, pad {tuple(pads)}) along sharded dim {d}, "
                    + ("negative" if len(lay[d]) == 1 else "a dim merging a sharded dim with others"),
                    lay,
                )
            )
        axis = lay[d][0][1]
        coord, size = g.mesh.get_local_rank(axis), g.mesh.size(axis)
        lo, hi = pads[2 * k] if coord == 0 else 0, pads[2 * k + 1] if coord == size - 1 else 0
        if mode == "circular":  # the first rank's low rows come from the last rank, and back
            local[2 * k] = local[2 * k + 1] = 0
            send = (pads[2 * k + 1] if coord == 0 else 0, pads[2 * k] if coord == size - 1 else 0)
            wraps.append((d, axis, (lo, hi), send))
            need = max(send)
        else:
            local[2 * k], local[2 * k + 1] = lo, hi
            need = max(lo, hi) + (1 if mode == "reflect" and max(lo, hi) else 0)
        if x.shape[d] < need:
            short.append((d, int(x.shape[d]), need))
    if short:
        d, have, need = short[0]
        raise g.refuse(
            g.error(
                f"F.pad (mode {mode!r}, pad {tuple(pads)}) along sharded dim {d}: this rank is at the domain's "
                f"edge and holds {have} rows, and the {mode} padding reads {need}",
                lay,
                f"Give the first and last ranks along dim {d} at least {need} rows.",
            )
        )
    if not any(local):
        out = x.clone()  # a new tensor, as the serial F.pad returns (an in-place op on it leaves x alone)
    else:  # an empty slice pads to an empty slice whatever the mode (torch's reflect refuses empty dims)
        out = F.pad(x, local, mode=mode if x.numel() else "constant")
    if wraps:
        g.settle()  # before the exchange: a rank that refused above meets the others here
        for d, axis, recv, send in wraps:
            out = HaloExchange1d.apply(out, d, g.groups[axis], recv, send, True)
    layout = tuple(((out.shape[d], e[0][1]),) if e is not None and len(e) == 1 else e for d, e in enumerate(lay))
    return g.mark(out, layout)


def _constant(g, func, args, kwargs):
    """``y.new_zeros(y.shape)``, ``new_ones``, ``new_full`` of a sharded ``y``: a fresh constant (see
    :meth:`~tplayers.region.guard.RegionGuard.uniform`), replicated."""
    return g.mark_uniform(func(*args, **kwargs))


TABLE = {
    "dropout": _dropout,
    "new_zeros": _constant,
    "new_ones": _constant,
    "new_full": _constant,
    "pad": _pad,
    "dropout1d": _channel_dropout,
    "dropout2d": _channel_dropout,
    "dropout3d": _channel_dropout,
    "feature_alpha_dropout": _channel_dropout,
    "pixel_shuffle": _pixel_shuffle,
    "pixel_unshuffle": _pixel_unshuffle,
}

#: rules that never communicate (see tplayers.region.dispatch)
LOCAL = (_channel_dropout, _pixel_shuffle, _pixel_unshuffle, _constant)
