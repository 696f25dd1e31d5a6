"""A convolution twin's input gradient as a graph (a backward run with ``create_graph=True``).

The twins' fused backward (:mod:`tplayers.layers._conv_fn`, :mod:`tplayers.layers._conv_strips`)
computes outside autograd. Where a double backward will read the input gradient (an R1 or WGAN-GP
gradient penalty of a domain-parallel discriminator), :func:`twice_input_grad` computes it again
as an autograd graph of the output gradient and the weight: the halo-padded convolution, whose input
gradient does not depend on the input (it is linear), differentiated at zeros through
:class:`~tplayers.comm.halo.HaloExchange1d` (whose backward is then its adjoint's node). The
parameter gradients come back through :func:`tplayers.comm.twice.once_only`. See docs/design.md
(double backward).
"""

from __future__ import annotations

import torch

from tplayers.comm.halo_grad import HaloExchange1d
from tplayers.comm.twice import once_only
from tplayers.domain.boundary import ReplicatedToSharded

__all__ = ["twice_backward"]


def twice_input_grad(spec, like: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, reduce: bool) -> torch.Tensor:
    """The input gradient (shape and dtype of ``like``) of the convolution ``spec`` with ``weight``, for
    the output gradient ``grad``, as an autograd graph of ``grad`` and ``weight``. ``reduce``: the twin sums
    its weight's gradient itself (not a region's bucket, whose deposit node sums what reaches it)."""
    if spec.empty:
        return torch.zeros_like(like)
    o, p = spec.order, spec.plan
    if reduce and spec.live_groups:  # a weight the twin sums itself: the penalty's partial gradients too
        weight = ReplicatedToSharded.apply(weight, list(spec.live_groups))
    with torch.enable_grad():
        z = torch.zeros_like(like).requires_grad_()
        zp = HaloExchange1d.apply(z, spec.halo_dim, spec.halo_group, p.recv, p.send, spec.periodic)
        zc = zp if spec.skip_pad_and_trim else spec.pad_and_trim(zp)
        y = o.back(spec.conv_fn(o.fwd(zc), o.fwd(weight), None, o.stride, o.padding, o.dilation, spec.groups))
        return torch.autograd.grad(y, z, grad, create_graph=True)[0]


def twice_backward(first, ctx, grad, weight):
    """``first(ctx, grad)`` (the fused backward: ``(grad_x, grad_w, grad_b, *rest)``) run without recording,
    then the input gradient again as a graph and the parameter gradients as :func:`once_only`."""
    with torch.no_grad():
        gx, gw, gb, *rest = first(ctx, grad)
    if gx is not None:
        gx = twice_input_grad(ctx.spec, gx, weight, grad, ctx.reduce)
    gw, gb = once_only("a convolution twin's parameter gradient taken with create_graph=True", gw, gb)
    return (gx, gw, gb, *rest)
