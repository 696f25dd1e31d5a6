"""One rank's queries against one block of keys: the online-softmax merge and its backward.

:class:`BlockForward` merges blocks of keys into a running (row max ``m``, row sum ``l``,
unnormalised output ``acc``); :class:`BlockBackward` recomputes a block's probabilities from the
final output and log-sum-exp and returns its gradients::

    P = exp(S - lse),  dV_b = P^T dO,  dS = P * (dO V_b^T - rowsum(dO * O)),  dQ += scale dS K_b,  dK_b = scale dS^T Q

Two local kernels, the same math:

- **fused** (float32/float64 on the CPU, 4-D tensors with one batch shape, no dropout): torch's
  flash-attention CPU kernel (E == Ev) ``aten._scaled_dot_product_flash_attention_for_cpu`` returns the
  block's output and log-sum-exp, merged by their weights ``exp(lse_b - m)``; its backward takes
  the GLOBAL output and log-sum-exp, so it returns exactly the block's share of the gradients. It
  tiles internally, so no score block is ever formed whole.
- **torch ops** (everything else: dropout, broadcast batch dims, other dtypes and devices):
  matmuls and in-place exp on key chunks of at most :data:`SCORE_CHUNK_BYTES` of scores.

Dropout (the serial mask's rows) multiplies ``P`` after normalisation, so it enters ``acc`` and
``dV`` but not ``l``; ``rowsum(dO * O)`` still equals ``rowsum(P * dP)``. Rows whose every key is
masked give 0 (torch's safe softmax) and carry ``lse = -inf``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["BlockForward", "BlockBackward", "SCORE_CHUNK_BYTES", "fold_kv_grad"]

_NEG_INF = float("-inf")

# The torch-ops kernel forms scores for at most this many bytes of keys at a time (per rank): a
# block of keys is split into chunks so that (*batch, Lq_local, chunk) stays under it.
SCORE_CHUNK_BYTES = 64 << 20

# Whether eligible calls use torch's fused CPU kernel (tests switch it off to run the torch-ops path).
FUSED_CPU = True


def _key_chunks(lb: int, lq_rows: int, itemsize: int):
    chunk = max(1, SCORE_CHUNK_BYTES // max(1, lq_rows * itemsize))
    return [(s, min(chunk, lb - s)) for s in range(0, lb, chunk)]


def _cols(t: Optional[torch.Tensor], start: int, length: int) -> Optional[torch.Tensor]:
    return t if t is None or t.size(-1) == 1 else t.narrow(-1, start, length)


def expand_kv(kb: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: key/value heads repeat-interleaved to the query heads (as torch does)."""
    return kb if groups == 1 else kb.repeat_interleave(groups, dim=-3)


def fold_kv_grad(g: torch.Tensor, groups: int, shape) -> torch.Tensor:
    """The gradient of an expanded key/value block folded back to the block's own shape."""
    if groups > 1:
        g = g.unflatten(-3, (g.size(-3) // groups, groups)).sum(-3)  # (..., Hk, groups, L, E) -> (..., Hk, L, E)
    return g.sum_to_size(shape)


def _fused_ok(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU kernel computes this call's blocks (see the module docstring)."""
    return (
        FUSED_CPU
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and plan.keep is None
        and q.dim() == 4
        and len(plan.batch) == 2
        and q.size(-1) == v.size(-1)
        and tuple(q.shape[:-2]) == plan.batch
        and tuple(expand_kv(k[..., :0, :], plan.groups).shape[:-2]) == plan.batch
        and tuple(expand_kv(v[..., :0, :], plan.groups).shape[:-2]) == plan.batch
        and q.size(-2) > 0
        and all(t.stride(-1) == 1 for t in (q, k, v))
    )  # the kernel reads the last dim as contiguous


def _dead_rows(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Rows (..., Lq | 1, 1) whose every key of this block is masked out, or None."""
    if bias is None:
        return None
    return (bias == _NEG_INF).all(-1, keepdim=True)


class BlockForward:
    """The running online-softmax state of this rank's queries ``q`` over blocks of keys."""

    def __init__(self, plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.plan, self.q = plan, q
        self.fused = _fused_ok(plan, q, k, v)
        self.qs = None if self.fused else (q * plan.scale).expand(plan.batch + q.shape[-2:])
        lq, ev = q.size(-2), v.size(-1)
        self.m = torch.full(plan.batch + (lq, 1), _NEG_INF, dtype=q.dtype, device=q.device)
        self.l = torch.zeros(plan.batch + (lq, 1), dtype=q.dtype, device=q.device)
        self.acc = torch.zeros(plan.batch + (lq, ev), dtype=q.dtype, device=q.device)

    def add(self, b: int, kb: torch.Tensor, vb: torch.Tensor) -> None:
        """Merge rank ``b``'s key block (its own, unexpanded shape) into the state."""
        if kb.size(-2) == 0:
            return
        plan, q = self.plan, self.q
        kb, vb = expand_kv(kb, plan.groups), expand_kv(vb, plan.groups)
        bias, keep = plan.block_bias(b, q.dtype, q.device), plan.block_keep(b)
        if self.fused:
            mask = None if bias is None else bias.expand(plan.batch + (q.size(-2), kb.size(-2)))
            out_b, lse_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, kb, vb, 0.0, False, attn_mask=mask, scale=plan.scale
            )
            lse_b = lse_b.unsqueeze(-1)  # (*batch, Lq, 1)
            dead = _dead_rows(bias)
            if dead is not None:
                lse_b = lse_b.masked_fill(dead, _NEG_INF)
                out_b = out_b.masked_fill(dead, 0.0)
            # the block as (m = lse_b, l = 1, acc = out_b)
            self._merge(lse_b, torch.ones_like(lse_b), out_b)
            return
        rows = self.qs.numel() // max(1, self.qs.size(-1))
        for start, length in _key_chunks(kb.size(-2), rows, q.element_size()):
            self._add_chunk(
                kb.narrow(-2, start, length),
                vb.narrow(-2, start, length),
                _cols(bias, start, length),
                _cols(keep, start, length),
            )

    def _merge(self, m_b, l_b, acc_b) -> None:
        m_new = torch.maximum(self.m, m_b)
        m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # all masked so far: no shift
        alpha, beta = (self.m - m_safe).exp_(), (m_b - m_safe).exp_()
        self.l.mul_(alpha).add_(l_b * beta)
        self.acc.mul_(alpha).add_(acc_b * beta)
        self.m = m_new

    def _add_chunk(self, kb, vb, bias, keep) -> None:
        s = torch.matmul(self.qs, kb.transpose(-1, -2))  # (*batch, Lq, chunk)
        if bias is not None:
            s.add_(bias)
        m_new = torch.maximum(self.m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)
        p = s.sub_(m_safe).exp_()  # in place: one score buffer
        alpha = (self.m - m_safe).exp_()
        self.l.mul_(alpha).add_(p.sum(-1, keepdim=True))
        if keep is not None:
            p.mul_(keep).mul_(self.plan.drop_scale)
        self.acc.mul_(alpha).add_(torch.matmul(p, vb))
        self.m = m_new

    def finish(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(output, lse (*batch, Lq, 1)); a row with no allowed key gets output 0 and lse -inf."""
        empty = self.l == 0
        out = self.acc / self.l.masked_fill(empty, 1.0)
        lse = self.m.masked_fill(empty, 0.0) + torch.log(self.l)
        return out, lse


class BlockBackward:
    """Gradients of one block of keys from the saved output and log-sum-exp (recompute)."""

    def __init__(self, plan, q, k, v, out, lse, dout) -> None:
        self.plan, self.q = plan, q
        self.fused = _fused_ok(plan, q, k, v)
        self.dout = dout.expand(plan.batch + dout.shape[-2:])
        self.lse_safe = lse.masked_fill(lse == _NEG_INF, float("inf"))  # no allowed key: P = 0
        if self.fused:
            if self.dout.stride(-1) != 1:  # the fused kernel reads the last dim as contiguous
                self.dout = self.dout.contiguous()
            self.out, self.lse_flat = out.contiguous(), self.lse_safe.squeeze(-1)
        else:
            self.qs = (q * plan.scale).expand(plan.batch + q.shape[-2:])
            self.delta = (self.dout * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        self.dq = torch.zeros(plan.batch + q.shape[-2:], dtype=q.dtype, device=q.device)

    def block(self, b: int, kb: torch.Tensor, vb: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Add rank ``b``'s block's share to ``self.dq``; return its (dK_b, dV_b) in its own shape."""
        plan, q = self.plan, self.q
        if kb.size(-2) == 0:
            return torch.zeros_like(kb), torch.zeros_like(vb)
        ke, ve = expand_kv(kb, plan.groups), expand_kv(vb, plan.groups)
        bias, keep = plan.block_bias(b, q.dtype, q.device), plan.block_keep(b)
        if self.fused:
            mask = None if bias is None else bias.expand(plan.batch + (q.size(-2), ke.size(-2)))
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                self.dout, q, ke, ve, self.out, self.lse_flat, 0.0, False, attn_mask=mask, scale=plan.scale
            )
            self.dq.add_(gq)
        else:
            rows = self.qs.numel() // max(1, self.qs.size(-1))
            gks, gvs = [], []
            for start, length in _key_chunks(ke.size(-2), rows, q.element_size()):
                k_part, v_part = self._chunk(
                    ke.narrow(-2, start, length),
                    ve.narrow(-2, start, length),
                    _cols(bias, start, length),
                    _cols(keep, start, length),
                )
                gks.append(k_part)
                gvs.append(v_part)
            gk, gv = (gks[0], gvs[0]) if len(gks) == 1 else (torch.cat(gks, -2), torch.cat(gvs, -2))
        return fold_kv_grad(gk, plan.groups, kb.shape), fold_kv_grad(gv, plan.groups, vb.shape)

    def _chunk(self, kb, vb, bias, keep):
        p = torch.matmul(self.qs, kb.transpose(-1, -2))
        if bias is not None:
            p.add_(bias)
        p.sub_(self.lse_safe).exp_()  # P = exp(S - lse)
        dp = torch.matmul(self.dout, vb.transpose(-1, -2))  # dP (of the dropped P)
        scale = self.plan.drop_scale
        if keep is not None:
            dv = torch.matmul((p * keep * scale).transpose(-1, -2), self.dout)
            dp.mul_(keep).mul_(scale)
        else:
            dv = torch.matmul(p.transpose(-1, -2), self.dout)
        ds = dp.sub_(self.delta).mul_(p)  # dS = P * (dP - rowsum(dO*O))
        self.dq.add_(torch.matmul(ds, kb).mul_(self.plan.scale))
        return torch.matmul(ds.transpose(-1, -2), self.qs), dv

    def grad_q(self) -> torch.Tensor:
        return self.dq.sum_to_size(self.q.shape)
