"""Linear layers fused with their collective, so communication overlaps compute.

Megatron's trick for column-parallel layers: in backward, the input gradient's
all-reduce is started asynchronously and the weight gradient is computed while
it is in flight.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from tplayers.comm.accounting import record_collective

__all__ = ["LinearAllReduceInputGrad", "linear_all_reduce_input_grad"]


class LinearAllReduceInputGrad(torch.autograd.Function):
    """forward: ``y = x W^T + b`` on a replicated ``x`` (no communication) /
    backward: the input gradient ``dy W`` is all-reduced (sum) asynchronously
    while the weight and bias gradients are computed; waited before returning.

    Shapes: ``x (..., in)``, ``W (out_local, in)``, ``b (out_local,)``,
    ``y (..., out_local)``. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        work = None
        if need_x:
            grad_x = (grad_out @ weight).contiguous()  # (..., in) partial sum over this rank's outputs
            size = dist.get_world_size(ctx.group)
            if size > 1:
                record_collective("all_reduce", grad_x.numel() * grad_x.element_size(), size, "linear.bwd")
                work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        if need_w or need_b:
            tokens = math.prod(grad_out.shape[:-1])  # explicit: out_local may be 0 (empty shard)
            g2 = grad_out.reshape(tokens, grad_out.shape[-1])  # (tokens, out_local)
            if need_w:
                grad_w = g2.t() @ x.reshape(tokens, x.shape[-1])  # (out_local, in)
            if need_b and ctx.has_bias:
                grad_b = g2.sum(0)
        if work is not None:
            work.wait()
        return grad_x, grad_w, grad_b, None


def linear_all_reduce_input_grad(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: dist.ProcessGroup
) -> torch.Tensor:
    """``F.linear`` whose backward all-reduces the input gradient, overlapped with the weight gradient."""
    return LinearAllReduceInputGrad.apply(x, weight, bias, group)
