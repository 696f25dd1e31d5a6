"""Exact attention over key blocks held by other ranks: the ring, all-gather and local Functions.

All three merge this rank's queries against one key block (one rank's keys) at a time with
:class:`~tplayers.attention.blocks.BlockForward` (online softmax) and recompute each
block's gradients in backward with :class:`~tplayers.attention.blocks.BlockBackward`
from the saved output and log-sum-exp, so no rank ever holds the full score matrix.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from tplayers.attention.blocks import BlockBackward, BlockForward
from tplayers.attention.plan import AttentionPlan, gather_padded
from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import exchange_p2p
from tplayers.comm.sequence import reduce_scatter_along_dim

__all__ = ["RingAttention", "AllGatherAttention", "LocalAttention"]


class LocalAttention(torch.autograd.Function):
    """forward: attention of this rank's queries over keys it holds whole (no communication) /
    backward: the recompute from (out, lse), no communication (dK, dV are this rank's partial
    sums: the contributions of its queries)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        merge = BlockForward(plan, q, k, v)
        merge.add(0, k, v)
        out, lse = merge.finish()
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = BlockBackward(ctx.plan, q, k, v, out, lse, dout)
        dk, dv = grads.block(0, k, v)
        return grads.grad_q(), dk, dv, None


class RingAttention(torch.autograd.Function):
    """forward: a ring of K/V blocks (n - 1 steps; each rank passes the block it holds to the
    next rank while attending to it, online-softmax merge) /
    backward: the ring again (each block's gradients recomputed from the saved out and lse), each
    block's dK/dV accumulator travelling with it and arriving back at its owner after n - 1 hops."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        topo = plan.topo
        n, me = topo.size, topo.index
        merge = BlockForward(plan, q, k, v)
        held = _pack(k, v)
        for t in range(n):
            b = (me - t) % n  # the block held at step t
            recv = None
            if t < n - 1:
                nb = (me - t - 1) % n
                recv = held.new_empty(_numel(plan.k_shape_of(nb)) + _numel(plan.v_shape_of(nb)))
            kb, vb = _unpack(held, plan.k_shape_of(b), plan.v_shape_of(b))
            _exchange_many(
                topo,
                [(held if t < n - 1 else None, recv, 0, "attention.ring.fwd")],
                lambda b=b, kb=kb, vb=vb: merge.add(b, kb, vb),
            )
            held = recv
        out, lse = merge.finish()
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        topo = plan.topo
        n, me = topo.size, topo.index
        grads = BlockBackward(plan, q, k, v, out, lse, dout)
        held, acc_out, own = _pack(k, v), None, None  # acc_out: dK|dV of last step's block
        for t in range(n):
            b = (me - t) % n
            kshape, vshape = plan.k_shape_of(b), plan.v_shape_of(b)
            kb, vb = _unpack(held, kshape, vshape)
            recv = acc_recv = None
            if t < n - 1:
                nb = (me - t - 1) % n
                recv = held.new_empty(_numel(plan.k_shape_of(nb)) + _numel(plan.v_shape_of(nb)))
            if t >= 2:  # made by the previous rank
                acc_recv = held.new_empty(_numel(kshape) + _numel(vshape))
            result = []
            # K/V for the next step and the accumulator of the previous step's block go out while
            # this block is computed; this block's accumulator (from the previous rank) comes in.
            _exchange_many(
                topo,
                [
                    (held if t < n - 1 else None, recv, 0, "attention.ring.bwd"),
                    (acc_out, acc_recv, 1, "attention.ring.bwd.grads"),
                ],
                lambda b=b, kb=kb, vb=vb: result.append(_pack(*grads.block(b, kb, vb))),
            )
            g = result[0]
            if acc_recv is not None:
                g.add_(acc_recv)
            own, acc_out = (g, None) if t == 0 else (own, g)
            held = recv
        if n > 1:  # the last accumulator goes home
            back = own.new_empty(own.numel())
            _exchange_many(topo, [(acc_out, back, 1, "attention.ring.bwd.grads")], None)
            own.add_(back)
        dk, dv = _unpack(own, k.shape, v.shape)
        return grads.grad_q(), dk, dv, None


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, *shapes) -> List[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(buf[offset : offset + n].view(shape))
        offset += n
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _exchange_many(topo, pairs, during):
    """Several (send, recv, tag, label) messages to the next / from the previous rank in one batch
    (None or empty buffers move nothing: both ends know every block's size), ``during()`` overlapped."""
    prev, nxt = topo.peers
    sends, recvs = [], []
    for send, recv, tag, label in pairs:
        if send is not None and send.numel():
            sends.append((send, nxt, tag))
            record_collective("send", send.numel() * send.element_size(), topo.size, label)
        if recv is not None and recv.numel():
            recvs.append((recv, prev, tag))
            record_collective("recv", recv.numel() * recv.element_size(), topo.size, label)
    if not sends and not recvs:
        if during is not None:
            during()
        return
    exchange_p2p(topo.p2p_group, sends, recvs, topo.direct, during)


class AllGatherAttention(torch.autograd.Function):
    """forward: all-gather every rank's K and V (padded to the longest block), then attend block
    by block with the online-softmax merge /
    backward: the K/V all-gather again, dK/dV of every block computed here (recompute from out
    and lse), then one reduce-scatter returns each rank the sum of its block's gradients."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        topo = plan.topo
        kv = gather_padded(_kv_rows(k, v), plan.k_sizes, topo, "attention.all_gather.fwd")
        merge = BlockForward(plan, q, k, v)
        for b in range(topo.size):
            merge.add(b, *_split_kv_rows(kv[b], k, v, plan.k_sizes[b]))
        del kv
        out, lse = merge.finish()
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        topo = plan.topo
        kv = gather_padded(_kv_rows(k, v), plan.k_sizes, topo, "attention.all_gather.bwd")
        grads = BlockBackward(plan, q, k, v, out, lse, dout)
        total = torch.zeros_like(kv)  # (n, rows of K|V, Lmax, max(E, Ev))
        for b in range(topo.size):
            lb = plan.k_sizes[b]
            if lb:
                gk, gv = grads.block(b, *_split_kv_rows(kv[b], k, v, lb))
                total[b].narrow(-2, 0, lb).copy_(_kv_rows(gk, gv))
        del kv
        mine = _reduce_scatter_blocks(total, topo)  # (rows, Lmax, max(E, Ev))
        dk, dv = _split_kv_rows(mine, k, v, k.size(-2))
        return grads.grad_q(), dk.contiguous(), dv.contiguous(), None


def _kv_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V side by side along the last dim: (rows, L, E + Ev) with rows = batch of K then V.

    K and V may have different batch shapes (both broadcast against q), so each is flattened to
    (batch, L, E) and the shorter batch is not assumed: the two are stacked as two row groups."""
    kf = k.reshape(_numel(k.shape[:-2]), k.size(-2), k.size(-1))
    vf = v.reshape(_numel(v.shape[:-2]), v.size(-2), v.size(-1))
    width = max(kf.size(-1), vf.size(-1))
    kf = torch.nn.functional.pad(kf, (0, width - kf.size(-1)))
    vf = torch.nn.functional.pad(vf, (0, width - vf.size(-1)))
    return torch.cat([kf, vf], 0)


def _split_kv_rows(rows: torch.Tensor, k, v, length: int):
    """Inverse of :func:`_kv_rows` for a block of ``length`` keys."""
    nk = _numel(k.shape[:-2])
    kb = rows[:nk, :length, : k.size(-1)].reshape(k.shape[:-2] + (length, k.size(-1)))
    vb = rows[nk:, :length, : v.size(-1)].reshape(v.shape[:-2] + (length, v.size(-1)))
    return kb, vb


def _reduce_scatter_blocks(grads: torch.Tensor, topo) -> torch.Tensor:
    """Sum ``grads`` (n, ...) over all ranks and keep this rank's entry (flattened mesh order)."""
    out = grads
    # Nested like the gather: the first mesh dim is outermost in the flattened order.
    for d, group in enumerate(topo.groups):
        size = dist.get_world_size(group)
        out = out.unflatten(0, (size, out.size(0) // size)).contiguous()
        out = reduce_scatter_along_dim(out, 0, [1] * size, group, "attention.all_gather.bwd").squeeze(0)
    return out[0]  # (1, ...) -> this rank's entry
