"""The ``DistributedConvNd`` twins' convolution with the halo exchange overlapped (eager mode).

Forward: the halo messages are posted; while they fly, the *interior* output rows (whose windows
read only this rank's own rows, :func:`~tplayers.window_plan.split_rows`) are convolved straight
from the local input; after the wait, the two edge strips (which read halo or boundary rows) are
convolved from the padded input, and the three pieces are concatenated.

Backward: the edge strips' input gradients come first (they hold every halo row's gradient), the
adjoint halo messages are posted, and the interior's input and weight gradients are computed while
they fly (added into the own rows' gradient before the neighbours' halo gradients land); the
parameter-gradient sum over the domain follows (its own exchange / all-reduce).

Each output (and each gradient term) is the same sum of products as in one convolution over the
whole slab; only the parameter gradients are summed in three parts (interior, two strips).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tplayers.comm.halo import HaloState, halo_adjoint, halo_pad
from tplayers.window_plan import RowSplit, split_rows

__all__ = ["conv_split", "overlapped_forward", "overlapped_backward"]


def conv_split(spec, weight: torch.Tensor, own_rows: int) -> RowSplit:
    """Interior / edge output rows of this rank along the exchanged dim ``spec.dim``."""
    i = spec.dim - 2
    return split_rows(spec.plan, own_rows, weight.shape[spec.dim], spec.stride[i], spec.dilation[i])


def _conv(spec, order, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return order.back(spec.conv(order.fwd(x), order.fwd(weight), bias, order.stride, order.padding, order.dilation,
                                spec.groups))


def overlapped_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec,
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
    else:
        xp, state = halo_pad(x, dim, spec.group, plan.recv, plan.send, spec.periodic, spec.memory_format,
                             during=interior)
    out = []
    if split.lo or split.hi < split.out_rows:
        xc = spec.prepare(xp)
        for o0, o1, key in ((0, split.lo, "lo"), (split.hi, split.out_rows, "hi")):
            if o1 > o0:
                a, b = split.extended(o0, o1)
                pieces[key] = _conv(spec, order, xc.narrow(dim, a, b - a), weight, bias)
    out = [pieces[k] for k in ("lo", "mid", "hi") if k in pieces]
    y = out[0] if len(out) == 1 else torch.cat(out, dim)
    return y, xp, state


def overlapped_backward(grad: torch.Tensor, xp: torch.Tensor, weight: torch.Tensor, has_bias: bool, spec, order,
                        state: HaloState, needs: Tuple[bool, bool, bool]):
    """``(grad_x or None, [weight grad parts], [bias grad parts])``: the input gradient after the
    adjoint halo exchange, with the interior's gradients computed while its messages fly (eager;
    while compiling the same arithmetic runs with the exchange as one op)."""
    need_x, need_w, need_b = needs
    dim, plan = spec.dim, spec.plan
    split = conv_split(spec, weight, state.n)
    gws: List[torch.Tensor] = []
    gbs: List[torch.Tensor] = []
    nsp = len(spec.stride)

    def strip_backward(g: torch.Tensor, xin: torch.Tensor) -> Optional[torch.Tensor]:
        gi, gw, gb = torch.ops.aten.convolution_backward(
            order.fwd(g), order.fwd(xin), order.fwd(weight), [weight.shape[0]] if has_bias else None,
            order.stride, order.padding, order.dilation, False, [0] * nsp, spec.groups, [need_x, need_w, need_b])
        if need_w:
            gws.append(order.back(gw))
        if need_b:
            gbs.append(gb)
        return order.back(gi) if gi is not None else None

    # 1) the edge strips: every halo row's gradient
    identity = spec.rest is None and plan.boundary == (0, 0) and plan.trim == (0, 0)
    xc, pull = (xp, None) if identity or not need_x else _vjp(spec.prepare, xp)
    if not identity and not need_x:
        xc = spec.prepare(xp)
    gc = torch.zeros_like(xc) if need_x else None
    for o0, o1 in ((0, split.lo), (split.hi, split.out_rows)):
        if o1 > o0:
            a, b = split.extended(o0, o1)
            gi = strip_backward(grad.narrow(dim, o0, o1 - o0), xc.narrow(dim, a, b - a))
            if need_x:
                gc.narrow(dim, a, b - a).add_(gi)
    gxp = (gc if pull is None else pull(gc)) if need_x else None

    # 2) the interior, while the adjoint halo messages fly (eager), added into the own rows before
    #    the neighbours' halo gradients in both modes (the same float sums, compiled or not)
    def interior(grad_x: Optional[torch.Tensor], first: int = 0):
        if split.has_interior:
            a, b = split.own(split.lo, split.hi)
            xs = xp.narrow(dim, state.recv[0] + a, b - a)
            xr, pull_r = (xs, None) if spec.rest is None or not need_x else _vjp(spec.rest, xs)
            if spec.rest is not None and not need_x:
                xr = spec.rest(xs)
            gi = strip_backward(grad.narrow(dim, split.lo, split.hi - split.lo), xr)
            if grad_x is not None:
                grad_x.narrow(dim, first + a, b - a).add_(gi if pull_r is None else pull_r(gi))

    if not need_x:
        interior(None)
        return None, gws, gbs
    if torch.compiler.is_compiling():  # the exchange is one op: compute first (its result then
        interior(gxp, state.recv[0])   # depends on the output gradient everywhere)
        return halo_adjoint(gxp, state), gws, gbs
    return halo_adjoint(gxp, state, into_own=interior), gws, gbs


def _vjp(fn, x: torch.Tensor):
    """``(fn(x), pullback)``: autograd on a detached copy of the graph in eager, ``torch.func.vjp``
    while compiling (the padding / trim is cheap to replay; the convolution is never replayed)."""
    if torch.compiler.is_compiling():
        y, pull = torch.func.vjp(fn, x)
        return y, lambda g: pull(g)[0]
    x_ = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y = fn(x_)
    return y.detach(), lambda g: torch.autograd.grad(y, x_, g)[0]
