"""``need_weights=True`` for multi-head attention over sharded tokens: the weights are wanted.

The averaged (or per-head) attention weights of this rank's queries are ``(N, [heads,] Lq_local,
Lk_global)``: rows of the full score matrix, which the caller asked for. So this path gathers
the keys and values (:class:`GatherTokens`: all-gather forward, reduce-scatter of the partial
gradients backward) and runs exactly torch's ``need_weights`` computation on this rank's rows
(``baddbmm`` with the mask, ``softmax``, dropout = the serial mask's rows, ``bmm``), so outputs,
weights and every gradient equal the serial call's. Memory is that of the weights it returns.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from tplayers.attention.plan import Cols, gather_padded, gather_rows, topology
from tplayers.attention.ring import _reduce_scatter_blocks
from tplayers.attention.sdpa import _default_positions, _dropout_rows, _key_cols
from tplayers.mesh import resolve_mesh

__all__ = ["GatherTokens", "attention_with_weights"]


class GatherTokens(torch.autograd.Function):
    """forward: all-gather every rank's tokens (dim -2) into the global order given by ``cols`` /
    backward: each rank's columns of the (partial) gradient, reduce-scattered back to their owner."""

    @staticmethod
    def forward(ctx, x, cols: List[Cols], sizes: List[int], topo):
        blocks = gather_padded(x, sizes, topo, "attention.weights.gather.fwd")  # (n, ..., Lmax, E)
        total = sum(sizes)
        out = x.new_empty(x.shape[:-2] + (total, x.size(-1)))
        for b, c in enumerate(cols):
            if sizes[b]:
                out.index_copy_(-2, c.indices(x.device), blocks[b].narrow(-2, 0, sizes[b]))
        ctx.cols, ctx.sizes, ctx.topo, ctx.lmax = cols, sizes, topo, blocks.size(-2)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        blocks = grad.new_zeros((len(ctx.sizes),) + grad.shape[:-2] + (ctx.lmax, grad.size(-1)))
        for b, c in enumerate(ctx.cols):
            if ctx.sizes[b]:
                blocks[b].narrow(-2, 0, ctx.sizes[b]).copy_(grad.index_select(-2, c.indices(grad.device)))
        mine = _reduce_scatter_blocks(blocks, ctx.topo)
        return mine.narrow(-2, 0, ctx.sizes[ctx.topo.index]).contiguous(), None, None, None


def attention_with_weights(
    q,
    k,
    v,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    average: bool,
    *,
    mesh: Optional[DeviceMesh],
    kv_sharded: bool,
    q_positions,
    kv_positions,
):
    """torch's ``need_weights`` path on this rank's rows. ``q`` ``(N, H, Lq_local, hd)``, ``k``/``v``
    ``(N, H, Lk_local | Lk, hd)``, ``mask`` additive ``(N*H | 1, Lq_local | 1, Lk_global)`` or None.
    Returns ``(out (N, H, Lq_local, hd), weights (N, [H,] Lq_local, Lk_global))``."""
    mesh = resolve_mesh(mesh, tuple(range(1, 9)))
    topo = topology(mesh)
    n, heads, lq, hd = q.shape
    need_q_sizes = dropout_p > 0 and q_positions is None
    if topo.size > 1 and (kv_sharded or dropout_p > 0):
        mask_cols = -1 if mask is None else mask.size(-1)
        rows = gather_rows(
            [q.size(-2), k.size(-2), kv_positions is not None, mask_cols], topo, "attention.weights.meta"
        )
        if len({r[2] for r in rows}) != 1:
            raise ValueError("multi_head_attention_forward: ranks disagree on kv_positions given or not")
        q_sizes, k_sizes = [r[0] for r in rows], [r[1] for r in rows]
        lk_global = sum(k_sizes) if kv_sharded else k.size(-2)
        if any(r[3] not in (-1, lk_global) for r in rows):  # every rank sees every mask
            raise ValueError(
                f"multi_head_attention_forward: attn_mask/key_padding_mask must span the global keys "
                f"({lk_global}), got last dims {[r[3] for r in rows]} on the ranks"
            )
    else:
        q_sizes, k_sizes = [lq], [k.size(-2)]
    if kv_sharded and topo.size > 1:
        cols = _key_cols(k_sizes, kv_positions, topo, True)
        k = GatherTokens.apply(k, cols, k_sizes, topo)  # (N, H, Lk_global, hd)
        v = GatherTokens.apply(v, cols, k_sizes, topo)
    lk = k.size(-2)
    if mask is not None and mask.size(-1) != lk:
        raise ValueError(
            f"multi_head_attention_forward: attn_mask/key_padding_mask must span the global keys "
            f"({lk}), got {tuple(mask.shape)}"
        )
    qf, kf, vf = (t.reshape(n * heads, t.size(-2), hd) for t in (q, k, v))
    q_scaled = qf * math.sqrt(1.0 / float(hd))
    if mask is not None:
        w = torch.baddbmm(mask, q_scaled, kf.transpose(-2, -1))  # (N*H, Lq_local, Lk)
    else:
        w = torch.bmm(q_scaled, kf.transpose(-2, -1))
    w = torch.softmax(w, dim=-1)
    if dropout_p > 0.0:
        if need_q_sizes and topo.size > 1:
            q_pos = _default_positions(q_sizes, topo.index, lq)
        else:
            q_pos = q_positions if q_positions is not None else torch.arange(lq)
        keep, scale = _dropout_rows(w, (n * heads,), q_pos, sum(q_sizes), lk, dropout_p)
        w = w * keep * scale
    out = torch.bmm(w, vf).view(n, heads, lq, hd)
    weights = w.view(n, heads, lq, lk)
    return out, (weights.mean(dim=1) if average else weights)
