"""Sequence parallelism's collectives: all-gather along the sequence dim and its adjoint, reduce-scatter.

Between tensor-parallel regions, sequence parallelism (Megatron-LM, Korthikanti et al. 2022)
keeps activations sharded along the sequence dim instead of replicated: a region is entered
by an all-gather (backward: reduce-scatter of the gradient) and left by a reduce-scatter of
the partial sums (backward: all-gather of the gradient). Together they move the same bytes as
the one all-reduce they replace, and norms/dropout in between work on ``1 / world`` of the
tokens. Uneven sequence lengths follow :func:`tplayers.shard_sizes` (padded on the wire).
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import all_gather_along_dim, exchange_sizes
from tplayers.sharding import shard_sizes

__all__ = [
    "reduce_scatter_along_dim",
    "ReduceScatterPending",
    "sequence_sizes",
    "GatherFromSequenceRegion",
    "ReduceScatterToSequenceRegion",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
]


class ReduceScatterPending:
    """A reduce-scatter in flight (``async_op=True``): :meth:`wait` returns this rank's slice."""

    def __init__(self, work, out: torch.Tensor, length: int, dim: int) -> None:
        self._work, self._out, self._length, self._dim = work, out, length, dim

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._out[: self._length].movedim(0, self._dim).contiguous()  # back to the caller's layout


def reduce_scatter_along_dim(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup, tag: str = "", *, async_op: bool = False
):
    """Sum ``x`` (every rank's full-length partial along ``dim``) over ``group`` and keep
    rank ``r``'s ``sizes[r]`` rows of the sum. Uneven sizes are padded to the largest on the
    wire. Returns the slice, or a :class:`ReduceScatterPending` with ``async_op=True``.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    dim = dim % x.dim()
    if x.size(dim) != sum(sizes):
        raise ValueError(
            f"reduce_scatter_along_dim: dim {dim} has {x.size(dim)} rows, the layout {list(sizes)} sums to {sum(sizes)}"
        )
    moved = x.movedim(dim, 0)  # (n, ...): each rank's block contiguous
    largest = max(sizes)
    if all(s == largest for s in sizes):
        send = moved.contiguous()
    else:
        send = moved.new_zeros((world * largest,) + tuple(moved.shape[1:]))
        offset = 0
        for r, s in enumerate(sizes):
            send[r * largest : r * largest + s] = moved[offset : offset + s]
            offset += s
    out = moved.new_empty((largest,) + tuple(moved.shape[1:]))
    work = None
    if world == 1:
        out.copy_(send)
    elif largest > 0:
        record_collective("reduce_scatter", send.numel() * send.element_size(), world, tag)
        work = dist.reduce_scatter_tensor(out, send, group=group, async_op=async_op)
    pending = ReduceScatterPending(work if async_op else None, out, int(sizes[me]), dim)
    return pending if async_op else pending.wait()


def sequence_sizes(local: int, group: dist.ProcessGroup, what: str) -> List[int]:
    """Every rank's sequence length, exchanged (one all-gather of one integer per rank), checked
    to be the balanced :func:`~tplayers.shard_sizes` layout; ``ValueError`` on every rank if not."""
    sizes = exchange_sizes(local, group)
    expected = shard_sizes(sum(sizes), len(sizes))
    if sizes != expected:
        raise ValueError(
            f"{what}: the sequence must be sharded as shard_sizes({sum(sizes)}, {len(sizes)}) = "
            f"{expected}, got local lengths {sizes}"
        )
    return sizes


class GatherFromSequenceRegion(torch.autograd.Function):
    """forward: all-gather the sequence shards along ``dim`` (rank ``r`` holds ``sizes[r]``) /
    backward: reduce-scatter (sum) the full-length gradient back to this rank's shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim % x.dim(), list(sizes), group
        return all_gather_along_dim(x, dim, sizes, group, "sp.gather.fwd")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_along_dim(grad, ctx.dim, ctx.sizes, ctx.group, "sp.gather.bwd"), None, None, None


class ReduceScatterToSequenceRegion(torch.autograd.Function):
    """forward: reduce-scatter (sum) partial results along ``dim`` into balanced sequence shards /
    backward: all-gather the gradient shards along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        dim = dim % x.dim()
        sizes = shard_sizes(x.size(dim), dist.get_world_size(group))
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return reduce_scatter_along_dim(x, dim, sizes, group, "sp.scatter.fwd")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return all_gather_along_dim(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group, "sp.scatter.bwd"), None, None


def gather_from_sequence_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather forward, reduce-scatter backward (see :class:`GatherFromSequenceRegion`);
    the per-rank lengths are exchanged first (:func:`sequence_sizes`)."""
    if dist.get_world_size(group) == 1:
        return x
    sizes = sequence_sizes(x.size(dim), group, "gather_from_sequence_region")
    return GatherFromSequenceRegion.apply(x, dim, sizes, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Reduce-scatter forward, all-gather backward (see :class:`ReduceScatterToSequenceRegion`)."""
    if dist.get_world_size(group) == 1:
        return x
    return ReduceScatterToSequenceRegion.apply(x, dim, group)
