"""Tensor-parallel training of a small transformer on synthetic tokens.

    torchrun --standalone --nproc-per-node 2 examples/tp_transformer.py

An ordinary PyTorch model is parallelized with a plan (attention q/k/v and MLP
fc1 column-parallel, attention proj and MLP fc2 row-parallel: Megatron). The
first step is checked against the serial model (loss, logits, every gathered
parameter after one AdamW step), then it trains and prints loss and tokens/s.
Runs on CPU with gloo; `python examples/tp_transformer.py` runs it on one rank.
"""

from __future__ import annotations

import argparse
import copy
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers
from tplayers.comm import all_gather_along_dim
from tplayers.layers import ShardedModule
from tplayers.sharding import shard_sizes


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # x: (b, s, dim)
        b, s, _ = x.shape
        # (b, s, local_dim) -> (b, heads_here, s, head_dim); heads_here = all heads serially,
        # this rank's share of them after q/k/v become column-parallel.
        q, k, v = (t(x).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads_here, s, head_dim)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))  # proj is row-parallel: (b, s, dim)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):  # idx: (b, s) -> logits (b, s, vocab)
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


PLAN = {
    r"blocks\.\d+\.attn\.(q|k|v)": tplayers.ColumnParallel(),
    r"blocks\.\d+\.attn\.proj": tplayers.RowParallel(),
    r"blocks\.\d+\.mlp\.fc1": tplayers.ColumnParallel(),
    r"blocks\.\d+\.mlp\.fc2": tplayers.RowParallel(),
}


def synthetic_batch(gen: torch.Generator, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Sequences with a learnable rule: each token is (previous * 5 + 3) mod vocab, random start."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    steps = torch.arange(seq + 1)
    tokens = [start]
    for _ in steps[1:]:
        tokens.append((tokens[-1] * 5 + 3) % vocab)
    return torch.cat(tokens, 1)  # (batch, seq + 1)


def gathered_params(model: nn.Module, grads: bool = False) -> dict:
    """Serial-layout copy of every parameter, or of its gradient (sharded ones all-gathered)."""
    out = {}
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = p.grad if grads else p.detach()
            if isinstance(mod, ShardedModule):
                spec = mod.shard_specs()[p_name]
                if spec.dim is not None:
                    sizes = shard_sizes(spec.global_shape[spec.dim], spec.parts)
                    full = all_gather_along_dim(full.contiguous(), spec.dim, sizes, mod.mesh.get_group(0))
            out[f"{mod_name}.{p_name}" if mod_name else p_name] = full
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=97)
    args = parser.parse_args()

    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.heads % world:
        raise SystemExit(f"--heads ({args.heads}) must be divisible by the world size ({world}) for this model")

    torch.manual_seed(0)  # same seed everywhere: identical serial model and data on every rank
    serial = TinyGPT(args.vocab, args.dim, args.heads, args.layers, args.seq)
    tplayers.explain(serial, PLAN, mesh, print_table=rank == 0)
    model = tplayers.parallelize_module(copy.deepcopy(serial), PLAN, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after parallelize_module
    opt_serial = torch.optim.AdamW(serial.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)

    # --- Parity on the first step -------------------------------------------------
    batch = synthetic_batch(gen, args.batch, args.seq, args.vocab)
    inp, target = batch[:, :-1], batch[:, 1:]
    results = []
    for m in (serial, model):
        logits = m(inp)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))
        loss.backward()
        results.append((loss.item(), logits.detach()))
    logit_diff = (results[0][1] - results[1][1]).abs().max().item()
    grads = gathered_params(model, grads=True)
    # Relative to the largest gradient of the model (some gradients, like the key bias's, are
    # zero up to rounding, so a per-tensor relative error would only measure noise).
    scale = max(p.grad.abs().max().item() for p in serial.parameters())
    grad_diff = max((p.grad - grads[k]).abs().max().item() for k, p in serial.named_parameters()) / scale
    opt_serial.step(), opt.step()
    opt_serial.zero_grad(), opt.zero_grad()
    params = gathered_params(model)
    param_diff = max((p.detach() - params[k]).abs().max().item() for k, p in serial.named_parameters())
    say(
        f"parity step 1: loss serial {results[0][0]:.6f} parallel {results[1][0]:.6f} | "
        f"max |logit diff| {logit_diff:.1e} | max relative grad diff {grad_diff:.1e} | "
        f"max |param diff| after AdamW {param_diff:.1e} (AdamW's first step is ~lr*sign(grad): fp32 "
        f"rounding in near-zero gradients can move a parameter by up to lr={opt.defaults['lr']:g})"
    )
    if logit_diff > 1e-4 or grad_diff > 1e-3:
        raise SystemExit("parity check FAILED")
    del serial, opt_serial

    # --- Training -----------------------------------------------------------------
    tokens, t0 = 0, time.perf_counter()
    for step in range(2, args.steps + 1):
        batch = synthetic_batch(gen, args.batch, args.seq, args.vocab)
        inp, target = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(model(inp).reshape(-1, args.vocab), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        tokens += inp.numel()
        if step % 10 == 0 or step == args.steps:
            rate = tokens / (time.perf_counter() - t0)
            say(f"step {step:4d} | loss {loss.item():.4f} | {rate:,.0f} tokens/s on {world} ranks")
    say("done")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
