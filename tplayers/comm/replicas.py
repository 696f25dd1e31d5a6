"""Gradients of rows replicated over groups of ranks (GQA key/value heads), summed over their replicas.

When a block of a column-parallel weight has fewer heads than ranks, several
ranks hold the same head (docs/design.md (tensor-parallel linears)). Each replica sees only the gradient
from its own query heads; the serial gradient is the sum over the replicas.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tplayers.comm.collectives import all_reduce_sum

__all__ = ["SumReplicaGrads", "sum_replica_grads"]


class SumReplicaGrads(torch.autograd.Function):
    """forward: identity on ``weight`` (and ``bias``) / backward: the gradient rows of the
    replicated blocks are summed over the ranks holding them, with ONE all-reduce (sum)
    over the whole group of a buffer laid out like the replicated blocks of the serial weight.

    ``slots``: ``(local_row, rows, buffer_row)`` for each replicated range this rank holds;
    ``buffer_rows``: total rows of the replicated blocks (the same on every rank). A rank
    adds its rows at their serial position, so ranks holding the same range sum it and
    disjoint ranges pass through unchanged. Weight gradient ``(rows_local, in)`` and bias
    gradient ``(rows_local,)`` travel in the same buffer.
    """

    @staticmethod
    def forward(ctx, weight, bias, slots, buffer_rows, group):
        ctx.slots, ctx.buffer_rows, ctx.group = slots, buffer_rows, group
        ctx.has_bias = bias is not None
        out_w = weight.view_as(weight)
        return (out_w, bias.view_as(bias)) if bias is not None else (out_w, None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_w, grad_b):
        cols = grad_w.shape[1] + (1 if ctx.has_bias else 0)
        buf = grad_w.new_zeros((ctx.buffer_rows, cols))  # (replicated serial rows, in [+ 1 for bias])
        for local, rows, at in ctx.slots:
            buf[at : at + rows, : grad_w.shape[1]] = grad_w[local : local + rows]
            if ctx.has_bias and grad_b is not None:
                buf[at : at + rows, -1] = grad_b[local : local + rows]
        buf = all_reduce_sum(buf, ctx.group, "replica_grads.bwd")
        grad_w = grad_w.clone()
        grad_b = grad_b.clone() if (ctx.has_bias and grad_b is not None) else None
        for local, rows, at in ctx.slots:
            grad_w[local : local + rows] = buf[at : at + rows, : grad_w.shape[1]]
            if grad_b is not None:
                grad_b[local : local + rows] = buf[at : at + rows, -1]
        return grad_w, grad_b, None, None, None


def sum_replica_grads(
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    slots: Sequence[Tuple[int, int, int]],
    buffer_rows: int,
    group: dist.ProcessGroup,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Identity forward on ``(weight, bias)``; backward sums replicated rows (see :class:`SumReplicaGrads`)."""
    if dist.get_world_size(group) == 1 or buffer_rows == 0:
        return weight, bias
    return SumReplicaGrads.apply(weight, bias, tuple(slots), buffer_rows, group)
