"""The ``DistributedConvNd`` twins' eager convolution with the halo exchange hidden behind compute.

A convolution is linear in its input. Where every shard's plan along the exchanged dim reads
exactly its own rows plus ``r`` rows each side (the neighbour's rows inside the domain, zeros at its
ends: zero padding ``r`` on both sides, nothing trimmed, as for a "same"-padded convolution; any
stride, dilation, groups; :func:`uniform_geometry`), the padded input is the own rows zero-padded
by ``r`` plus the halo rows alone, so::

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
The same messages as :func:`~tplayers.layers._conv_fn.halo_conv`: one exchange each way.

Two Functions, as :func:`~tplayers.layers._conv_fn.halo_conv`: :class:`EdgeConvSave` saves
exactly what ``nn.ConvNd`` saves (the input and the weight) before anything is computed, so
activation checkpointing stops its recomputation before the convolution; :class:`EdgeConvCompute`
exchanges and computes, and hands the received halo rows (``2r`` rows, the weight gradient's
strips) to :class:`EdgeConvSave`'s context. Eager only (``torch.compile`` traces ``halo_conv``).

Example (2 ranks; ``DistributedConv2d`` takes this path by itself for a slab of at least
:data:`EDGE_MIN_ELEMENTS` elements per rank where the plans allow it)::

    import torch, tplayers
    mesh = tplayers.init_mesh()
    conv = tplayers.DistributedConv2d(4, 8, 3, padding=1, mesh=mesh)
    y = conv(tplayers.shard(torch.randn(2, 4, 1024, 1024), 2, mesh))   # (2, 8, 512, 1024) per rank
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from tplayers.comm.halo import _swap
from tplayers.window_plan import AxisPlan
from tplayers.layers._conv_fn import (ConvSpec, finish_param_sum, flat_param_grads, in_format, post_param_sum,
                                      split_param_grads)
from tplayers.ops import unpack_faces

__all__ = ["EDGE_MIN_ELEMENTS", "EdgeGeometry", "edge_conv", "edge_geometry", "uniform_geometry"]

# The path's fixed cost is four to six thin convolution calls per step (the strips); its gain, the
# halo-padded copy of the slab not made and the exchange hidden, grows with the slab. Measured fwd+bwd
# on 2 ranks (fp32, 1 thread each, 3x3 "same", 32 -> 64 channels, a (4, 32, 128, 256) slab):
# 0.95-0.98x the halo-padded path on AVX-512 and AVX2 (oneDNN capped) alike, both layouts; on slabs
# of (4, 16, 64, 128) and less, a U-Net's at 128x128, no gain or a loss. Slabs (elements per rank,
# on average) at least this large take the path.
EDGE_MIN_ELEMENTS = 1 << 21


class EdgeGeometry(NamedTuple):
    """Where the halo rows meet the output along the exchanged dim (Python ints).

    ``pad``: the halo width ``r`` on each side (the main convolution's padding there);
    ``lo``: ``(strip rows,)`` of the low strip, whose outputs are rows ``[0, m)``, or ``None``;
    ``hi``: ``(first output row, strip rows, first halo row in the strip)`` of the high one, or ``None``.
    """

    pad: int
    lo: Optional[Tuple[int]]
    hi: Optional[Tuple[int, int, int]]


def edge_geometry(n: int, r: int, extent: int, stride: int, n_out: int, has_lo: bool,
                  has_hi: bool) -> Optional[EdgeGeometry]:
    """The strips of a window of ``extent`` rows (dilation included) and ``stride`` over ``n`` own rows
    padded by ``r`` on each side; ``None`` where that does not give ``n_out`` outputs, or a strip
    would not hold its whole halo (a padding wider than the window, a stride longer than it).

    >>> edge_geometry(8, 1, 3, 1, 8, True, True)      # 3x3 "same": one edge row each side
    EdgeGeometry(pad=1, lo=(3,), hi=(7, 3, 2))
    """
    total = n + 2 * r
    if n_out <= 0 or n_out != (total - extent) // stride + 1:
        return None
    lo = hi = None
    if has_lo and r:
        m = min(-(-r // stride), n_out)  # outputs whose window starts inside the low halo
        lo = ((m - 1) * stride + extent,)
        if lo[0] < r:
            return None
    if has_hi and r:
        first = max(0, (r + n - extent) // stride + 1)  # outputs whose window ends inside the high halo
        start = r + n - first * stride
        if start < 0:
            return None
        hi = (first, total - first * stride, start)
    return EdgeGeometry(r, lo, hi)


def uniform_geometry(plans: Sequence[AxisPlan], sizes: Sequence[int], coord: int, r: int, extent: int,
                     stride: int, zero_padded: bool) -> Optional[EdgeGeometry]:
    """Shard ``coord``'s :class:`EdgeGeometry` where every shard's plan (``plans`` of the dim's shards of
    ``sizes`` rows) follows the main-plus-strips rule: zero padding ``r`` on both sides
    (``zero_padded``), each side filled by exactly ``r`` halo rows or ``r`` boundary zeros, nothing
    trimmed, output rows everywhere; else ``None``. Decided from every shard's plan, so that every
    rank takes the same path (the same messages).

    >>> from tplayers.window_plan import conv_window, plan_windows
    >>> plans = plan_windows([5, 3], 8, conv_window(3, 1, 1, 1), mode="zeros", what="dim 2")
    >>> uniform_geometry(plans, [5, 3], 1, 1, 3, 1, True)
    EdgeGeometry(pad=1, lo=(3,), hi=None)
    """
    if not zero_padded or r <= 0:
        return None
    out, last = [], len(plans) - 1
    for c, (p, n) in enumerate(zip(plans, sizes)):
        # each side: r rows, zeros at the domain's ends (a plan may count those as received), the
        # neighbour's face inside; nothing trimmed
        if p.trim != (0, 0) or any(p.recv[i] + p.boundary[i] != r for i in (0, 1)):
            return None
        if (c > 0 and plans[c - 1].send[1] != r) or (c < last and plans[c + 1].send[0] != r):
            return None
        g = edge_geometry(n, r, extent, stride, p.out_rows, c > 0, c < last)
        if g is None:
            return None
        out.append(g)
    return out[coord]


def edge_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec,
              reduce: bool = True) -> torch.Tensor:
    """The distributed convolution by the main-plus-strips rule (module doc) for a ``spec`` whose
    ``edges`` is set; ``reduce=False``: parameter gradients returned as this rank's partial sums (a
    region's buckets sum them)."""
    x = x.contiguous(memory_format=spec.memory_format)  # the layout the plan convolves in
    halos: dict = {}  # filled by EdgeConvCompute: the received halo rows, for the weight gradient
    token = EdgeConvSave.apply(x, weight, bias, spec, halos, reduce)
    return EdgeConvCompute.apply(token, x.detach(), weight.detach(), None if bias is None else bias.detach(),
                                 spec, halos)


def _convolve(spec: ConvSpec, x, weight, bias, pad_main: bool, r: int) -> torch.Tensor:
    """``spec``'s convolution of ``x`` (padding ``r`` along the exchanged dim when ``pad_main``, else 0)."""
    o = spec.order
    return o.back(spec.conv(o.fwd(x), o.fwd(weight), bias, o.stride, _padding(spec, r if pad_main else 0),
                            o.dilation, spec.groups))


def _padding(spec: ConvSpec, r: int) -> List[int]:
    """The convolution's padding in the permuted order of ``spec.order``, ``r`` along the exchanged dim."""
    pad = list(spec.padding)
    pad[spec.dim - 2] = r
    order = spec.perm or range(len(pad))
    return [pad[i] for i in order]


def _strips(like: torch.Tensor, buf: torch.Tensor, n_lo: int, spec: ConvSpec):
    """``[(first output row, strip)]``: zero strips holding the received halo rows (``buf``: ``[from lo | from hi]``)."""
    dim, g, out = spec.dim, spec.edges, []
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
        box, g, (s_lo, s_hi), n = {}, spec.edges, spec.plan.send, x.size(spec.dim)

        def main():
            box["y"] = _convolve(spec, x, weight, bias, True, g.pad)

        buf, n_lo = _swap(x, spec.dim, (0, s_lo), (n - s_hi, s_hi), g.pad, g.pad, spec.route, "halo.fwd", main)
        halos["buf"], halos["n_lo"] = buf, n_lo
        y = box["y"]
        for first, strip in _strips(x, buf, n_lo, spec):
            piece = _convolve(spec, strip, weight, None, False, 0)
            y.narrow(spec.dim, first, piece.size(spec.dim)).add_(piece)
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
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        halos = ctx.halos  # kept with the graph (a retained graph's second backward reads them again)
        grad_x, flat = _backward(grad, x, weight, ctx.spec, (halos["buf"], halos["n_lo"]), need_x, need_w, need_b,
                                 ctx.reduce)
        gw, gb = split_param_grads(flat, weight, need_w, need_b)
        return grad_x, gw, gb, None, None, None


def _backward(grad, x, weight, spec: ConvSpec, received, need_x: bool, need_w: bool, need_b: bool, reduce: bool):
    """``(grad_x or None, flat [weight grad | bias grad], summed over the domain unless ``reduce`` is off)``."""
    dim, o, g = spec.dim, spec.order, spec.edges
    nsp = len(spec.stride)
    extent, stride = spec.dilation[dim - 2] * (weight.shape[dim] - 1) + 1, spec.stride[dim - 2]

    def conv_backward(gout, inp, pad_main, mask):
        gi, gw, gb = torch.ops.aten.convolution_backward(
            o.fwd(gout), o.fwd(inp), o.fwd(weight), [weight.shape[0]] if mask[2] else None, o.stride,
            _padding(spec, g.pad if pad_main else 0), o.dilation, False, [0] * nsp, spec.groups, mask)
        return (o.back(gi) if gi is not None else None), (o.back(gw) if gw is not None else None), gb

    def strip_grad(first, rows):
        return grad.narrow(dim, first, (rows - extent) // stride + 1)

    # 1) every halo row's gradient, from the strips (only their shapes are read: zeros stand in)
    halo_grads = []
    if need_x:
        for side in filter(None, (g.lo, g.hi)):
            rows, first, at = _side(g, side)
            zeros = x.new_zeros(()).expand(_with(x.shape, dim, rows))
            halo_grads.append(conv_backward(strip_grad(first, rows), zeros, False, [True, False, False])[0]
                              .narrow(dim, at, g.pad))

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
        src = torch.cat(halo_grads, dim) if len(halo_grads) > 1 else \
            halo_grads[0] if halo_grads else grad.new_zeros(_with(x.shape, dim, 0))
        buf, _ = _swap(src, dim, to_lo, to_hi, s_hi, s_lo, spec.route, "halo.bwd", main)
        grad_x = box["gi"]
        faces = ([(0, s_lo)] if lo is not None and s_lo else []) + ([(n - s_hi, s_hi)] if hi is not None and s_hi else [])
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
