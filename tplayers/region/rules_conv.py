"""Region-guard route for functional convolutions with a window along sharded dims (issue 31).

``nn.ConvNd`` modules are swapped for their twins, but code that calls ``F.conv1d`` / ``conv2d`` /
``conv3d`` itself passes the guard a plain call: an ``nn.Conv2d`` subclass with its own ``forward``
(timm's ``ScaledStdConv2d`` / ``StdConv2d`` standardize the weight first, NF-ResNets), a weight
computed by a hypernetwork, a hand-written ``F.conv2d``. A 1x1 window along every sharded dim runs
locally (:mod:`tplayers.region.rules_ops`); any other window along a sharded dim is routed here to
the window core: a :class:`~tplayers.DistributedConv1d` / ``2d`` / ``3d`` of the call's arguments
(built once per call site and kept by the region, its parameters on the meta device) convolves this
rank's rows by the call's own weight and bias (:meth:`~tplayers.DistributedConv2d.convolve`, one
halo exchange), and the weight's and bias's gradients are summed over the mesh where they meet the
sharded data, as for every replicated operand. Exact for every argument the twin takes (stride,
padding including ``"same"`` / ``"valid"``, dilation, groups); the output keeps the input's partition
when its length is kept, else the balanced one, as the twin's.

Refused on every rank: a transposed functional convolution with a window along a sharded dim, a
sharded channel dim, a sharded weight, a tensor whose sharded dims merge several dims.
"""

from __future__ import annotations

from typing import Dict

import tplayers.layers as L
from tplayers.domain.layout import mesh_dims_of, region_layout, sharded_dims
from tplayers.region import rules_ops
from tplayers.region.rules import op_name
from tplayers.region.rules_ops import _bind, per_dim
from tplayers.region.rules_route import _spatial

__all__ = ["TABLE"]

_TWINS: Dict[str, type] = {"conv1d": L.DistributedConv1d, "conv2d": L.DistributedConv2d, "conv3d": L.DistributedConv3d}


def _conv(g, func, args, kwargs):
    a = _bind(
        args,
        kwargs,
        ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    )
    x, w, b = a["input"], a["weight"], a["bias"]
    lay = g.layout(x)
    n = w.dim() - 2
    k, s, p = tuple(w.shape[2:]), per_dim(a["stride"], n), per_dim(a["padding"], n)
    cls = _TWINS.get(func.__name__)
    windows = [
        d
        for d in sharded_dims(lay)
        if d >= 2 and (k[d - 2] != 1 or s[d - 2] != 1 or (not isinstance(p, str) and p[d - 2]))
    ]
    if cls is None or not windows or lay is None:  # transposed, or no window along a sharded dim: local or refused
        return rules_ops._conv(g, func, args, kwargs)
    if g.layout(w) is not None or (b is not None and g.layout(b) is not None):
        raise g.error(f"{op_name(func)} with a sharded weight or bias", lay)
    if 1 in sharded_dims(lay):
        raise g.error(f"{op_name(func)} over a sharded channel dim", lay)
    dims = _spatial(g, x, lay, op_name(func))
    groups = int(a["groups"])
    config = (int(w.shape[1]) * groups, int(w.shape[0]), k, s, p, per_dim(a["dilation"], n), groups, b is not None)
    key = ("functional conv", cls, config, w.dtype, dims)
    twin = g.routes.get(key)
    if twin is None:
        twin = cls(*config, device="meta", dtype=w.dtype, mesh=g.mesh, shard_dims=dims)
        g.routes[key] = twin
    g.acted = True
    axes = mesh_dims_of(lay)
    out = twin.convolve(x, g.bound(w, axes), None if b is None else g.bound(b, axes), reduce=False)
    return g.mark(out, region_layout(out.shape, dims))


TABLE = {"conv1d": _conv, "conv2d": _conv, "conv3d": _conv}
