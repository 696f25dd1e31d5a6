"""Rows to their owners: the all-to-all of expert parallelism, paired with its reverse.

A mixture of experts sends each (token, expert) pair to the rank that holds the expert and the
expert's output back to the token's rank. Both moves are one ``all_to_all_single`` over the group
with uneven splits: rank ``r`` sends ``send_counts[q]`` consecutive rows (dim 0) to rank ``q`` and
receives ``recv_counts[q]`` rows from it, concatenated in rank order. The adjoint of that move is
the same all-to-all with the counts swapped, which is what :class:`AllToAllRows` runs in backward.

Several tensors with the same rows (a token's hidden state and its routing weight) move in one
autograd node: those of one dtype are packed side by side into one buffer, one all-to-all per dtype.
One node matters beyond bytes: ranks whose local graphs differ (one received no rows) still run
every collective of the backward in the same order. :class:`SplitRows` is the entry of replicated
rows into such a region (this rank's slice; backward the all-gather of the gradients, packed alike).

Example (``torchrun --nproc-per-node 2``)::

    import torch, torch.distributed as dist, tplayers
    from tplayers.comm.dispatch import all_to_all_rows
    mesh = tplayers.init_mesh()
    me = dist.get_rank()
    x = torch.full((3, 2), float(me), requires_grad=True)
    w = torch.full((3,), float(me), requires_grad=True)
    send = [1, 2] if me == 0 else [2, 1]                          # rank 0 keeps 1 row, sends 2
    recv = [1, 2] if me == 0 else [2, 1]                          # and receives rank 1's 2 rows
    y, v = all_to_all_rows([x, w], send, recv, mesh.get_group(0))
    assert y.shape == (3, 2) and v.shape == (3,)
    (y.sum() + v.sum()).backward()                                # the reverse all-to-all of ones
    torch.testing.assert_close(x.grad, torch.ones(3, 2))
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import all_gather_along_dim
from tplayers.sharding import offsets_from_sizes

__all__ = ["AllToAllRows", "SplitRows", "GatherRows", "all_to_all_rows", "split_rows", "all_to_all_rows_raw"]


def all_to_all_rows_raw(
    x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: dist.ProcessGroup, tag: str = ""
) -> torch.Tensor:
    """``x`` ``(sum(send_counts), *rest)``: block ``q`` of ``send_counts[q]`` rows to rank ``q``;
    returns ``(sum(recv_counts), *rest)``, the blocks received in rank order. No autograd.

    Records the bytes this rank sends to other ranks (its own block stays local) as ``all_to_all``.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    assert len(send_counts) == world == len(recv_counts) and x.size(0) == sum(send_counts), (
        tuple(x.shape),
        send_counts,
        recv_counts,
    )
    rest = tuple(x.shape[1:])
    row = 1
    for s in rest:
        row *= int(s)
    send = x.contiguous().reshape(-1)
    recv = x.new_empty(sum(recv_counts) * row)
    wire_send, wire_recv, k = send, recv, 1
    if send.is_complex():  # complex values travel as (real, imag) pairs of their real dtype
        wire_send, wire_recv, k = torch.view_as_real(send).reshape(-1), torch.view_as_real(recv).reshape(-1), 2
    record_collective("all_to_all", (sum(send_counts) - send_counts[me]) * row * x.element_size(), world, tag)
    dist.all_to_all_single(
        wire_recv,
        wire_send,
        [int(c) * row * k for c in recv_counts],
        [int(c) * row * k for c in send_counts],
        group=group,
    )
    return recv.view((sum(recv_counts),) + rest)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, everything else)`` (empty tensors too)."""
    width = 1
    for s in t.shape[1:]:
        width *= int(s)
    return t.reshape(t.shape[0], width)


def _packed(tensors: Sequence[torch.Tensor]) -> List[Tuple[torch.dtype, List[int]]]:
    """``[(dtype, indices of the tensors of that dtype)]`` in order of first appearance."""
    groups: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.items())


def _move(tensors, send_counts, recv_counts, group, tag) -> List[torch.Tensor]:
    """Each tensor's rows moved; one all-to-all per dtype (same-dtype tensors packed side by side)."""
    out: List[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    rows = sum(recv_counts)
    for _, idx in _packed(tensors):
        flat = [_as_rows(tensors[i]) for i in idx]
        widths = [f.shape[1] for f in flat]
        moved = all_to_all_rows_raw(
            torch.cat(flat, 1) if len(flat) > 1 else flat[0], send_counts, recv_counts, group, tag
        )
        for i, piece in zip(idx, torch.split(moved, widths, 1)):
            out[i] = piece.reshape((rows,) + tuple(tensors[i].shape[1:]))
    return out


class AllToAllRows(torch.autograd.Function):
    """forward: the rows of every tensor in blocks of ``send_counts[q]`` to rank ``q``,
    ``recv_counts[q]`` rows received from each (one all-to-all per dtype) / backward: the reverse
    all-to-all of the gradients (the counts swapped), in the same packing."""

    @staticmethod
    def forward(ctx, send_counts, recv_counts, group, tag, *tensors):
        ctx.args = (list(send_counts), list(recv_counts), group, tag)
        return tuple(_move(tensors, send_counts, recv_counts, group, f"{tag}.fwd"))

    @staticmethod
    def backward(ctx, *grads):
        send_counts, recv_counts, group, tag = ctx.args
        if torch.is_grad_enabled():  # create_graph=True: the reverse move as a node, differentiable again
            return (None, None, None, None, *AllToAllRows.apply(recv_counts, send_counts, group, tag, *grads))
        return (None, None, None, None, *_move(grads, recv_counts, send_counts, group, f"{tag}.bwd"))


def _gather(tensors, sizes, group) -> List[torch.Tensor]:
    """Each tensor's rows from every rank (``sizes[r]`` from rank ``r``); one all-gather per dtype."""
    out: List[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for _, idx in _packed(tensors):
        flat = [_as_rows(tensors[i]) for i in idx]
        widths = [f.shape[1] for f in flat]
        whole = all_gather_along_dim(torch.cat(flat, 1) if len(flat) > 1 else flat[0], 0, sizes, group, "rows.gather")
        for i, piece in zip(idx, torch.split(whole, widths, 1)):
            out[i] = piece.reshape((whole.shape[0],) + tuple(tensors[i].shape[1:]))
    return out


class SplitRows(torch.autograd.Function):
    """forward: this rank's rows ``[offset, offset + sizes[rank])`` of each replicated tensor (no
    communication) / backward: the all-gather of the gradient slices (one per dtype, packed)."""

    @staticmethod
    def forward(ctx, sizes, group, *tensors):
        me = dist.get_rank(group)
        ctx.sizes, ctx.group = list(sizes), group
        start = offsets_from_sizes(sizes)[me]
        return tuple(t.narrow(0, start, sizes[me]) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: the gather as a node, differentiable again
            return (None, None, *GatherRows.apply(ctx.sizes, ctx.group, *grads))
        return (None, None, *_gather(grads, ctx.sizes, ctx.group))


class GatherRows(torch.autograd.Function):
    """forward: every rank's rows of each tensor (``sizes[r]`` from rank ``r``), one all-gather per dtype /
    backward: this rank's slice of the (replicated) gradients: the node a double backward through
    :class:`SplitRows` differentiates."""

    @staticmethod
    def forward(ctx, sizes, group, *tensors):
        ctx.sizes, ctx.group = list(sizes), group
        return tuple(_gather(tensors, sizes, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *SplitRows.apply(ctx.sizes, ctx.group, *grads))


def all_to_all_rows(
    tensors: Sequence[torch.Tensor],
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup,
    tag: str = "rows",
) -> Tuple[torch.Tensor, ...]:
    """Autograd-paired move of the rows of ``tensors`` (:class:`AllToAllRows`); identity for a group of one."""
    if dist.get_world_size(group) == 1:
        return tuple(tensors)
    return AllToAllRows.apply(list(send_counts), list(recv_counts), group, tag, *tensors)


def split_rows(
    tensors: Sequence[torch.Tensor], sizes: Sequence[int], group: dist.ProcessGroup
) -> Tuple[torch.Tensor, ...]:
    """This rank's ``sizes[rank]`` rows of each replicated tensor (:class:`SplitRows`)."""
    if dist.get_world_size(group) == 1:
        return tuple(tensors)
    return SplitRows.apply(list(sizes), group, *tensors)
