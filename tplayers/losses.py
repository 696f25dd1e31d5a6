"""Losses on vocabulary-sharded logits: cross-entropy without gathering the logits (Megatron).

``vocab_parallel_cross_entropy(local_logits, target)`` takes the output of a
column-parallel ``lm_head`` (each rank holds a contiguous slice of the
vocabulary, any sizes) and equals ``F.cross_entropy`` on the gathered logits,
value and gradient, with ``ignore_index``, ``label_smoothing`` and every
``reduction``. The full ``(tokens, vocab)`` logits never exist on any rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import all_reduce_sum
from tplayers.mesh import resolve_mesh

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


def _all_reduce_max(t: torch.Tensor, group, tag: str) -> torch.Tensor:
    """In-place MAX over ``group`` (the SUM twin is :func:`tplayers.comm.all_reduce_sum`)."""
    size = dist.get_world_size(group)
    if size > 1:
        record_collective("all_reduce", t.numel() * t.element_size(), size, tag)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token cross-entropy from vocabulary-sharded logits with TWO all-reduces:
    (1) MAX of ``[row maxima (N,) | this rank's vocab size in its own slot (world,)]``, which
    also tells every rank its vocab offset and the total vocab; (2) SUM of
    ``[sum exp(x - max) | target logit | sum of logits]`` stacked ``(3, N)`` /
    backward: no communication; ``dlogits = g * (softmax - (1 - eps) * onehot(target) - eps / V)``
    from the softmax kept from forward, zero on ignored tokens.

    Inputs: ``logits (N, V_local)``, ``target (N,)`` (int64, replicated), returns per-token
    losses ``(N,)`` (0 where ignored) and the number of non-ignored tokens (a 0-d tensor).
    """

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, smoothing):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        work_dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(work_dtype)  # (N, V_local)
        n, v_local = x.shape
        # (1) row maxima and every rank's vocab size, one MAX all-reduce.
        buf = x.new_zeros(n + world)
        buf[:n] = x.amax(-1) if v_local else float("-inf")
        buf[n + rank] = v_local
        _all_reduce_max(buf, group, "vocab_ce.max")
        row_max = buf[:n]  # (N,)
        sizes = [int(s) for s in buf[n:].tolist()]
        vocab, start = sum(sizes), sum(sizes[:rank])
        valid = target != ignore_index  # (N,)
        bad = valid & ((target < 0) | (target >= vocab))
        if bool(bad.any()):  # target is replicated: every rank raises here, none is left waiting
            raise ValueError(f"vocab_parallel_cross_entropy: target {int(target[bad][0])} is out of range [0, {vocab})")
        # (2) sum of exp, the target's logit (on the rank that owns it) and the sum of logits.
        exp = (x - row_max.unsqueeze(-1)).exp_()  # (N, V_local)
        mine = valid & (target >= start) & (target < start + v_local)
        local_t = (target - start).masked_fill(~mine, 0)
        stats = torch.zeros(3, n, dtype=work_dtype, device=x.device)
        stats[0] = exp.sum(-1)
        if v_local:
            stats[1] = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0)
        stats[2] = x.sum(-1)
        stats = all_reduce_sum(stats, group, "vocab_ce.sum")
        lse = row_max + stats[0].log()  # (N,) log-sum-exp over the whole vocab
        nll = lse - stats[1]
        loss = nll if smoothing == 0 else (1 - smoothing) * nll + smoothing * (lse - stats[2] / vocab)
        loss = loss.masked_fill(~valid, 0)
        softmax = exp.div_(stats[0].unsqueeze(-1))  # (N, V_local), reuses exp's memory
        ctx.save_for_backward(softmax, local_t, mine, valid)
        ctx.smoothing, ctx.vocab, ctx.in_dtype = smoothing, vocab, logits.dtype
        count = valid.sum()
        ctx.mark_non_differentiable(count)
        return loss.to(logits.dtype), count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_count):
        softmax, local_t, mine, valid = ctx.saved_tensors
        # (N, V_local): softmax - (1 - eps) onehot - eps / V, scaled per token (a new tensor: the
        # saved softmax stays intact for a retained graph)
        grad = softmax - ctx.smoothing / ctx.vocab if ctx.smoothing else softmax.clone()
        if grad.shape[1]:
            rows = mine.nonzero().squeeze(-1)
            grad[rows, local_t[rows]] -= 1 - ctx.smoothing
        scale = grad_loss.to(grad.dtype).masked_fill(~valid, 0)
        grad = grad * scale.unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    mesh: Optional[DeviceMesh] = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the vocabulary-sharded logits, without gathering them.

    ``local_logits``: ``(..., V_local)``, this rank's contiguous slice of the
    vocabulary (class dim LAST, as a column-parallel ``lm_head`` returns it;
    ranks in order, any sizes). ``target``: ``(...)`` int64 class ids,
    replicated. Equals ``F.cross_entropy(full.reshape(-1, V), target.reshape(-1),
    ignore_index=..., label_smoothing=..., reduction=...)`` on the gathered
    ``full`` logits, value and gradient (``reduction="none"`` returns the
    shape of ``target``). Two all-reduces forward over ``(tokens,)`` and
    ``(3, tokens)`` buffers, none backward (see :class:`VocabParallelCrossEntropy`);
    the work is done in at least fp32.

    Args:
        local_logits: ``(..., V_local)`` floating-point logits, this rank's vocabulary slice.
        target: ``(...)`` int64 class ids, replicated (``ignore_index`` entries are skipped).
        mesh: the 1-D mesh the vocabulary is split over (``None``: :func:`tplayers.default_mesh`).
        ignore_index, label_smoothing, reduction: as ``F.cross_entropy``.

    Returns:
        The loss: a 0-d tensor (``"mean"``, ``"sum"``) or ``target``'s shape (``"none"``),
        the same on every rank.

    Raises:
        TypeError: non-floating logits or a non-int64 target.
        ValueError: a target shape other than ``local_logits.shape[:-1]``, another device, a bad
            ``reduction`` or a ``label_smoothing`` outside ``[0, 1]``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                        # the same head and data on every rank
        dense = torch.nn.Linear(16, 1000)
        head = tplayers.ColumnParallelLinear.from_module(dense, mesh=mesh)   # (..., 16) -> (..., vocab_local)
        x, target = torch.randn(4, 16), torch.randint(0, 1000, (4,))
        loss = tplayers.vocab_parallel_cross_entropy(head(x), target, mesh, label_smoothing=0.1)
        torch.testing.assert_close(loss, F.cross_entropy(dense(x), target, label_smoothing=0.1))
        loss.backward()
    """
    name = "vocab_parallel_cross_entropy"
    if not isinstance(local_logits, torch.Tensor) or not local_logits.is_floating_point():
        raise TypeError(
            f"{name}: local_logits must be a floating-point tensor, got {type(local_logits).__name__}"
            + (f" of {local_logits.dtype}" if isinstance(local_logits, torch.Tensor) else "")
        )
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        raise TypeError(
            f"{name}: target must be an int64 tensor of class ids, got "
            + (str(target.dtype) if isinstance(target, torch.Tensor) else type(target).__name__)
        )
    if local_logits.dim() < 1 or tuple(target.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(
            f"{name}: target shape must be local_logits.shape[:-1] = {tuple(local_logits.shape[:-1])}, "
            f"got {tuple(target.shape)}"
        )
    if target.device != local_logits.device:
        raise ValueError(f"{name}: target device {target.device} differs from local_logits' {local_logits.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"{name}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    group = resolve_mesh(mesh, 1).get_group(0)
    tokens = target.numel()  # explicit: the local vocab may be empty (more ranks than classes)
    losses, count = VocabParallelCrossEntropy.apply(
        local_logits.reshape(tokens, local_logits.shape[-1]),
        target.reshape(tokens),
        group,
        int(ignore_index),
        float(label_smoothing),
    )
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / count.to(losses.dtype)  # 0 / 0 = nan when every token is ignored, like F.cross_entropy
