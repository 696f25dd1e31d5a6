"""How the region guard runs a twin (a layer that does its own halos and statistics): the guard steps
aside, the twin's input layout is checked against its shard dims (a norm twin on another layout and a
one-pixel convolution are taken as they are), and its output is tagged (see :mod:`tplayers.region.guard`)."""

from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from tplayers.comm.buckets import using_buckets
from tplayers.domain.active import stepped_aside
from tplayers.domain.layout import Layout, contiguous_blocks, mesh_dims_of, region_layout, sharded_dims
from tplayers.layers.norm import _DomainNorm

__all__ = ["call_twin"]


def _norm_any_layout(g, module, call, x, layout, args, kwargs):
    """A norm twin on sharded data of another layout (diffusers' attention normalises ``(N, C, H*W)``):
    its statistics run over every dim after the channels, so it sees the input as ``(N, C, L, 1...)``."""
    dims = tuple(module.shard_dims)
    nd = 2 + (module.spatial or len(dims))
    if (
        set(sharded_dims(layout)) & {0, 1}
        or mesh_dims_of(layout) != tuple(range(len(g.groups)))
        or dims != tuple(range(2, 2 + len(dims)))
        or len(args) != 1
        or kwargs
    ):
        raise g.refuse(g.error(f"{type(module).__name__} on a tensor sharded as {layout}", layout))
    with stepped_aside(g):
        flat = x.reshape(x.shape[0], x.shape[1], -1, *([1] * (nd - 3)))
        out = call(flat).reshape(x.shape)
    return g.mark(out, layout)


def call_twin(g, module, call: Callable, args, kwargs):
    """Run a twin with the guard stepped aside; tag its output from its input's layout."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    layout = g.layout(x)
    if layout is not None and g.check and torch.is_grad_enabled():
        g.check_functions(args, kwargs)
    dims = getattr(module, "shard_dims", None)
    name = type(module).__name__
    with stepped_aside(g, settle=False):  # the guard's own reads are not the code's (note_read)
        shape = None if x is None else x.shape
    if dims is not None and x is not None:
        if layout is None and getattr(module, "_serial", None) is not None:
            serial = module._serial[0]  # replicated data: the serial module, same tensors
            serial.train(module.training)
            g.in_module += 1  # its sizes are global (nn.Upsample(size=)): no broadcast reading
            try:
                return serial(*args, **kwargs)
            finally:
                g.in_module -= 1
        if layout is None:
            raise g.refuse(
                g.error(
                    f"{name} (a domain twin) applied to a replicated tensor of shape {tuple(shape)}",
                    advice="Twins take this rank's slice of a sharded tensor.",
                )
            )
        # norms run on any layout and keep it (a flattened map normalised, then viewed back with view_as)
        if layout != region_layout(shape, tuple(dims)) and _statistics_twin(module):
            return _norm_any_layout(g, module, call, x, layout, args, kwargs)
        if layout != region_layout(shape, tuple(dims)) and contiguous_blocks(layout) == region_layout(shape, dims):
            layout = contiguous_blocks(layout)  # the same rows as one sharded factor
            g.mark(x, layout)
        if layout != region_layout(shape, tuple(dims)) and _pointwise_conv(module) and len(args) == 1:
            return _conv_fn(module)(x, module.weight, module.bias, 1, 0, 1, module.groups)  # routed: per pixel
        if layout != region_layout(shape, tuple(dims)):
            raise g.refuse(
                g.error(
                    f"{name} shards dims {tuple(dims)} but its input is sharded as {layout}",
                    layout,
                    "Keep the spatial layout (N, C, *spatial) that the region's input had.",
                )
            )

    with stepped_aside(g), using_buckets(g.buckets):
        out = call(*args, **kwargs)
    first = out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else out
    if isinstance(first, torch.Tensor) and getattr(first.grad_fn, "_forward_cls", None) is not None:
        g.vetted.add(first.grad_fn)
    if isinstance(first, torch.Tensor) and layout is not None:
        if dims is not None:
            g.mark(first, _twin_out_layout(module, first, tuple(dims)))
        elif first.dim() == x.dim() and x.dim() - 1 not in sharded_dims(layout):
            g.mark(first, layout[:-1] + (None,))  # a feature-dim layer (attention, tensor-parallel linear)
        else:
            raise g.error(f"{name} applied to domain-sharded data", layout)
    return out


def _statistics_twin(module) -> bool:
    return isinstance(module, _DomainNorm)


def _twin_out_layout(module, out: torch.Tensor, dims: Tuple[int, ...]) -> Layout:
    """A twin's output keeps its sharded dims, except an adaptive pool's dims of output size 1 (global
    reductions, replicated along them)."""
    size = getattr(module, "output_size", None)
    if size is None:
        return region_layout(out.shape, dims)
    per = list(size) if isinstance(size, (tuple, list)) else [size] * (out.dim() - 2)
    return tuple(
        ((int(out.shape[d]), dims.index(d)),) if d in dims and per[d - 2] != 1 else None for d in range(out.dim())
    )


def _pointwise_conv(module) -> bool:
    """A convolution twin whose window is one pixel (kernel 1, stride 1, no padding): per pixel on any layout
    (neuraloperator's ``ChannelMLP`` runs its ``Conv1d`` over flattened pixels)."""
    k = getattr(module, "kernel_size", None)
    if not isinstance(k, tuple) or "Transpose" in type(module).__name__ or not hasattr(module, "groups"):
        return False
    pad = module.padding
    pads = (pad,) if isinstance(pad, int) else () if isinstance(pad, str) else tuple(pad)
    return all(v == 1 for v in k + tuple(module.stride)) and all(p == 0 for p in pads)


def _conv_fn(module):
    return (F.conv1d, F.conv2d, F.conv3d)[len(module.kernel_size) - 1]
