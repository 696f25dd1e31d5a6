"""A Llama model with grouped-query attention (8 query heads, 2 key/value heads), tensor-parallel.

    torchrun --standalone --nproc-per-node 2 examples/llama_tp.py     # or 4 ranks
    torchrun --standalone --nproc-per-node 2 examples/llama_tp.py --fused-qkv
    torchrun --standalone --nproc-per-node 3 examples/llama_tp.py     # heads cannot split: attention replicated

Llama blocks in plain ``nn`` code: RMSNorm, rotary embeddings, GQA, a SwiGLU
MLP with a fused ``gate_up`` projection, untied vocab-parallel embedding and
head. The plan splits q/k/v in whole heads (``head_dim``): at 4 ranks each
rank holds 2 query heads and the key/value head of their group, replicated
on 2 ranks (rank r holds kv head ``r * 2 // 4``), its gradient summed over
the replicas. ``--fused-qkv`` uses one ``qkv_proj`` with
``sections=(8*hd, 2*hd, 2*hd)`` instead. ``gate_up`` uses
``sections=(ffn, ffn)``, so ``chunk(2)`` of its local output is this rank's
gate and up. First a parity check against the serial model in fp64 (loss and
every parameter after one AdamW step, through ``gather_state_dict``), then a
few fp32 training steps with ``vocab_parallel_cross_entropy``.

At 3 ranks no split keeps each kv head's 4 query heads with it (3 divides neither 8 nor 2):
``parallelize_module`` (and ``explain``) refuse the attention part of the plan with a
``ValueError`` naming the rank and heads, fused or separate. The example then says so and keeps
the attention projections replicated, which is exact; everything else stays tensor-parallel.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _lm_common import parity_step, synthetic_batch, train
from torch import nn

import tplayers


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x (b, heads, s, hd)`` (per head: works on any subset of heads)."""
    s, hd = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, dtype=x.dtype, device=x.device) / hd)  # (hd/2,)
    ang = torch.arange(s, dtype=x.dtype, device=x.device)[:, None] * inv  # (s, hd/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv: int, fused: bool):
        super().__init__()
        self.hd, self.fused = d // n_heads, fused
        self.sections = (n_heads * self.hd, n_kv * self.hd, n_kv * self.hd)
        if fused:
            self.qkv_proj = nn.Linear(d, sum(self.sections), bias=False)
        else:
            self.q_proj = nn.Linear(d, self.sections[0], bias=False)
            self.k_proj = nn.Linear(d, self.sections[1], bias=False)
            self.v_proj = nn.Linear(d, self.sections[2], bias=False)
        self.o_proj = nn.Linear(n_heads * self.hd, d, bias=False)

    def forward(self, x):  # x: (b, s, d)
        b, s, _ = x.shape
        if self.fused:  # a parallel qkv_proj reports the widths of its local blocks
            q, k, v = self.qkv_proj(x).split(getattr(self.qkv_proj, "local_sections", self.sections), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # (b, s, heads_here * hd) -> (b, heads_here, s, hd): all heads serially, this rank's when parallel
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        q, k = rotary(q), rotary(k)
        rep = q.shape[1] // k.shape[1]  # query heads per kv head held here (4 serially, and at 2 or 4 ranks)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads_here, s, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))  # o_proj row-parallel -> (b, s, d)


class SwiGLU(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)  # fused [gate | up]
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)  # this rank's gate and up with sections=(ffn, ffn)
        return self.down(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv: int, ffn: int, fused: bool):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(d), Attention(d, n_heads, n_kv, fused)
        self.mlp_norm, self.mlp = nn.RMSNorm(d), SwiGLU(d, ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, n_heads: int, n_kv: int, ffn: int, n_layers: int, fused: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, n_heads, n_kv, ffn, fused) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):  # idx: (b, s) -> logits (b, s, vocab), or (b, s, vocab_local) parallel
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def llama_plan(d: int, n_heads: int, n_kv: int, ffn: int, fused: bool) -> dict:
    hd = d // n_heads
    plan = {
        "embed": tplayers.RowParallel(),  # vocab-parallel
        r"layers\.\d+\.attn\.o_proj": tplayers.RowParallel(head_dim=hd),
        r"layers\.\d+\.mlp\.gate_up": tplayers.ColumnParallel(sections=(ffn, ffn)),
        r"layers\.\d+\.mlp\.down": tplayers.RowParallel(),
        "lm_head": tplayers.ColumnParallel(),  # vocab-parallel logits
    }
    if fused:
        plan[r"layers\.\d+\.attn\.qkv_proj"] = tplayers.ColumnParallel(
            sections=(n_heads * hd, n_kv * hd, n_kv * hd), head_dim=hd
        )
    else:  # kv heads fewer than ranks: replicated in groups, gradients summed over the replicas
        plan[r"layers\.\d+\.attn\.(q|k|v)_proj"] = tplayers.ColumnParallel(head_dim=hd)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=172)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=101)
    parser.add_argument("--smoothing", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fused-qkv", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)  # same seed everywhere: identical serial model and data on every rank
    serial = Llama(args.vocab, args.dim, args.heads, args.kv_heads, args.ffn, args.layers, args.fused_qkv).double()
    plan = llama_plan(args.dim, args.heads, args.kv_heads, args.ffn, args.fused_qkv)
    try:  # the plan is checked before anything is built: query heads must sit with their kv heads
        tplayers.explain(serial, plan, mesh, print_table=dist.get_rank() == 0)
    except ValueError as err:  # e.g. 8 query / 2 kv heads on 3 ranks: no split keeps every group whole
        say(
            f"attention heads cannot be split over {mesh.size()} ranks:\n  {err}\n"
            "keeping the attention projections replicated (every rank computes all heads); the embedding, "
            "MLP and lm_head stay tensor-parallel"
        )
        plan = {k: v for k, v in plan.items() if r"\.attn\." not in k}
        tplayers.explain(serial, plan, mesh, print_table=dist.get_rank() == 0)
    gen = torch.Generator().manual_seed(1)
    inp, target = synthetic_batch(gen, args.batch, args.seq, args.vocab)
    model = parity_step(serial, plan, mesh, inp, target, args.smoothing, say)
    del serial
    train(model, mesh, gen, args, say)
    say("done")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
