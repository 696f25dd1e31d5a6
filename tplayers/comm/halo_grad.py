"""The halo exchange as autograd nodes: :class:`HaloExchange1d` (forward: the exchange; backward: its
adjoint) and :class:`HaloAdjoint1d` (the reverse pair, what a double backward differentiates), and the
:func:`halo_exchange` front door over a mesh's dims. The eager bodies and the custom ops they call
under ``torch.compile`` are :mod:`tplayers.comm.halo`'s.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.halo import HaloState, Pair, halo_adjoint, halo_pad

__all__ = ["HaloAdjoint1d", "HaloExchange1d", "halo_exchange", "halo_widths_ok"]


class HaloExchange1d(torch.autograd.Function):
    """forward: send ``send`` edge rows to the neighbours along ``dim`` and return ``x`` padded
    with the ``recv`` rows they send (zeros at a non-periodic boundary) /
    backward: send the halo gradients back to their owners, which add them into their edge rows."""

    @staticmethod
    def forward(ctx, x, dim, group, recv, send, periodic, memory_format=torch.contiguous_format):
        out, ctx.state = halo_pad(x, dim, group, recv, send, periodic, memory_format)
        ctx.args = (dim, group, recv, send, periodic)
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph=True: the adjoint as a node a double backward differentiates
            return HaloAdjoint1d.apply(grad, ctx.state, ctx.args), None, None, None, None, None, None
        return halo_adjoint(grad, ctx.state), None, None, None, None, None, None


class HaloAdjoint1d(torch.autograd.Function):
    """forward: :func:`halo_adjoint` (halo gradients sent back and added into their owners' edge rows) /
    backward: the exchange itself (:class:`HaloExchange1d`), the adjoint's adjoint: what a double
    backward (a gradient penalty) through a halo exchange runs."""

    @staticmethod
    def forward(ctx, grad, state: "HaloState", args):
        ctx.args = args
        return halo_adjoint(grad, state)

    @staticmethod
    def backward(ctx, gg):
        return HaloExchange1d.apply(gg, *ctx.args), None, None


def _pairs(name: str, value, count: int) -> List[Pair]:
    if count == 1 and len(value) == 2 and all(isinstance(v, int) for v in value):
        value = [value]
    value = [tuple(int(w) for w in p) for p in value]
    if len(value) != count or any(len(p) != 2 or min(p) < 0 for p in value):
        raise ValueError(
            f"{name} must hold one (lo, hi) pair of non-negative widths per shard dim ({count}), got {value!r}"
        )
    return value


def halo_widths_ok(n: int, send: Pair) -> bool:
    """Whether a slab of ``n`` rows can supply the ``send`` faces."""
    return send[0] <= n and send[1] <= n


def halo_exchange(
    x: torch.Tensor,
    mesh: DeviceMesh,
    shard_dims: Sequence[int],
    recv,
    send,
    periodic,
    *,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """``x`` padded with its neighbours' edge rows along each of ``shard_dims`` (see module doc).

    ``shard_dims`` has one tensor dim per mesh dim. ``recv`` / ``send`` are
    ``[(lo, hi), ...]`` per shard dim (a single pair is accepted for one dim);
    ``periodic`` is a bool or one bool per shard dim. Differentiable; backward
    is the adjoint. ``memory_format`` is the padded result's layout (``torch.channels_last``
    suits a following convolution; the input gradient keeps ``x``'s layout). Widths this rank cannot supply raise ``ValueError`` here;
    layers validate the whole layout on every rank before calling.
    """
    dims = tuple(d % x.dim() for d in shard_dims)
    if len(dims) != mesh.ndim:
        raise ValueError(f"shard_dims needs one tensor dim per mesh dim ({mesh.ndim}), got {tuple(shard_dims)}")
    recv, send = _pairs("recv", recv, len(dims)), _pairs("send", send, len(dims))
    periodic = [bool(periodic)] * len(dims) if isinstance(periodic, bool) else [bool(p) for p in periodic]
    if len(periodic) != len(dims):
        raise ValueError(f"periodic needs one bool per shard dim ({len(dims)}), got {periodic}")
    for i, d in enumerate(dims):
        if not halo_widths_ok(x.size(d), send[i]):
            raise ValueError(
                f"halo_exchange: rank {dist.get_rank()} holds {x.size(d)} rows along dim {d} "
                f"but must send {send[i]} (lo, hi)"
            )
    for i, d in enumerate(dims):
        x = HaloExchange1d.apply(
            x, d, mesh.get_group(i), tuple(recv[i]), tuple(send[i]), bool(periodic[i]), memory_format
        )
    return x
