"""Linear layers fused with their collective, so communication overlaps compute.

Megatron's trick for column-parallel layers: in backward, the input gradient's
all-reduce (reduce-scatter under sequence parallelism) is started asynchronously
and the weight gradient is computed while it is in flight. Row-parallel layers
fold the replicated bias into rank 0's matmul before the reduction.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import all_gather_along_dim, ensure_collective_ops
from tplayers.comm.sequence import reduce_scatter_along_dim
from tplayers.sharding import shard_sizes

__all__ = [
    "LinearAllReduceInputGrad",
    "linear_all_reduce_input_grad",
    "LinearAllReduceOutput",
    "linear_all_reduce_output",
    "AllGatherLinear",
    "all_gather_linear",
    "LinearReduceScatterOutput",
    "linear_reduce_scatter_output",
]


def _all_reduce_as(t: torch.Tensor, group, reduce_dtype, tag: str, async_op: bool = False):
    """All-reduce (sum) contiguous ``t`` in place, in ``reduce_dtype`` when given (e.g. fp32 for a
    bf16 ``t`` under autocast: one rounding after the sum instead of one per addition).
    Returns ``(result, work)``: with ``async_op`` and no cast, ``work`` is pending and ``result``
    (``t`` itself) is valid after ``work.wait()``; a cast buffer is reduced synchronously (``work`` None)."""
    size = dist.get_world_size(group)
    if size == 1:
        return t, None
    if torch.compiler.is_compiling():  # the registered op (see tplayers.comm.collectives), out of place
        ensure_collective_ops()
        wide = t if reduce_dtype is None else t.to(reduce_dtype)
        return torch.ops.tplayers.all_reduce(wide, group.group_name, tag).to(t.dtype), None
    if reduce_dtype is not None and reduce_dtype != t.dtype:
        wide = t.to(reduce_dtype)
        record_collective("all_reduce", wide.numel() * wide.element_size(), size, tag)
        dist.all_reduce(wide, group=group)
        return wide.to(t.dtype), None
    record_collective("all_reduce", t.numel() * t.element_size(), size, tag)
    work = dist.all_reduce(t, group=group, async_op=async_op)
    return t, work


def linear_param_grads(grad_out: torch.Tensor, x: torch.Tensor, need_w: bool, need_b: bool):
    """``(grad_weight, grad_bias)`` of ``F.linear(x, W, b)`` from ``grad_out`` (``None`` where not needed).

    Tokens are flattened explicitly (``out`` may be 0 on an empty shard): ``grad_weight`` is
    ``grad_out^T @ x`` over all tokens, ``(out, in)``; ``grad_bias`` the sum over tokens.
    """
    if not (need_w or need_b):
        return None, None
    tokens = math.prod(grad_out.shape[:-1])
    g2 = grad_out.reshape(tokens, grad_out.shape[-1])  # (tokens, out)
    grad_w = g2.t() @ x.reshape(tokens, x.shape[-1]) if need_w else None
    return grad_w, (g2.sum(0) if need_b else None)


class LinearAllReduceInputGrad(torch.autograd.Function):
    """forward: ``y = x W^T + b`` on a replicated ``x`` (no communication) /
    backward: the input gradient ``dy W`` is all-reduced (sum) asynchronously
    while the weight and bias gradients are computed; waited before returning.

    Shapes: ``x (..., in)``, ``W (out_local, in)``, ``b (out_local,)``,
    ``y (..., out_local)``. ``reduce_dtype`` (optional): all-reduce in that dtype (then
    synchronously). Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, reduce_dtype=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.reduce_dtype = group, bias is not None, reduce_dtype
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = None
        work = None
        if need_x:
            grad_x = (grad_out @ weight).contiguous()  # (..., in) partial sum over this rank's outputs
            grad_x, work = _all_reduce_as(grad_x, ctx.group, ctx.reduce_dtype, "linear.bwd", async_op=True)
        grad_w, grad_b = linear_param_grads(grad_out, x, need_w, need_b and ctx.has_bias)  # (out_local, in)
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None, None


def linear_all_reduce_input_grad(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: dist.ProcessGroup,
    reduce_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``F.linear`` whose backward all-reduces the input gradient, overlapped with the weight gradient."""
    return LinearAllReduceInputGrad.apply(x, weight, bias, group, reduce_dtype)


class LinearAllReduceOutput(torch.autograd.Function):
    """forward: ``y = sum_ranks(x_r W_r^T) + b``: each rank's partial product, the replicated
    bias folded into rank 0's matmul (``addmm``, no extra pass over ``y``), then one in-place
    all-reduce (sum) / backward: identity through the all-reduce, then this rank's linear
    backward; every rank gets the full bias gradient (``dy`` is replicated).

    Shapes: ``x (..., in_local)``, ``W (out, in_local)``, ``b (out,)``, ``y (..., out)``
    replicated. ``reduce_dtype`` (optional): all-reduce in that dtype. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, reduce_dtype=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        first = dist.get_rank(group) == 0
        y = torch.nn.functional.linear(x, weight, bias if first else None).contiguous()  # (..., out) partial
        return _all_reduce_as(y, group, reduce_dtype, "linear.fwd")[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_out @ weight if need_x else None  # (..., in_local)
        grad_w, grad_b = linear_param_grads(grad_out, x, need_w, need_b and ctx.has_bias)  # (out, in_local)
        return grad_x, grad_w, grad_b, None, None


def linear_all_reduce_output(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: dist.ProcessGroup,
    reduce_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Row-parallel ``F.linear`` + all-reduce of the output, the bias added once (see :class:`LinearAllReduceOutput`)."""
    return LinearAllReduceOutput.apply(x, weight, bias, group, reduce_dtype)


class AllGatherLinear(torch.autograd.Function):
    """Sequence-parallel column linear. forward: all-gather the sequence shards of ``x`` along
    ``dim`` (rank ``r`` holds ``sizes[r]``), then ``y = x W^T + b`` / backward: the input
    gradient ``dy W`` is reduce-scattered (sum) back to this rank's shard asynchronously while
    the weight and bias gradients are computed; waited before returning.

    Shapes: ``x (..., s_local, ..., in)``, ``W (out_local, in)``, ``y (..., s, ..., out_local)``.
    Saves the gathered input for the weight gradient. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dim, sizes, group):
        # (..., s, ..., in), made contiguous once (the gather's dim-0 layout is a strided view)
        full = all_gather_along_dim(x, dim, sizes, group, "sp.linear.fwd").contiguous()
        ctx.save_for_backward(full, weight)
        ctx.dim, ctx.sizes, ctx.group, ctx.has_bias = dim % x.dim(), list(sizes), group, bias is not None
        return torch.nn.functional.linear(full, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        full, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = None
        pending = None
        if need_x:  # (..., s, ..., in) partial sums over this rank's outputs -> this rank's tokens, summed
            pending = reduce_scatter_along_dim(
                grad_out @ weight, ctx.dim, ctx.sizes, ctx.group, "sp.linear.bwd", async_op=True
            )
        grad_w, grad_b = linear_param_grads(grad_out, full, need_w, need_b and ctx.has_bias)  # (out_local, in)
        if pending is not None:
            grad_x = pending.wait()
        return grad_x, grad_w, grad_b, None, None, None


def all_gather_linear(x, weight, bias, dim: int, sizes, group: dist.ProcessGroup) -> torch.Tensor:
    """``F.linear`` on the all-gathered sequence (see :class:`AllGatherLinear`)."""
    return AllGatherLinear.apply(x, weight, bias, dim, list(sizes), group)


class LinearReduceScatterOutput(torch.autograd.Function):
    """Sequence-parallel row linear. forward: each rank's partial ``x_r W_r^T`` (the replicated
    bias folded into rank 0's), reduce-scattered (sum) along the sequence ``dim`` into balanced
    shards / backward: all-gather the output gradient's shards along ``dim``, then this rank's
    linear backward; every rank gets the full bias gradient (the gathered ``dy`` covers every token).

    Shapes: ``x (..., s, ..., in_local)``, ``W (out, in_local)``, ``y (..., s_local, ..., out)``.
    Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dim, group):
        ctx.save_for_backward(x, weight)
        dim = dim % x.dim()
        sizes = shard_sizes(x.size(dim), dist.get_world_size(group))
        ctx.dim, ctx.sizes, ctx.group, ctx.has_bias = dim, sizes, group, bias is not None
        first = dist.get_rank(group) == 0
        partial = torch.nn.functional.linear(x, weight, bias if first else None)  # (..., s, ..., out)
        return reduce_scatter_along_dim(partial, dim, sizes, group, "sp.linear.fwd")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = all_gather_along_dim(grad_out.contiguous(), ctx.dim, ctx.sizes, ctx.group, "sp.linear.bwd").contiguous()
        grad_x = g @ weight if need_x else None  # (..., s, ..., in_local)
        grad_w, grad_b = linear_param_grads(g, x, need_w, need_b and ctx.has_bias)  # (out, in_local)
        return grad_x, grad_w, grad_b, None, None


def linear_reduce_scatter_output(x, weight, bias, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Row-parallel ``F.linear`` reduce-scattered along the sequence (see :class:`LinearReduceScatterOutput`)."""
    return LinearReduceScatterOutput.apply(x, weight, bias, dim, group)
