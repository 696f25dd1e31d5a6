"""The N-d halo exchange of the window ops, and its adjoint.

:func:`gather_windows` turns this rank's slab into exactly the (extended) input
rows its output rows read, along each sharded dim in mesh order: halo rows from
the neighbours (:class:`~tplayers.comm.halo.HaloExchange1d`), boundary rows padded
locally (zeros, a constant such as ``-inf``, reflect, replicate; a periodic
domain wraps through the exchange), unneeded own rows trimmed. Dims are done
one after the other on the already padded tensor, so corner blocks travel with
the later dim's exchange (no diagonal messages, and every row sent is read).

:func:`scatter_add_windows` is its adjoint (the transposed convolution's
exchange): a partial result covering the extended rows ``[a, b)`` of a plan is
added into the ranks that own those rows (boundary rows are dropped), dims in
reverse order. :class:`HaloScatterAdd1d` is one dim of it, an autograd
Function whose backward is the gather.

Plans come from :mod:`tplayers.window_plan` (one :class:`AxisPlan` per dim).

Example (2 ranks): each rank holds 4 rows; a 3-row window needs one row from
the neighbour and one zero row at the global edge::

    from tplayers.window_plan import plan_windows, conv_window
    plan = plan_windows([4, 4], 8, conv_window(3, 1, 1, 1), mode="zeros", what="H")[rank]
    xp = gather_windows(x, {2: plan}, {2: mesh.get_group(0)}, "zeros")   # 6 rows
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from tplayers.comm.halo import HaloState, halo_adjoint, halo_pad
from tplayers.comm.halo_grad import HaloExchange1d
from tplayers.comm.halo_route import _peers
from tplayers.window_plan import AxisPlan

__all__ = ["gather_windows", "scatter_add_windows", "gather_rows", "HaloScatterAdd1d", "pad_arg", "edge_pad", "pad_dim"]


def pad_arg(ndim: int, dim: int, lo: int, hi: int) -> list:
    """``F.pad`` argument padding only ``dim`` of an ``ndim``-D tensor."""
    pad = [0] * (2 * (ndim - dim))
    pad[-2], pad[-1] = lo, hi
    return pad


def edge_pad(x: torch.Tensor, dim: int, plan: AxisPlan, mode: str, fill: float = 0.0) -> torch.Tensor:
    """Boundary padding (outside the global rows) then the trim: the plan's needed rows."""
    bl, bh = plan.boundary
    if bl or bh:
        if mode in ("reflect", "replicate"):
            x = pad_dim(x, dim, bl, bh, mode)
        else:
            x = F.pad(x, pad_arg(x.dim(), dim, bl, bh), value=fill if mode == "fill" else 0.0)
    t_lo, t_hi = plan.trim
    if t_lo or t_hi:
        x = x.narrow(dim, t_lo, x.size(dim) - t_lo - t_hi)
    return x


def pad_dim(x: torch.Tensor, dim: int, lo: int, hi: int, mode: str) -> torch.Tensor:
    """Reflect / replicate / circular padding of one dim of any tensor (``F.pad`` supports these on
    the last 1-3 dims of a batched tensor only, so the dim is moved last and the rest flattened)."""
    if x.numel() == 0 or x.size(dim) == 0:  # nothing to reflect: an empty slab (or no rows) pads with zeros
        return F.pad(x, pad_arg(x.dim(), dim, lo, hi))
    moved = x.movedim(dim, -1)
    shape = moved.shape
    flat = moved.reshape(1, -1, shape[-1])  # (1, rest, L)
    out = F.pad(flat, (lo, hi), mode=mode)
    return out.reshape(*shape[:-1], out.size(-1)).movedim(-1, dim)


def gather_rows(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    plan: AxisPlan,
    mode: str,
    fill: float = 0.0,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """One dim of :func:`gather_windows` (halo exchange, boundary padding, trim)."""
    periodic = mode == "circular"
    if plan.exchanges or (periodic and dist.get_world_size(group) == 1):
        x = HaloExchange1d.apply(x, dim, group, plan.recv, plan.send, periodic, memory_format)
    return edge_pad(x, dim, plan, mode, fill)


def gather_windows(
    x: torch.Tensor,
    plans: Mapping[int, AxisPlan],
    groups: Mapping[int, dist.ProcessGroup],
    mode: str,
    fill: float = 0.0,
) -> torch.Tensor:
    """This rank's slab extended to the rows its outputs read, along every planned dim (in order).

    forward: halo exchange per dim (corners ride on the later dims) + local boundary padding /
    backward: the adjoint (halo gradients added into their owners' edge rows).
    """
    for d, plan in plans.items():
        x = gather_rows(x, d, groups[d], plan, mode, fill)
    return x


class HaloScatterAdd1d(torch.autograd.Function):
    """forward: ``part`` holds the extended rows ``[a, b)`` of ``plan``; rows owned by a neighbour
    are sent to it and added into its edge rows, boundary rows dropped; returns this rank's own
    rows / backward: the gather of the same plan (halo exchange of the gradient, zero boundary)."""

    @staticmethod
    def forward(ctx, part, dim, group, plan, own_rows):
        ctx.dim, ctx.group, ctx.plan = dim, group, plan
        ctx.periodic = False
        full = _untrim(part, dim, plan)  # adjoint of the trim and of the zero boundary padding
        if not plan.exchanges:
            return full.narrow(dim, plan.recv[0], own_rows).clone()
        state = HaloState(dim, group, plan.recv, plan.send, own_rows, _peers(group, False), torch.contiguous_format)
        return halo_adjoint(full.contiguous(), state)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        plan, dim = ctx.plan, ctx.dim
        if plan.exchanges:
            grad, _ = halo_pad(grad.contiguous(), dim, ctx.group, plan.recv, plan.send, False)
        return edge_pad(grad, dim, plan, "zeros"), None, None, None, None


def _untrim(part: torch.Tensor, dim: int, plan: AxisPlan) -> torch.Tensor:
    """Rows ``[a, b)`` -> the halo-padded layout ``[recv lo | own | recv hi]`` (zeros where nothing lands)."""
    (t_lo, t_hi), (bl, bh) = plan.trim, plan.boundary
    lo, hi = t_lo - bl, t_hi - bh  # >0: zero rows to add; <0: boundary rows to drop
    if lo < 0:
        part = part.narrow(dim, -lo, part.size(dim) + lo)
    if hi < 0:
        part = part.narrow(dim, 0, part.size(dim) + hi)
    if lo > 0 or hi > 0:
        part = F.pad(part, pad_arg(part.dim(), dim, max(lo, 0), max(hi, 0)))
    return part


def scatter_add_windows(
    part: torch.Tensor, plans: Mapping[int, AxisPlan], groups: Mapping[int, dist.ProcessGroup], own: Mapping[int, int]
) -> torch.Tensor:
    """Adjoint of :func:`gather_windows` (zero boundary): add ``part`` into the owners of its rows.

    ``own[d]`` is this rank's row count along ``d`` in the owners' partition. Dims in reverse order.
    """
    for d in reversed(list(plans)):
        part = HaloScatterAdd1d.apply(part, d, groups[d], plans[d], own[d])
    return part
