"""Exact attention over key blocks held by other ranks: the ring and the all-gather Functions.

Both compute, for this rank's queries, softmax over ALL keys one key block (one rank's keys) at a
time with an online-softmax merge (running row max ``m``, row sum ``l`` and unnormalised output
``acc``), so no rank ever holds more than ``(..., Lq_local, L_block)`` scores. The backward
recomputes each block's probabilities from the saved output and log-sum-exp ``lse``::

    P = exp(S - lse),  dV_b = P^T dO,  dS = P * (dO V_b^T - rowsum(dO * O)),  dQ += dS K_b,  dK_b = dS^T Q

Dropout (the serial mask's rows, see :mod:`tplayers.functional.attention`) multiplies ``P`` after
normalisation, so it enters ``acc`` and ``dV`` but not ``l``; ``rowsum(dO * O)`` still equals
``rowsum(P * dP)``. Rows whose every key is masked give 0 (as torch's safe softmax does).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import exchange_p2p
from tplayers.comm.sequence import reduce_scatter_along_dim
from tplayers.functional.attention_plan import AttentionPlan, gather_padded

__all__ = ["RingAttention", "AllGatherAttention", "local_attention"]

_NEG_INF = float("-inf")


def _expand_kv(kb: torch.Tensor, groups: int) -> torch.Tensor:
    return kb if groups == 1 else kb.repeat_interleave(groups, dim=-3)


def _fold_kv_grad(g: torch.Tensor, groups: int, shape) -> torch.Tensor:
    if groups > 1:
        g = g.unflatten(-3, (g.size(-3) // groups, groups)).sum(-3)  # (..., Hk, groups, L, E) -> (..., Hk, L, E)
    return g.sum_to_size(shape)


class _Merge:
    """Running online-softmax state of this rank's queries: row max, row sum, unnormalised output."""

    def __init__(self, batch, lq: int, ev: int, dtype, device) -> None:
        self.m = torch.full(batch + (lq, 1), _NEG_INF, dtype=dtype, device=device)
        self.l = torch.zeros(batch + (lq, 1), dtype=dtype, device=device)
        self.acc = torch.zeros(batch + (lq, ev), dtype=dtype, device=device)

    def add(self, qs: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias, keep, drop_scale: float) -> None:
        for start, length in _key_chunks(kb.size(-2), qs):
            self._add(qs, kb.narrow(-2, start, length), vb.narrow(-2, start, length), _cols(bias, start, length),
                      _cols(keep, start, length), drop_scale)

    def _add(self, qs, kb, vb, bias, keep, drop_scale: float) -> None:
        s = torch.matmul(qs, kb.transpose(-1, -2))                    # (*batch, Lq, Lb)
        if bias is not None:
            s.add_(bias)
        m_new = torch.maximum(self.m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)            # all-masked rows so far: no shift
        p = s.sub_(m_safe).exp_()                                     # in place: one score buffer
        alpha = (self.m - m_safe).exp_()
        self.l.mul_(alpha).add_(p.sum(-1, keepdim=True))
        if keep is not None:
            p.mul_(keep).mul_(drop_scale)
        self.acc.mul_(alpha).add_(torch.matmul(p, vb))
        self.m = m_new

    def finish(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(output, lse); a row with no allowed key gets output 0 and lse -inf."""
        empty = self.l == 0
        out = self.acc / self.l.masked_fill(empty, 1.0)
        lse = self.m.masked_fill(empty, 0.0) + torch.log(self.l)
        return out, lse


# Scores are formed for at most this many bytes of keys at a time (per rank): a block of keys
# is split into chunks so that (*batch, Lq_local, chunk) stays under it.
SCORE_CHUNK_BYTES = 64 << 20


def _key_chunks(lb: int, qs: torch.Tensor):
    per_key = max(1, qs.numel() // max(1, qs.size(-1))) * qs.element_size()   # bytes of one score column
    chunk = max(1, SCORE_CHUNK_BYTES // per_key)
    return [(s, min(chunk, lb - s)) for s in range(0, lb, chunk)]


def _cols(t: Optional[torch.Tensor], start: int, length: int) -> Optional[torch.Tensor]:
    return t if t is None or t.size(-1) == 1 else t.narrow(-1, start, length)


def _block_grads(qs, kb, vb, bias, keep, drop_scale, dout, lse_safe, delta):
    """One block's (dS K_b, dK_b, dV_b) in the attention's batch shape (dK_b, dV_b unfolded),
    key chunk by key chunk (see :data:`SCORE_CHUNK_BYTES`)."""
    chunks = _key_chunks(kb.size(-2), qs)
    if len(chunks) == 1:
        return _chunk_grads(qs, kb, vb, bias, keep, drop_scale, dout, lse_safe, delta)
    gq, gks, gvs = None, [], []
    for start, length in chunks:
        q_part, k_part, v_part = _chunk_grads(qs, kb.narrow(-2, start, length), vb.narrow(-2, start, length),
                                              _cols(bias, start, length), _cols(keep, start, length), drop_scale,
                                              dout, lse_safe, delta)
        gq = q_part if gq is None else gq.add_(q_part)
        gks.append(k_part)
        gvs.append(v_part)
    return gq, torch.cat(gks, -2), torch.cat(gvs, -2)


def _chunk_grads(qs, kb, vb, bias, keep, drop_scale, dout, lse_safe, delta):
    p = torch.matmul(qs, kb.transpose(-1, -2))
    if bias is not None:
        p.add_(bias)
    p.sub_(lse_safe).exp_()                                            # P = exp(S - lse)
    dp = torch.matmul(dout, vb.transpose(-1, -2))                      # dP (of the dropped P)
    if keep is not None:
        dv = torch.matmul((p * keep * drop_scale).transpose(-1, -2), dout)
        dp.mul_(keep).mul_(drop_scale)
    else:
        dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = dp.sub_(delta).mul_(p)                                        # dS = P * (dP - rowsum(dO*O))
    return torch.matmul(ds, kb), torch.matmul(ds.transpose(-1, -2), qs), dv


def _prepare(q, plan: AttentionPlan):
    qs = (q * plan.scale).expand(plan.batch + q.shape[-2:])           # (*batch, Lq, E), scaled
    return qs


def local_attention(q, k, v, plan: AttentionPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Forward over keys all held here (replicated K/V): one block, no communication."""
    merge = _Merge(plan.batch, q.size(-2), v.size(-1), q.dtype, q.device)
    merge.add(_prepare(q, plan), _expand_kv(k, plan.groups), _expand_kv(v, plan.groups),
              plan.block_bias(0, q.dtype, q.device), plan.block_keep(0), plan.drop_scale)
    return merge.finish()


class LocalAttention(torch.autograd.Function):
    """forward: attention of this rank's queries over keys it holds whole (no communication) /
    backward: the recompute from (out, lse), no communication (dK, dV are this rank's partial
    sums: the contributions of its queries)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        out, lse = local_attention(q, k, v, plan)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        dout, delta, lse_safe = _backward_prep(dout, out, lse, plan)
        dq, dk, dv = _block_grads(_prepare(q, plan), _expand_kv(k, plan.groups), _expand_kv(v, plan.groups),
                                  plan.block_bias(0, q.dtype, q.device), plan.block_keep(0), plan.drop_scale,
                                  dout, lse_safe, delta)
        return ((dq * plan.scale).sum_to_size(q.shape), _fold_kv_grad(dk, plan.groups, k.shape),
                _fold_kv_grad(dv, plan.groups, v.shape), None)


def _backward_prep(dout, out, lse, plan):
    dout = dout.expand(plan.batch + dout.shape[-2:])
    delta = (dout * out).sum(-1, keepdim=True)                         # rowsum(dO * O)
    lse_safe = lse.masked_fill(lse == _NEG_INF, float("inf"))         # no allowed key: P = 0
    return dout, delta, lse_safe


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, *shapes) -> List[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(buf[offset: offset + n].view(shape))
        offset += n
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class RingAttention(torch.autograd.Function):
    """forward: a ring of K/V blocks (n - 1 steps; each rank passes the block it holds to the
    next rank while attending to it, online-softmax merge) /
    backward: the ring again (K/V recomputed per block from the saved out and lse), each block's
    dK/dV accumulator travelling with it and arriving back at its owner after n - 1 hops."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        topo = plan.topo
        n, me = topo.size, topo.index
        qs = _prepare(q, plan)
        merge = _Merge(plan.batch, q.size(-2), v.size(-1), q.dtype, q.device)
        held = _pack(k, v)
        for t in range(n):
            b = (me - t) % n                                          # the block held at step t
            nxt_b = (me - t - 1) % n
            recv = None
            if t < n - 1:
                recv = held.new_empty(_numel(plan.k_shape_of(nxt_b)) + _numel(plan.v_shape_of(nxt_b)))
            kb, vb = _unpack(held, plan.k_shape_of(b), plan.v_shape_of(b))

            def compute(kb=kb, vb=vb, b=b):
                if kb.size(-2):
                    merge.add(qs, _expand_kv(kb, plan.groups), _expand_kv(vb, plan.groups),
                              plan.block_bias(b, q.dtype, q.device), plan.block_keep(b), plan.drop_scale)

            _exchange_many(topo, [(held if t < n - 1 else None, recv, 0, "attention.ring.fwd")], compute)
            held = recv
        out, lse = merge.finish()
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        topo = plan.topo
        n, me = topo.size, topo.index
        dout, delta, lse_safe = _backward_prep(dout, out, lse, plan)
        qs = _prepare(q, plan)
        dq = torch.zeros(plan.batch + q.shape[-2:], dtype=q.dtype, device=q.device)
        held, acc_in = _pack(k, v), None
        acc_out = None                                                 # (dK, dV) of the block held last step
        own = None
        for t in range(n):
            b = (me - t) % n
            kshape, vshape = plan.k_shape_of(b), plan.v_shape_of(b)
            kb, vb = _unpack(held, kshape, vshape)
            recv = acc_recv = None
            if t < n - 1:
                nb = (me - t - 1) % n
                recv = held.new_empty(_numel(plan.k_shape_of(nb)) + _numel(plan.v_shape_of(nb)))
            if t >= 2:
                acc_recv = held.new_empty(_numel(kshape) + _numel(vshape))
            result = {}

            def compute(kb=kb, vb=vb, b=b, kshape=kshape, vshape=vshape):
                if kb.size(-2) == 0:
                    result["g"] = held.new_zeros(_numel(kshape) + _numel(vshape))
                    return
                gq, gk, gv = _block_grads(qs, _expand_kv(kb, plan.groups), _expand_kv(vb, plan.groups),
                                          plan.block_bias(b, q.dtype, q.device), plan.block_keep(b),
                                          plan.drop_scale, dout, lse_safe, delta)
                dq.add_(gq)
                result["g"] = _pack(_fold_kv_grad(gk, plan.groups, kshape),
                                    _fold_kv_grad(gv, plan.groups, vshape))

            # K/V for the next step and the accumulator of the previous step's block go out while
            # this block is computed; this block's accumulator (made by the previous rank) comes in.
            _exchange_many(topo, [(held if t < n - 1 else None, recv, 0, "attention.ring.bwd"),
                                  (acc_out, acc_recv, 1, "attention.ring.bwd.grads")], compute)
            g = result["g"]
            if acc_recv is not None:
                g.add_(acc_recv)
            if t == 0:
                own, acc_out = g, None
            else:
                acc_out = g
            held = recv
        if n > 1:                                                      # the last accumulator goes home
            back = own.new_empty(own.numel())
            _exchange_many(topo, [(acc_out, back, 1, "attention.ring.bwd.grads")], None)
            own.add_(back)
        dk, dv = _unpack(own, k.shape, v.shape)
        return (dq * plan.scale).sum_to_size(q.shape), dk, dv, None


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
    backward: dK/dV of every block computed here (recompute from out and lse), then one
    reduce-scatter returns each rank the sum of its block's gradients."""

    @staticmethod
    def forward(ctx, q, k, v, plan: AttentionPlan):
        topo = plan.topo
        kv = gather_padded(_kv_rows(k, v), plan.k_sizes, topo, "attention.all_gather.fwd")
        qs = _prepare(q, plan)
        merge = _Merge(plan.batch, q.size(-2), v.size(-1), q.dtype, q.device)
        for b in range(topo.size):
            if plan.k_sizes[b]:
                kb, vb = _split_kv_rows(kv[b], k, v, plan.k_sizes[b])
                merge.add(qs, _expand_kv(kb, plan.groups), _expand_kv(vb, plan.groups),
                          plan.block_bias(b, q.dtype, q.device), plan.block_keep(b), plan.drop_scale)
        del kv
        out, lse = merge.finish()
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        topo = plan.topo
        dout, delta, lse_safe = _backward_prep(dout, out, lse, plan)
        kv = gather_padded(_kv_rows(k, v), plan.k_sizes, topo, "attention.all_gather.bwd")
        qs = _prepare(q, plan)
        dq = torch.zeros(plan.batch + q.shape[-2:], dtype=q.dtype, device=q.device)
        grads = torch.zeros_like(kv)                                   # (n, rows of K|V, Lmax, E + Ev)
        for b in range(topo.size):
            lb = plan.k_sizes[b]
            if lb:
                kb, vb = _split_kv_rows(kv[b], k, v, lb)
                gq, gk, gv = _block_grads(qs, _expand_kv(kb, plan.groups), _expand_kv(vb, plan.groups),
                                          plan.block_bias(b, q.dtype, q.device), plan.block_keep(b),
                                          plan.drop_scale, dout, lse_safe, delta)
                dq.add_(gq)
                gk = _fold_kv_grad(gk, plan.groups, kb.shape)
                gv = _fold_kv_grad(gv, plan.groups, vb.shape)
                grads[b].narrow(-2, 0, lb).copy_(_kv_rows(gk, gv))
        del kv
        mine = _reduce_scatter_blocks(grads, topo)                     # (rows, Lmax, E + Ev)
        dk, dv = _split_kv_rows(mine, k, v, k.size(-2))
        return (dq * plan.scale).sum_to_size(q.shape), dk.contiguous(), dv.contiguous(), None


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
    return out[0]                                                      # (1, ...) -> this rank's entry
