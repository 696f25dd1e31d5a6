"""Autograd-paired collectives over one process group (one mesh axis).

Each is a named ``torch.autograd.Function`` whose docstring says what its
forward does and what its backward (the adjoint) does. Layers call them
visibly in ``forward``; nothing hides communication in hooks. A group of one
rank makes every collective the identity and issues nothing.

Uneven shards are first-class: a gather takes the per-rank sizes along the
gathered dim (from :func:`tplayers.shard_sizes` for layer features, or
exchanged once by :func:`exchange_sizes` for arbitrary partitions).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed.distributed_c10d import _resolve_process_group

from tplayers.comm.accounting import record_collective
from tplayers.ops.registry import OpSpec, constant_result, register
from tplayers.sharding import offsets_from_sizes, shard_range, shard_sizes

__all__ = [
    "all_reduce_sum",
    "all_gather_along_dim",
    "exchange_sizes",
    "exchange_grid_table",
    "run_p2p",
    "exchange_p2p",
    "posts_direct",
    "CopyToParallelRegion",
    "CopyManyToParallelRegion",
    "copy_many_to_parallel_region",
    "ReduceFromParallelRegion",
    "SplitAlongDim",
    "GatherAlongDim",
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "split_along_dim",
    "gather_along_dim",
    "group_by_name",
    "ensure_collective_ops",
]


# torch >= 2.13 names it all_gather_single; all_gather_into_tensor is its deprecated alias.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------
# Raw (non-autograd) collectives, each reported to comm accounting.
# ----------------------------------------------------------------------------


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup, tag: str = "") -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (``x`` must be contiguous) and return it.

    Use the returned tensor: while compiling (``torch.compile``) the sum is the
    out-of-place custom op ``tplayers::all_reduce`` and ``x`` is left unchanged.
    """
    if torch.compiler.is_compiling():
        if dist.get_world_size(group) == 1:
            return x
        ensure_collective_ops()
        return torch.ops.tplayers.all_reduce(x, group.group_name, tag)
    return _eager_all_reduce_sum(x, group, tag)


def _eager_all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup, tag: str) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    record_collective("all_reduce", _nbytes(x), size, tag)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_along_dim(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup, tag: str = ""
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; rank ``r`` holds ``sizes[r]`` rows.

    Uneven (and empty) shards are padded to the largest size on the wire and
    trimmed after, so every backend sees equal buffers. While compiling it is
    the custom op ``tplayers::all_gather``.
    """
    if torch.compiler.is_compiling() and dist.get_world_size(group) > 1:
        ensure_collective_ops()
        return torch.ops.tplayers.all_gather(x, dim % x.dim(), [int(s) for s in sizes], group.group_name, tag)
    return _eager_all_gather_along_dim(x, dim, sizes, group, tag)


def _eager_all_gather_along_dim(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup, tag: str
) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    me = dist.get_rank(group)
    if x.size(dim) != sizes[me]:
        raise ValueError(f"rank {me} holds {x.size(dim)} rows along dim {dim}, but the layout says {sizes[me]}")
    largest = max(sizes)
    if largest == 0:
        shape = list(x.shape)
        shape[dim] = 0
        return x.new_empty(shape)
    # Gather with the sharded dim outermost so each rank's block is contiguous.
    moved = x.movedim(dim, 0)
    if moved.size(0) < largest:
        pad = moved.new_zeros((largest - moved.size(0),) + tuple(moved.shape[1:]))
        moved = torch.cat([moved, pad], 0)
    moved = moved.contiguous()
    out = moved.new_empty((world * largest,) + tuple(moved.shape[1:]))
    record_collective("all_gather", _nbytes(out), world, tag)
    _all_gather_single(out, moved, group=group)
    if any(s != largest for s in sizes):
        out = torch.cat([out[r * largest : r * largest + s] for r, s in enumerate(sizes)], 0)
    return out.movedim(0, dim)


def exchange_sizes(local: int, group: dist.ProcessGroup) -> List[int]:
    """Every rank's ``local`` integer (e.g. its shard length), in rank order.

    Runs over the group's own backend with a CPU or current-device tensor; use
    it once per layout (cache the result), not on every step.
    """
    if dist.get_world_size(group) == 1:
        return [int(local)]
    return [row[0][0] for row in exchange_grid_table([local], [group], "sizes")]


def run_p2p(ops: Sequence[dist.P2POp], during=None) -> None:
    """Post ``ops`` as one batch, call ``during()`` (work to overlap) if given, then wait for all.

    Every send buffer stays referenced by its op until its wait returns, so none is reused early.
    """
    works = dist.batch_isend_irecv(list(ops)) if ops else []
    if during is not None:
        during()
    for work in works:
        work.wait()


# (tensor, peer's rank in the group, message tag): one message of :func:`exchange_p2p`
Message = Tuple[torch.Tensor, int, int]


def exchange_p2p(
    group: dist.ProcessGroup, sends: Sequence[Message], recvs: Sequence[Message], direct: bool, during=None
) -> None:
    """Post point-to-point messages with peers named by their rank *in* ``group``, call
    ``during()`` (work to overlap) if given, then wait for all of them.

    ``direct=True`` (a gloo group, see :func:`posts_direct`): the receives then the sends are
    posted on the group object itself, skipping ``torch.distributed``'s per-message argument
    checks (on the CPU, per message, about the cost of a whole small halo exchange); the
    callers' buffers are contiguous and their peers in range by construction.
    Otherwise the messages go through :func:`run_p2p` (``batch_isend_irecv``: NCCL needs the
    messages of one exchange grouped). Every buffer stays referenced until its wait returns.

    Example (2 ranks: each sends its rank to the other)::

        import torch, torch.distributed as dist, tplayers
        from tplayers.comm.collectives import exchange_p2p, posts_direct
        mesh = tplayers.init_mesh()
        group = mesh.get_group(0)
        me = dist.get_rank(group)
        mine, theirs = torch.full((3,), float(me)), torch.empty(3)
        exchange_p2p(group, [(mine, 1 - me, 0)], [(theirs, 1 - me, 0)], posts_direct(group))
        assert theirs[0] == 1 - me
    """
    if not direct:
        ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=peer) for t, peer, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=peer) for t, peer, tag in recvs]
        run_p2p(ops, during)
        return
    works = [group.recv([t], peer, tag) for t, peer, tag in recvs]
    works += [group.send([t], peer, tag) for t, peer, tag in sends]
    if during is not None:
        during()
    for work in works:
        work.wait()


def posts_direct(group: dist.ProcessGroup) -> bool:
    """Whether :func:`exchange_p2p` may post on ``group`` directly (its backend is gloo alone)."""
    return dist.get_backend(group) == "gloo"


def exchange_grid_table(
    row: Sequence[int], groups: Sequence[dist.ProcessGroup], tag: str = ""
) -> List[List[List[int]]]:
    """Every rank's small integer ``row`` (e.g. ``[ok, N, C, H, W]``), as a nested list
    ``table[c0][c1]`` indexed by mesh coordinates (``c1`` is always 0 on a 1-D mesh).

    ``groups`` are the process groups of the mesh dims (one or two). The rows are
    all-gathered along the last mesh dim, then along the first. Layers call this
    once per new local shape and cache the result, so no step pays a device-to-host sync.
    """
    device = "cuda" if dist.get_backend(groups[0]) == "nccl" else "cpu"
    table = torch.tensor([int(v) for v in row], dtype=torch.int64, device=device)
    for group in reversed(list(groups)):
        size = dist.get_world_size(group)
        out = table.new_empty((size,) + tuple(table.shape))
        if size > 1:
            record_collective("all_gather", out.numel() * out.element_size(), size, tag)
            _all_gather_single(out.view(-1), table.reshape(-1), group=group)
        else:
            out.copy_(table.unsqueeze(0))
        table = out
    if len(groups) == 1:
        table = table.unsqueeze(1)
    return table.cpu().tolist()


# ----------------------------------------------------------------------------
# Autograd-paired collectives.
# ----------------------------------------------------------------------------


class CopyToParallelRegion(torch.autograd.Function):
    """forward: identity (the input is replicated) / backward: all-reduce (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the sum as its adjoint's node, differentiable again
            return ReduceFromParallelRegion.apply(grad, ctx.group), None
        # Reduce a fresh buffer: autograd's gradient may be the caller's tensor or shared.
        return all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), ctx.group, "copy_to.bwd"), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """forward: all-reduce (sum) of partial results / backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        # Reduce a fresh buffer: ``x`` may be saved for backward by the op that made it.
        return all_reduce_sum(x.clone(memory_format=torch.contiguous_format), group, "reduce_from.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the identity as its adjoint's node (tplayers.comm.twice)
            return CopyToParallelRegion.apply(grad, ctx.group), None
        return grad, None


class SplitAlongDim(torch.autograd.Function):
    """forward: keep this rank's balanced slice of ``dim`` (no communication) /
    backward: all-gather the gradient slices along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        world, me = dist.get_world_size(group), dist.get_rank(group)
        dim = dim % x.dim()
        ctx.dim, ctx.group, ctx.full = dim, group, x.size(dim)
        start, stop = shard_range(x.size(dim), world, me)
        return x.narrow(dim, start, stop - start)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        sizes = shard_sizes(ctx.full, world)
        if torch.is_grad_enabled():  # create_graph=True: the gather as its adjoint's node, differentiable again
            return GatherAlongDim.apply(grad, ctx.dim, sizes, ctx.group), None, None
        return all_gather_along_dim(grad, ctx.dim, sizes, ctx.group, "split.bwd"), None, None


class GatherAlongDim(torch.autograd.Function):
    """forward: all-gather slices along ``dim`` (rank ``r`` holds ``sizes[r]``) /
    backward: keep this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
        dim = dim % x.dim()
        me = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, offsets_from_sizes(sizes)[me], int(sizes[me])
        ctx.sizes, ctx.group = list(sizes), group
        return all_gather_along_dim(x, dim, sizes, group, "gather.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the slice as its adjoint's node (tplayers.comm.twice)
            return _OwnSlice.apply(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


class _OwnSlice(torch.autograd.Function):
    """forward: this rank's slice (``sizes[rank]`` along ``dim``) of a replicated tensor / backward: the
    all-gather (:class:`GatherAlongDim`): the node a double backward through a gather differentiates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        me = dist.get_rank(group)
        return x.narrow(dim, offsets_from_sizes(sizes)[me], int(sizes[me]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return GatherAlongDim.apply(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None


class CopyManyToParallelRegion(torch.autograd.Function):
    """forward: identity on several tensors (replicated parameters) / backward: ONE all-reduce
    (sum) of all their gradients, flattened into one buffer."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *tensors: torch.Tensor):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = all_reduce_sum(flat, ctx.group, "copy_many.bwd")
        out, offset = [], 0
        for g in grads:
            out.append(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return (None, *out)


def copy_many_to_parallel_region(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> List[torch.Tensor]:
    """Identity forward on each tensor, one fused all-reduce of their gradients in backward."""
    if dist.get_world_size(group) == 1 or not tensors:
        return list(tensors)
    return list(CopyManyToParallelRegion.apply(group, *tensors))


def copy_to_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce backward (see :class:`CopyToParallelRegion`)."""
    if dist.get_world_size(group) == 1:
        return x
    return CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-reduce forward, identity backward (see :class:`ReduceFromParallelRegion`)."""
    if dist.get_world_size(group) == 1:
        return x
    return ReduceFromParallelRegion.apply(x, group)


def split_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Balanced local slice forward, all-gather backward (see :class:`SplitAlongDim`)."""
    if dist.get_world_size(group) == 1:
        return x
    return SplitAlongDim.apply(x, dim, group)


def gather_along_dim(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """All-gather forward, slice backward (see :class:`GatherAlongDim`).

    ``sizes`` are the per-rank lengths along ``dim``; ``None`` exchanges them
    first (one extra small collective).
    """
    if dist.get_world_size(group) == 1:
        return x
    if sizes is None:
        sizes = exchange_sizes(x.size(dim), group)
    return GatherAlongDim.apply(x, dim, list(sizes), group)


# ------------------------------------------------------------- custom ops (torch.compile)
# torch.compile cannot trace torch.distributed calls; while compiling, the raw collectives above
# call these registered ops instead: an opaque graph node whose implementation is the eager
# collective (comm accounting still counts it) and whose fake only states the output's shape.
# A process group travels as its name. Registered on first use (tplayers.ops.registry).


def group_by_name(name: str) -> dist.ProcessGroup:
    """The process group a custom op's ``group_name`` argument names."""
    return _resolve_process_group(name)


def _all_reduce_op(x: torch.Tensor, group_name: str, tag: str) -> torch.Tensor:
    return _eager_all_reduce_sum(x.clone(memory_format=torch.contiguous_format), group_by_name(group_name), tag)


def _all_reduce_fake(x, group_name, tag):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather_op(x: torch.Tensor, dim: int, sizes: List[int], group_name: str, tag: str) -> torch.Tensor:
    return _eager_all_gather_along_dim(x, dim, sizes, group_by_name(group_name), tag).contiguous()


def _all_gather_fake(x, dim, sizes, group_name, tag):
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


_OPS = (
    OpSpec("tplayers::all_reduce", _all_reduce_op, _all_reduce_fake),
    OpSpec("tplayers::all_gather", _all_gather_op, _all_gather_fake),
)


@constant_result
def ensure_collective_ops() -> bool:
    """Register ``tplayers::all_reduce`` and ``tplayers::all_gather`` unless they are registered
    already (idempotent); called right before one of them is used while compiling."""
    return register(_OPS)
