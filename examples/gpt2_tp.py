"""GPT-2 with tensor parallelism: fused c_attn, tied vocab-parallel head, vocab-parallel loss.

    torchrun --standalone --nproc-per-node 2 examples/gpt2_tp.py

The model is GPT-2's block stack written in plain ``nn`` code (as in nanoGPT):
one fused ``c_attn = Linear(d, 3d)`` per block, an ``lm_head`` tied to the token
embedding ``wte``. The plan shards ``c_attn`` per block (``sections=(d, d, d)``)
in whole heads, so ``chunk(3)`` of the local output is this rank's q, k and v;
``wte`` becomes vocab-parallel and ``lm_head`` column-parallel with the same
rows, so the tie stays one Parameter; the loss is
``tplayers.vocab_parallel_cross_entropy`` (label smoothing, ignored padding
positions), and the full logits never exist. First a parity check against the
serial model in fp64 (loss, and every parameter after one AdamW step through
``gather_state_dict``), then a few fp32 training steps.
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


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.head_dim = d // n_head
        self.c_attn = nn.Linear(d, 3 * d)  # fused [q | k | v]
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):  # x: (b, s, d)
        b, s, _ = x.shape
        # (b, s, 3 * width): width = d serially, this rank's heads' features when c_attn is
        # ColumnParallel(sections=(d, d, d)). chunk(3), not split(d): it works in both layouts.
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))  # c_proj row-parallel -> (b, s, d)


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab: int, d: int, n_head: int, n_layer: int, max_seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (GPT-2)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):  # idx: (b, s) -> logits (b, s, vocab) serially, (b, s, vocab_local) parallel
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2_plan(d: int, n_head: int) -> dict:
    """Megatron's GPT-2 layout; the vocabulary split alike in wte and lm_head keeps the tie."""
    hd = d // n_head
    return {
        "wte": tplayers.RowParallel(),  # vocab-parallel embedding
        r"h\.\d+\.attn\.c_attn": tplayers.ColumnParallel(sections=(d, d, d), head_dim=hd),
        r"h\.\d+\.attn\.c_proj": tplayers.RowParallel(head_dim=hd),
        r"h\.\d+\.mlp\.c_fc": tplayers.ColumnParallel(),
        r"h\.\d+\.mlp\.c_proj": tplayers.RowParallel(),
        "lm_head": tplayers.ColumnParallel(),  # vocab-parallel logits, same rows as wte
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=101)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)  # same seed everywhere: identical serial model and data on every rank
    serial = GPT2(args.vocab, args.dim, args.heads, args.layers, args.seq).double()
    plan = gpt2_plan(args.dim, args.heads)
    tplayers.explain(serial, plan, mesh, print_table=dist.get_rank() == 0)
    gen = torch.Generator().manual_seed(1)
    inp, target = synthetic_batch(gen, args.batch, args.seq, args.vocab)
    model = parity_step(serial, plan, mesh, inp, target, args.smoothing, say)
    say(f"tie kept: lm_head.weight is wte.weight = {model.lm_head.weight is model.wte.weight}")
    del serial
    train(model, mesh, gen, args, say)
    say("done")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
