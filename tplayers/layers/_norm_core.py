"""One statistics core for batch, group and instance norms over a domain-sharded input.

Every norm of the family normalises ``x`` viewed as ``(N, G, C // G, S)`` (``S``: the flattened
local spatial positions) over a set of dims:

* batch norm: ``G = C``, statistics per channel over ``(N, S)`` -> stat shape ``(C,)``;
* group norm: statistics per ``(n, g)`` over ``(C // G, S)`` -> stat shape ``(N, G)``;
* instance norm: group norm with ``G = C``.

Forward (:class:`DomainNormFn`): each rank computes its count, mean and centred sum of squares
(M2, ``torch.var_mean``: Welford) in fp32 (fp64 for fp64 input); one all-gather per mesh dim brings every rank's
triple and the ranks merge them with Chan's formula in fp64 (the same order on every rank, so
the result is bitwise replicated). Never E[x^2] - E[x]^2.
Backward: one all-reduce per mesh dim of the per-statistic sums of ``g = dy * weight`` and
``g * xhat`` together with the weight and bias gradients (replicated parameters applied to
sharded data, so summed: docs/design.md (the region convention)), then ``dx = rstd * (g - mean(g) - xhat *
mean(g * xhat))``.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from tplayers.comm.collectives import all_gather_along_dim, all_reduce_sum

__all__ = ["DomainNormFn", "merge_moments", "update_running"]


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean, var, factor: float) -> None:
    """``running = (1 - factor) * running + factor * batch``, in place, in the buffers' dtype (the nn
    norms' update; ``var`` unbiased)."""
    with torch.no_grad():
        running_mean.mul_(1 - factor).add_(mean.reshape(-1).to(running_mean.dtype), alpha=factor)
        running_var.mul_(1 - factor).add_(var.reshape(-1).to(running_var.dtype), alpha=factor)


def _view(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c = x.shape[:2]
    return x.reshape(n, groups, c // groups, -1)


def _reduce_dims(per_channel: bool) -> Tuple[int, ...]:
    return (0, 2, 3) if per_channel else (2, 3)


def local_moments(x4: torch.Tensor, per_channel: bool) -> Tuple[float, torch.Tensor, torch.Tensor]:
    """``(count, mean, M2)`` of this rank's elements for every statistic (torch.var_mean: Welford, x4's dtype)."""
    dims = _reduce_dims(per_channel)
    count = 1
    for d in dims:  # a plain loop: torch.compile cannot trace math.prod over a generator
        count *= x4.shape[d]
    if count == 0:
        shape = [s for d, s in enumerate(x4.shape) if d not in dims]
        zero = x4.new_zeros(shape)
        return 0, zero, zero.clone()
    if not per_channel and x4.dtype in (torch.float32, torch.float64) and x4.is_contiguous():
        # group statistics: PyTorch's fused group-norm kernel (vectorised, stable moments) is
        # faster than var_mean (measured); with eps=0 its rstd is var**-0.5 exactly (var 0 -> inf -> 0)
        n, g = x4.shape[:2]
        _, mean, rstd = torch.native_group_norm(
            x4.reshape(n, g * x4.shape[2], -1), None, None, n, g * x4.shape[2], x4.shape[3], g, 0.0
        )
        return count, mean, rstd.pow(-2) * count
    var, mean = torch.var_mean(x4, dims, correction=0)  # one stable (Welford) pass
    return count, mean, var * count


def merge_moments(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor):
    """Chan's parallel merge of per-part moments along dim 0 (fp64): ``(count, mean, M2)``."""
    total = counts.sum(0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    mean = (counts * means).sum(0) / safe
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return total, mean, m2


def global_moments(x4: torch.Tensor, per_channel: bool, groups: List[dist.ProcessGroup]):
    """``(count, mean, M2)`` over the whole domain: one all-gather per mesh dim, Chan merge in fp64."""
    count, mean, m2 = local_moments(x4, per_channel)
    triple = torch.stack([torch.full_like(mean, float(count)), mean, m2]).to(torch.float64)
    for group in reversed(groups):  # last mesh dim first, as the layout tables do
        world = dist.get_world_size(group)
        if world == 1:
            continue
        parts = all_gather_along_dim(triple.unsqueeze(0).contiguous(), 0, [1] * world, group, "norm_stats.fwd")
        triple = torch.stack(merge_moments(parts[:, 0], parts[:, 1], parts[:, 2]))
    return triple[0], triple[1], triple[2]


def _rows(t: torch.Tensor, per) -> torch.Tensor:
    """``t`` broadcast to ``per`` as a dense flat vector. Never a view of the broadcast: with one row per
    statistic (one channel, batch norm) ``expand(...).reshape(-1)`` is a stride-0 view, and the fused
    kernels below read their per-row arguments as dense (a 1-channel batch norm's backward summed
    against the first row's mean only: issue 33)."""
    return t.expand(per).contiguous().reshape(-1)


def affine_rows(x4: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, shape=None) -> torch.Tensor:
    """``x4 * scale + shift`` as a new base tensor (of ``shape``, default ``x4``'s; never a view, so a caller
    may modify it in place); ``x4`` is ``(N, G, Cg, L)``, ``scale`` and ``shift`` broadcast to ``(N, G, Cg, 1)``.
    One vectorised pass: an inference-mode batch norm of the ``(1, N*G*Cg, L)`` view with mean 0,
    variance 1 and eps 0 (measured faster than a broadcasting ``addcmul``)."""
    per = x4.shape[:3] + (1,)
    rows = x4.shape[0] * x4.shape[1] * x4.shape[2]
    zeros = x4.new_zeros(rows)
    y = torch.empty(x4.shape if shape is None else shape, dtype=x4.dtype, device=x4.device)
    torch.ops.aten.native_batch_norm.out(
        x4.reshape(1, rows, -1),
        _rows(scale, per),
        _rows(shift, per),
        zeros,
        torch.ones_like(zeros),
        False,
        0.0,
        0.0,
        out=y.view(1, rows, -1),
        save_mean=x4.new_empty(0),
        save_invstd=x4.new_empty(0),
    )
    return y


def dy_sums(d4: torch.Tensor, x4: torch.Tensor, mean_a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum(dy), sum(dy * (x - mean)))`` over the last dim of the contiguous ``(N, G, Cg, L)`` views, per
    ``(N, G, Cg)``: the per-channel sums of PyTorch's fused group-norm backward on the ``(1, N*G*Cg, L)``
    view (one channel per group, rstd 1), one pass and no temporary (instead of a product's temporary
    and a second pass to sum it)."""
    n, g, cg, length = x4.shape
    rows = n * g * cg
    mean = _rows(mean_a, (n, g, cg, 1)).view(1, rows)
    one = x4.new_ones(rows)
    _, sdyx, sdy = torch.ops.aten.native_group_norm_backward(
        d4.reshape(1, rows, length),
        x4.reshape(1, rows, length),
        mean,
        one.view(1, rows),
        one,
        1,
        rows,
        length,
        rows,
        [False, True, True],
    )
    return sdy.view(n, g, cg), sdyx.view(n, g, cg)


class DomainNormFn(torch.autograd.Function):
    """forward: normalise with statistics over the whole domain (one all-gather of per-rank
    (count, mean, M2) per mesh dim, Chan merge) and apply the affine / backward: one all-reduce
    per mesh dim of the statistic sums and the affine-parameter gradients.

    Returns ``(y, mean, unbiased var, count)``; the last three (fp64, detached) feed running stats.
    ``on_stats(mean, unbiased var, count)``, if given, runs inside forward, before autograd packs the
    saved tensors: a non-reentrant activation checkpoint stops its recomputation at the last packed
    tensor it needs, and torch's own norms update their running stats before that point, so updates
    made after ``apply`` returned would be skipped in the recomputation (the serial model makes them).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, num_groups: int, per_channel: bool, eps: float, groups, on_stats=None):
        acc = acc_dtype(x)
        x4 = _view(x, num_groups).to(acc)
        count, mean, m2 = global_moments(x4, per_channel, groups)
        var = m2 / count.clamp(min=1)
        rstd = (var + eps).rsqrt().to(acc)
        shape = (1, -1, 1, 1) if per_channel else (x.shape[0], num_groups, 1, 1)
        mean_a, rstd_a = mean.to(acc).reshape(shape), rstd.reshape(shape)
        cg = x.shape[1] // num_groups
        scale = rstd_a if weight is None else rstd_a * weight.to(acc).reshape(1, num_groups, cg, 1)
        shift = -mean_a * scale
        if bias is not None:
            shift = shift + bias.to(acc).reshape(1, num_groups, cg, 1)
        if acc == x.dtype:  # one pass into a base tensor (never a view, so callers may modify it in place)
            y = affine_rows(x4, scale, shift, x.shape)
        else:
            y = torch.addcmul(shift, x4, scale)
        count_a = count.to(acc).clamp(min=1).reshape(shape)
        ctx.save_for_backward(x, weight, mean_a, rstd_a, count_a)
        ctx.info = (num_groups, per_channel, groups, bias is not None)
        unbiased = m2 / (count - 1).clamp(min=1)
        ctx.mark_non_differentiable(mean, unbiased, count)
        if on_stats is not None:
            with torch.no_grad():
                on_stats(mean, unbiased, count)
        return (
            (y if y.dtype == x.dtype and y.shape == x.shape else y.reshape(x.shape).to(x.dtype)),
            mean,
            unbiased,
            count,
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _mean, _var, _count):
        x, weight, mean_a, rstd_a, count_a = ctx.saved_tensors
        num_groups, per_channel, groups, has_bias = ctx.info
        acc = mean_a.dtype
        c = x.shape[1]
        cg = c // num_groups
        d4 = _view(dy, num_groups).to(acc)
        x4 = _view(x, num_groups).to(acc)
        fused = acc == x.dtype and x4.is_contiguous()
        if fused:  # one pass over dy and x, no temporary: sum(dy * x) - mean * sum(dy), as nn.GroupNorm's backward
            d4 = d4.contiguous()  # (a broadcast gradient, e.g. of a sum, has stride 0)
            sdy, sdyx = dy_sums(d4, x4, mean_a)
        else:  # centred: no cancellation in the sums
            xc = x4 - mean_a
            sdy, sdyx = d4.sum(3), torch.linalg.vecdot(d4, xc)  # per (n, group, channel-in-group)
        rstd3 = rstd_a[..., 0]
        w3 = 1.0 if weight is None else weight.to(acc).reshape(1, num_groups, cg)
        rd = (0, 2) if per_channel else (2,)
        pieces = [(w3 * sdy).sum(rd).reshape(-1), (w3 * rstd3 * sdyx).sum(rd).reshape(-1)]
        stat = pieces[0].numel()
        if weight is not None:
            pieces.append((rstd3 * sdyx).sum(0).reshape(-1))
        if has_bias:
            pieces.append(sdy.sum(0).reshape(-1))
        flat = torch.cat(pieces)
        for group in groups:  # one fused all-reduce per mesh dim
            flat = all_reduce_sum(flat, group, "norm_stats.bwd")
        mg = flat[:stat].reshape(mean_a.shape) / count_a
        mgx = flat[stat : 2 * stat].reshape(mean_a.shape) / count_a
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w: a * dy + k * (x - mean) - rstd * mg
        a = rstd_a if weight is None else rstd_a * weight.to(acc).reshape(1, num_groups, cg, 1)
        k = -rstd_a.square() * mgx
        if fused:  # k * x + (-rstd * mg - k * mean) in one pass into a new tensor, then + a * dy in place
            dx = affine_rows(x4, k, -rstd_a * mg - k * mean_a)
            dx.addcmul_(d4, a)
        else:  # two fused passes written over xc (a fresh tensor of this backward's own)
            dx = torch.addcmul(-rstd_a * mg, xc, k, out=xc).addcmul_(d4, a)
        dx = dx.reshape(x.shape).to(x.dtype)
        offset = 2 * stat
        dw = db = None
        if weight is not None:
            dw = flat[offset : offset + c].to(weight.dtype)
            offset += c
        if has_bias:
            db = flat[offset : offset + c].to(weight.dtype if weight is not None else x.dtype)
        return dx, dw, db, None, None, None, None, None
