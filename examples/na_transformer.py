"""A small neighborhood-attention transformer on a synthetic image, domain-parallel over H.

    torchrun --nproc-per-node 2 examples/na_transformer.py     # 2 ranks (gloo on the CPU)
    python examples/na_transformer.py                          # a world of one, same code

Each rank holds a horizontal slice of the image. ``parallelize_module`` with
``DomainParallel(shard_dims=(2,))`` (H, in NCHW names) swaps every NeighborhoodAttention for its
H-sharded twin, which exchanges only K/V halos (widths per rank, from global positions), and wraps
the per-pixel layers (LayerNorm, MLP) so their replicated parameters' gradients are summed over
the domain. The script checks parity against the same model run on the full image on one
device, then trains a few steps to denoise a synthetic pattern.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import tplayers


class Block(nn.Module):
    """Pre-norm transformer block: neighborhood attention + MLP, on (B, H, W, C)."""

    def __init__(self, dim, heads, kernel, dilation, mesh=None, shard_dims=None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = tplayers.NeighborhoodAttention(
            dim, heads, kernel, dilation, rel_pos_bias=True, mesh=mesh, shard_dims=shard_dims
        )
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class NATransformer(nn.Module):
    def __init__(self, channels=3, dim=32, heads=4, depth=2, kernel=5):
        super().__init__()
        self.embed = nn.Linear(channels, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kernel, dilation=1 + i % 2) for i in range(depth))
        self.head = nn.Linear(dim, channels)

    def forward(self, x):  # (B, H, W, channels)
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def synthetic_batch(gen, batch=2, height=24, width=20):
    """Smooth random patterns plus noise; the target is the clean pattern."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    freq = torch.rand(batch, 3, 2, generator=gen) * 6
    clean = torch.sin(freq[..., 0, None, None] * yy * 6.28 + freq[..., 1, None, None] * xx * 6.28)
    clean = clean.permute(0, 2, 3, 1)  # (B, H, W, 3)
    return clean + 0.3 * torch.randn(clean.shape, generator=gen), clean


def main():
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    rank = dist.get_rank()
    torch.manual_seed(0)  # same serial model on every rank
    serial = NATransformer().double()
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )

    # Parity: outputs and every gradient against the single-device model on the full image.
    gen = torch.Generator().manual_seed(1)
    noisy, clean = (t.double() for t in synthetic_batch(gen))
    loss_s = ((serial(noisy) - clean) ** 2).sum()
    loss_s.backward()
    mine = tplayers.shard(noisy, 1, mesh)
    out = model(mine)
    loss_p = ((out - tplayers.shard(clean, 1, mesh)) ** 2).sum()
    loss_p.backward()
    torch.testing.assert_close(tplayers.gather(out.detach(), 1, mesh), serial(noisy).detach(), rtol=1e-9, atol=1e-10)
    for (name, p), q in zip(model.named_parameters(), serial.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}")
    if rank == 0:
        print(f"parity OK on {mesh.size(0)} rank(s): outputs and all {len(list(model.parameters()))} parameter grads")

    # A few training steps (optimizer built after parallelize_module).
    model = model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(8):
        noisy, clean = synthetic_batch(gen)
        pred = model(tplayers.shard(noisy, 1, mesh))
        local = ((pred - tplayers.shard(clean, 1, mesh)) ** 2).sum()
        opt.zero_grad()
        local.backward()
        opt.step()
        total = local.detach().clone()
        if mesh.size(0) > 1:
            dist.all_reduce(total, group=mesh.get_group(0))
        if rank == 0:
            print(f"step {step}: loss per pixel {total.item() / clean.numel():.4f}")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
