"""The main-plus-strips strategy of the ``DistributedConvNd`` twins' convolution.

Taken where ``ConvSpec.strips`` is an :class:`~tplayers.window_plan.EdgeGeometry` (eager only). A
convolution is linear in its input. Where every shard's plan along the exchanged dim reads exactly its own rows
plus ``r`` rows each side (the neighbour's rows inside the domain, zeros at its ends: zero padding
``r`` on both sides, nothing trimmed, as for a "same"-padded convolution; any stride, dilation,
groups; :func:`~tplayers.window_plan.uniform_geometry`), the padded input is the own rows
zero-padded by ``r`` plus the halo rows alone, so::

    conv(padded) = conv(own rows, padding r)              # the main convolution, on x itself
                 + conv([halo_lo | 0 ...])  on the first output rows   # thin edge strips,
                 + conv([... 0 | halo_hi])  on the last output rows    # no bias

Forward: the halo messages are posted and the main convolution runs on the local input itself
(no halo-padded copy) while they fly; then each strip's contribution is added into its edge rows.
Backward: the strips' input gradients first (every halo row's gradient: they need only the weight
and the output gradient); then those gradients travel to their owners while the main
convolution's backward runs (input, weight and bias gradients in one call, the input gradient in
the input's own shape), then the strips' weight gradients (from the halo rows the forward received),
and the parameter-gradient sum is posted; the received gradients are added into the own edge rows.
The same messages as the halo-padded strategy: one exchange each way.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from tplayers.comm.halo import _swap
from tplayers.layers._conv_fn import (
    ConvSpec,
    finish_param_sum,
    flat_param_grads,
    in_format,
    post_param_sum,
    split_param_grads,
)
from tplayers.layers._conv_twice import twice_backward
from tplayers.ops import unpack_faces
from tplayers.window_plan import EdgeGeometry

__all__ = ["EdgeConvCompute", "EdgeConvSave"]


def _convolve(spec: ConvSpec, x, weight, bias, pad_main: bool, r: int) -> torch.Tensor:
    """``spec``'s convolution of ``x`` (padding ``r`` along the exchanged dim when ``pad_main``, else 0)."""
    o = spec.order
    return o.back(
        spec.conv_fn(
            o.fwd(x), o.fwd(weight), bias, o.stride, _padding(spec, r if pad_main else 0), o.dilation, spec.groups
        )
    )


def _padding(spec: ConvSpec, r: int) -> List[int]:
    """The convolution's padding in the permuted order of ``spec.order``, ``r`` along the exchanged dim."""
    pad = list(spec.padding)
    pad[spec.halo_dim - 2] = r
    order = spec.spatial_order or range(len(pad))
    return [pad[i] for i in order]


def _strips(like: torch.Tensor, buf: torch.Tensor, n_lo: int, spec: ConvSpec):
    """``[(first output row, strip)]``: zero strips holding the received halo rows (``buf``: ``[from lo | from hi]``)."""
    dim, g, out = spec.halo_dim, spec.strips, []
    for part, side in ((buf[:n_lo], g.lo), (buf[n_lo:], g.hi)):
        if side is None:
            continue
        rows, first, at = _side(g, side)
        strip = like.new_zeros(_with(like.shape, dim, rows)).contiguous(memory_format=spec.memory_format)
        unpack_faces(part, strip, dim, [(at, g.pad)])
        out.append((first, strip))
    return out


def _side(g: EdgeGeometry, side) -> Tuple[int, int, int]:
    """``(strip rows, first output row, first halo row in the strip)`` of ``side`` (``g.lo`` or ``g.hi``)."""
    return (side[0], 0, 0) if side is g.lo else (side[1], side[0], side[2])


class EdgeConvCompute(torch.autograd.Function):
    """forward: the halo exchange in flight while the main convolution runs on the local input, then the
    edge strips added (module doc); the received rows go to ``halos`` / backward: the output gradient
    handed unchanged to :class:`EdgeConvSave` through ``token``."""

    @staticmethod
    def forward(ctx, token, x, weight, bias, spec: ConvSpec, halos: dict):
        box, g, (s_lo, s_hi), n = {}, spec.strips, spec.plan.send, x.size(spec.halo_dim)

        def main():
            box["y"] = _convolve(spec, x, weight, bias, True, g.pad)

        buf, n_lo = _swap(x, spec.halo_dim, (0, s_lo), (n - s_hi, s_hi), g.pad, g.pad, spec.route, "halo.fwd", main)
        halos["buf"], halos["n_lo"] = buf, n_lo
        y = box["y"]
        for first, strip in _strips(x, buf, n_lo, spec):
            piece = _convolve(spec, strip, weight, None, False, 0)
            y.narrow(spec.halo_dim, first, piece.size(spec.halo_dim)).add_(piece)
        return in_format(y, spec.out_format)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None


class EdgeConvSave(torch.autograd.Function):
    """forward: saves the local input and the weight; returns ``token``, zero-strided zeros of the
    output's shape whose gradient is the convolution's output gradient /
    backward: strips' input gradients, then their adjoint exchange in flight while the main
    convolution's backward, the strips' weight gradients and the parameter-gradient sum run (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: ConvSpec, halos: dict, reduce: bool = True):
        ctx.save_for_backward(x, weight)
        ctx.spec, ctx.halos, ctx.has_bias, ctx.reduce = spec, halos, bias is not None, reduce
        return x.new_zeros(()).expand(spec.out_shape)  # x and weight share a dtype (checked by the layer)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph=True: a double backward reads the input gradient
            return twice_backward(EdgeConvSave.first_backward, ctx, grad, ctx.saved_tensors[1])
        return EdgeConvSave.first_backward(ctx, grad)

    @staticmethod
    def first_backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        halos = ctx.halos  # kept with the graph (a retained graph's second backward reads them again)
        grad_x, flat = _strips_backward(
            grad, x, weight, ctx.spec, (halos["buf"], halos["n_lo"]), need_x, need_w, need_b, ctx.reduce
        )
        gw, gb = split_param_grads(flat, weight, need_w, need_b)
        return grad_x, gw, gb, None, None, None


def _strips_backward(grad, x, weight, spec: ConvSpec, received, need_x: bool, need_w: bool, need_b: bool, reduce: bool):
    """``(grad_x or None, flat [weight grad | bias grad], summed over the domain unless ``reduce`` is off)``."""
    dim, o, g = spec.halo_dim, spec.order, spec.strips
    nsp = len(spec.stride)
    extent, stride = spec.dilation[dim - 2] * (weight.shape[dim] - 1) + 1, spec.stride[dim - 2]

    def conv_backward(gout, inp, pad_main, mask):
        gi, gw, gb = torch.ops.aten.convolution_backward(
            o.fwd(gout),
            o.fwd(inp),
            o.fwd(weight),
            [weight.shape[0]] if mask[2] else None,
            o.stride,
            _padding(spec, g.pad if pad_main else 0),
            o.dilation,
            False,
            [0] * nsp,
            spec.groups,
            mask,
        )
        return (o.back(gi) if gi is not None else None), (o.back(gw) if gw is not None else None), gb

    def strip_grad(first, rows):
        return grad.narrow(dim, first, (rows - extent) // stride + 1)

    # 1) every halo row's gradient, from the strips (only their shapes are read: zeros stand in)
    halo_grads = []
    if need_x:
        for side in filter(None, (g.lo, g.hi)):
            rows, first, at = _side(g, side)
            zeros = x.new_zeros(()).expand(_with(x.shape, dim, rows))
            halo_grads.append(
                conv_backward(strip_grad(first, rows), zeros, False, [True, False, False])[0].narrow(dim, at, g.pad)
            )

    box: dict = {"pending": []}

    def main():  # the main convolution's backward, the strips' weight gradients, the sum posted
        gi, gw, gb = conv_backward(grad, x, True, [need_x, need_w, need_b])
        if need_w:
            for first, strip in _strips(x, *received, spec):
                gw = gw + conv_backward(strip_grad(first, strip.size(dim)), strip, False, [False, True, False])[1]
        box["gi"], box["flat"] = gi, flat_param_grads(gw, gb, need_w, need_b)
        if box["flat"] is not None and reduce:
            box["pending"] = post_param_sum(box["flat"], spec.live_groups)

    grad_x = None
    if need_x:
        lo, hi = spec.route.peers
        (s_lo, s_hi), n = spec.plan.send, x.size(dim)
        to_lo = (0, g.pad if g.lo else 0)  # faces of [lo halo's gradient | hi halo's gradient]
        to_hi = (g.pad if g.lo else 0, g.pad if g.hi else 0)
        src = (
            torch.cat(halo_grads, dim)
            if len(halo_grads) > 1
            else halo_grads[0]
            if halo_grads
            else grad.new_zeros(_with(x.shape, dim, 0))
        )
        buf, _ = _swap(src, dim, to_lo, to_hi, s_hi, s_lo, spec.route, "halo.bwd", main)
        grad_x = box["gi"]
        faces = ([(0, s_lo)] if lo is not None and s_lo else []) + (
            [(n - s_hi, s_hi)] if hi is not None and s_hi else []
        )
        unpack_faces(buf, grad_x, dim, faces, accumulate=True)  # overlapping faces add up
    else:
        main()
    flat = box["flat"]
    if flat is not None and reduce:
        flat = finish_param_sum(flat, box["pending"], spec.live_groups)
    return grad_x, flat


def _with(shape, dim: int, rows: int) -> List[int]:
    out = list(shape)
    out[dim] = rows
    return out
