"""The ``DistributedConvNd`` twins' convolution with the halo exchange overlapped with compute.

Two autograd Functions, as :func:`~tplayers.layers._conv_fn.halo_conv` (activation
checkpointing stops recomputing before the convolution): :class:`HaloConvSave` saves only the
local input and the weight (exactly what ``nn.ConvNd`` holds) and runs no compute;
:class:`HaloConvOverlap` computes.

Forward: the halo messages are posted; while they fly, the *interior* output rows (whose windows
read only this rank's own rows, :func:`~tplayers.window_plan.split_rows`) are convolved straight
from the local input; after the wait, the two edge strips (which read halo or boundary rows) are
convolved from the padded input, and the pieces are concatenated.

Backward: the edge strips' input gradients first (they need only the weight, and they hold every
halo row's gradient); then one window with two exchanges in flight: the adjoint halo (those
gradients to their owners) and the input's faces again (the edge strips' weight gradient needs the
halo rows, which are not kept from forward to backward); the interior's input and weight gradients
are computed while both fly; then the edge strips' weight gradients and the parameter-gradient sum
over the domain. While compiling, the same arithmetic runs with each exchange as one op.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from tplayers.comm.halo import HaloState, halo_adjoint, halo_pad, halo_state
from tplayers.layers._conv_fn import (ConvSpec, _compiled_backward, _Order, _reduce_backward, flat_param_grads,
                                      in_format, split_param_grads)
from tplayers.window_plan import RowSplit, split_rows

__all__ = ["HaloConvOverlap", "HaloConvSave", "conv_split", "overlapped_conv", "overlapped_forward"]


def conv_split(spec, weight: torch.Tensor, own_rows: int) -> RowSplit:
    """Interior / edge output rows of this rank along the exchanged dim ``spec.dim``."""
    i = spec.dim - 2
    return split_rows(spec.plan, own_rows, weight.shape[spec.dim], spec.stride[i], spec.dilation[i])


def _conv(spec, order, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return order.back(spec.conv(order.fwd(x), order.fwd(weight), bias, order.stride, order.padding, order.dilation,
                                spec.groups))


def overlapped_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec,
                       order) -> Tuple[torch.Tensor, torch.Tensor, HaloState]:
    """``(output, halo-padded input, adjoint state)``; the interior rows are convolved between
    posting the halo messages and waiting for them."""
    dim, plan = spec.dim, spec.plan
    split = conv_split(spec, weight, x.size(dim))
    pieces: dict = {}

    def interior(src=x, first=0):
        if split.has_interior:
            a, b = split.own(split.lo, split.hi)
            xi = src.narrow(dim, first + a, b - a).contiguous(memory_format=spec.memory_format)
            pieces["mid"] = _conv(spec, order, xi if spec.rest is None else spec.rest(xi), weight, bias)

    if torch.compiler.is_compiling():
        # read the interior from the exchange's result: a graph partitioner would otherwise be free
        # to move an exchange whose result the forward does not use into the backward graph
        xp, state = halo_pad(x, dim, spec.group, plan.recv, plan.send, spec.periodic, spec.memory_format)
        interior(xp, plan.recv[0])
    else:  # the interior reads the padded buffer's own rows, filled (in its layout) before posting
        shape = list(x.shape)
        shape[dim] += plan.recv[0] + plan.recv[1]
        xp = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=spec.memory_format)
        xp, state = halo_pad(x, dim, spec.group, plan.recv, plan.send, spec.periodic, spec.memory_format,
                             during=lambda: interior(xp, plan.recv[0]), out=xp)
    out = []
    if split.lo or split.hi < split.out_rows:
        xc = spec.prepare(xp)
        for o0, o1, key in ((0, split.lo, "lo"), (split.hi, split.out_rows, "hi")):
            if o1 > o0:
                a, b = split.extended(o0, o1)
                pieces[key] = _conv(spec, order, xc.narrow(dim, a, b - a), weight, bias)
    out = [pieces[k] for k in ("lo", "mid", "hi") if k in pieces]
    if len(out) == 1:
        return in_format(out[0], spec.out_format), xp, state
    # the pieces assembled straight into the output's layout (a layout change rides on this copy)
    y = torch.empty(spec.out_shape, dtype=out[0].dtype, device=out[0].device, memory_format=spec.out_format)
    at = 0
    for piece in out:
        y.narrow(dim, at, piece.size(dim)).copy_(piece)
        at += piece.size(dim)
    return y, xp, state


def overlapped_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec,
                    reduce: bool = True) -> torch.Tensor:
    """The distributed convolution with the exchange overlapped: :class:`HaloConvSave` (saves ``x``
    and the weight, the whole backward) then :class:`HaloConvOverlap` (exchange + convolution).
    ``reduce=False``: parameter gradients returned as partial sums (as :func:`halo_conv`)."""
    token = HaloConvSave.apply(x, weight, bias, spec, reduce)
    return HaloConvOverlap.apply(token, x.detach(), weight.detach(), None if bias is None else bias.detach(), spec)


class HaloConvOverlap(torch.autograd.Function):
    """forward: the halo exchange overlapped with the interior rows' convolution, then the edge
    strips (:func:`overlapped_forward`); saves nothing /
    backward: the output gradient handed unchanged to :class:`HaloConvSave` through ``token``."""

    @staticmethod
    def forward(ctx, token, x, weight, bias, spec: ConvSpec):
        with torch.no_grad():
            if spec.empty:  # no output rows: still sends this rank's faces
                p = spec.plan
                xp, _ = halo_pad(x, spec.dim, spec.group, p.recv, p.send, spec.periodic, spec.memory_format)
                return x.new_zeros(spec.out_shape) + xp.narrow(spec.dim, 0, 0).sum()  # (used: no graph drops it)
            return overlapped_forward(x, weight, bias, spec, _Order(spec))[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class HaloConvSave(torch.autograd.Function):
    """forward: saves the local input and the weight; returns ``token``, zero-strided zeros of the
    output's shape whose gradient is the convolution's output gradient /
    backward: the overlapped backward (module doc): adjoint halo and the input's faces again in one
    window with the interior's gradients; then the parameter-gradient sum over the domain
    (all-reduce(s)). A rank owning no output rows takes part
    in every exchange with zero contributions.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spec: ConvSpec, reduce: bool = True):
        ctx.save_for_backward(x, weight)
        ctx.spec, ctx.has_bias, ctx.reduce = spec, bias is not None, reduce
        return x.new_zeros(()).expand(spec.out_shape)  # x and weight share a dtype (checked by the layer)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        spec = ctx.spec
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        p = spec.plan
        state = halo_state(x, spec.dim, spec.group, p.recv, p.send, spec.periodic)
        grad_x, gws = _backward(grad, x, weight, spec, _Order(spec), state, need_x, need_w)
        gw = (_sum(gws) if gws else torch.zeros_like(weight)) if need_w else None
        gb = grad.sum([d for d in range(grad.dim()) if d != 1]) if need_b else None
        flat = flat_param_grads(gw, gb, need_w, need_b)
        groups = [g for g in spec.reduce_groups if dist.get_world_size(g) > 1] if flat is not None and ctx.reduce else []
        if torch.compiler.is_compiling():
            _, flat = _compiled_backward(None, flat, state, groups)
        elif groups:
            _reduce_backward(None, flat, state, groups)
        gw, gb = split_param_grads(flat, weight, need_w, need_b)
        return grad_x, gw, gb, None, None


def _backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, spec: ConvSpec, order, state: HaloState,
              need_x: bool, need_w: bool) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    """``(grad_x or None, [weight gradient parts])`` (module doc, backward)."""
    dim, plan = spec.dim, spec.plan
    split = conv_split(spec, weight, state.n)
    nsp = len(spec.stride)
    gws: List[torch.Tensor] = []
    # (a rank owning no output rows, along this dim or another, computes nothing but still exchanges)
    strips = [(o0, o1) + split.extended(o0, o1) for o0, o1 in ((0, split.lo), (split.hi, split.out_rows))
              if o1 > o0 and not spec.empty]

    def conv_backward(g, xin, mask):
        gi, gw, _ = torch.ops.aten.convolution_backward(
            order.fwd(g), order.fwd(xin), order.fwd(weight), None, order.stride, order.padding, order.dilation,
            False, [0] * nsp, spec.groups, mask + [False])
        if gw is not None:
            gws.append(order.back(gw))
        return order.back(gi) if gi is not None else None

    # 1) the edge strips' input gradients (every halo row's gradient): they need only the weight
    gxp = None
    if need_x:
        shape = list(x.shape)
        shape[dim] = plan.recv[0] + state.n + plan.recv[1]
        zeros = x.new_zeros(()).expand(shape)  # stands in for the padded input: only its shape is read
        identity = spec.rest is None and plan.boundary == (0, 0) and plan.trim == (0, 0)
        zc, pull = (zeros, None) if identity else _vjp(spec.prepare, zeros)
        gc = x.new_zeros(zc.shape)
        for o0, o1, a, b in strips:
            gc.narrow(dim, a, b - a).add_(conv_backward(grad.narrow(dim, o0, o1 - o0), zc.narrow(dim, a, b - a),
                                                        [True, False]))
        gxp = gc if pull is None else pull(gc)

    # 2) the interior's input and weight gradients, added into the own rows before the neighbours'
    #    halo gradients (the same float sums compiled or not)
    def interior(grad_x: Optional[torch.Tensor], first: int = 0, src: Optional[torch.Tensor] = None, at: int = 0):
        if split.has_interior and not spec.empty:
            a, b = split.own(split.lo, split.hi)
            xs = (x if src is None else src).narrow(dim, at + a, b - a).contiguous(memory_format=spec.memory_format)
            xr, pull_r = (xs, None) if spec.rest is None or not need_x else _vjp(spec.rest, xs)
            if spec.rest is not None and not need_x:
                xr = spec.rest(xs)
            gi = conv_backward(grad.narrow(dim, split.lo, split.hi - split.lo), xr, [need_x, need_w])
            if grad_x is not None:
                grad_x.narrow(dim, first + a, b - a).add_(gi if pull_r is None else pull_r(gi))

    xp_box = []

    def refetch(grad_x: Optional[torch.Tensor]):  # the input's faces again, the interior meanwhile
        if need_w:  # (reading the padded buffer's own rows, filled in its layout before posting)
            shape = list(x.shape)
            shape[dim] += plan.recv[0] + plan.recv[1]
            xp = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=spec.memory_format)
            xp_box.append(halo_pad(x, dim, spec.group, plan.recv, plan.send, spec.periodic, spec.memory_format,
                                   during=lambda: interior(grad_x, src=xp, at=plan.recv[0]), second=True, out=xp)[0])
        else:
            interior(grad_x)

    if torch.compiler.is_compiling():
        interior(gxp, plan.recv[0])
        grad_x = halo_adjoint(gxp, state) if need_x else None
        if need_w:  # after the adjoint on every rank: made to depend on it (+ an empty sum, 0.0), so no
            # graph partitioner or scheduler moves this exchange (its input is a forward tensor) elsewhere
            after = (grad_x if need_x else grad).narrow(dim, 0, 0).sum()
            xp_box.append(halo_pad(x + after, dim, spec.group, plan.recv, plan.send, spec.periodic,
                                   spec.memory_format)[0])
    elif need_x:
        grad_x = halo_adjoint(gxp, state, into_own=refetch)
    else:
        grad_x = None
        refetch(None)

    # 3) the edge strips' weight gradients, from the halo rows just received
    if need_w and strips:
        xc = spec.prepare(xp_box[0])
        for o0, o1, a, b in strips:
            conv_backward(grad.narrow(dim, o0, o1 - o0), xc.narrow(dim, a, b - a), [False, True])
    elif need_w and torch.compiler.is_compiling():  # keep the exchange's result used: no partitioner drops it
        gws.append(xp_box[0].narrow(dim, 0, 0).sum() + torch.zeros_like(weight))
    return grad_x, gws


def _sum(parts: List[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _vjp(fn, x: torch.Tensor):
    """``(fn(x), pullback)``: autograd on a detached replay in eager, ``torch.func.vjp`` while
    compiling (only cheap padding / trim is replayed, never a convolution)."""
    if torch.compiler.is_compiling():
        y, pull = torch.func.vjp(fn, x)
        return y, lambda g: pull(g)[0]
    x_ = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y = fn(x_)
    return y.detach(), lambda g: torch.autograd.grad(y, x_, g)[0]
