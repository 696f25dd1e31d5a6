"""Domain-parallel U-Net (2-D, or 3-D with --dims 3): a denoiser conditioned on the noise level.

    torchrun --nproc-per-node 2 examples/unet.py              # 2-D, H sharded over 2 ranks
    torchrun --nproc-per-node 2 examples/unet.py --dims 3     # 3-D, D sharded
    python examples/unet.py                                   # a world of one

The U-Net has GroupNorm in every block, MaxPool, a ConvTranspose and a bilinear (trilinear)
Upsample on the way up, skip connections, and a time-embedding MLP whose output is added to
every block: a replicated branch meeting sharded features. One plan,
``{"": DomainParallel(shard_dims=(2,))}``, swaps every spatial layer for its twin (the norms
compute their statistics over the whole field) and wraps the replicated parameters applied to
sharded data. The script prints the parity with the serial model first (output, every parameter
gradient), then trains a few steps with the exact global loss ``tplayers.domain_mean``.
"""

from __future__ import annotations

import argparse
import copy
import math
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers


def _nn(name: str, nd: int):
    return getattr(nn, f"{name}{nd}d")


class Block(nn.Module):
    """conv -> GroupNorm -> SiLU -> + time embedding -> conv -> GroupNorm -> SiLU."""

    def __init__(self, cin: int, cout: int, emb: int, nd: int):
        super().__init__()
        self.conv1, self.norm1 = _nn("Conv", nd)(cin, cout, 3, padding=1), nn.GroupNorm(4, cout)
        self.emb = nn.Linear(emb, cout)
        self.conv2, self.norm2 = _nn("Conv", nd)(cout, cout, 3, padding=1), nn.GroupNorm(4, cout)

    def forward(self, x, emb):
        h = F.silu(self.norm1(self.conv1(x)))
        h = h + self.emb(emb).reshape(emb.shape[0], -1, *([1] * (h.dim() - 2)))
        return F.silu(self.norm2(self.conv2(h)))


class UNet(nn.Module):
    """Two levels down (MaxPool), up by ConvTranspose then by (bi/tri)linear Upsample, skips."""

    def __init__(self, cin: int = 1, cout: int = 1, width: int = 8, nd: int = 2, emb: int = 16):
        super().__init__()
        self.freqs = emb // 2
        self.temb = nn.Sequential(nn.Linear(emb, 2 * emb), nn.SiLU(), nn.Linear(2 * emb, emb))
        w1, w2 = width, 2 * width
        self.enc1, self.pool1 = Block(cin, w1, emb, nd), _nn("MaxPool", nd)(2)
        self.enc2, self.pool2 = Block(w1, w2, emb, nd), _nn("MaxPool", nd)(2)
        self.mid = Block(w2, w2, emb, nd)
        self.up2, self.dec2 = _nn("ConvTranspose", nd)(w2, w2, 2, stride=2), Block(2 * w2, w2, emb, nd)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear" if nd == 2 else "trilinear", align_corners=False)
        self.red1, self.dec1 = _nn("Conv", nd)(w2, w1, 1), Block(2 * w1, w1, emb, nd)
        self.head = _nn("Conv", nd)(w1, cout, 1)

    def embed(self, t: torch.Tensor) -> torch.Tensor:
        """Sinusoidal features of the noise level ``t`` (N,) -> MLP (replicated: same on every rank)."""
        k = torch.arange(self.freqs, dtype=t.dtype, device=t.device)
        ang = t[:, None] * torch.exp(-math.log(100.0) * k / self.freqs)[None] * 100
        return self.temb(torch.cat([ang.sin(), ang.cos()], 1))

    def forward(self, x, t):
        e = self.embed(t)
        e1 = self.enc1(x, e)
        e2 = self.enc2(self.pool1(e1), e)
        m = self.mid(self.pool2(e2), e)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1), e)
        d1 = self.dec1(torch.cat([self.red1(self.up1(d2)), e1], 1), e)
        return self.head(d1)


def fields(n: int, size: int, nd: int, gen: torch.Generator) -> torch.Tensor:
    """Smooth synthetic fields: a few random low Fourier modes on a ``size``^nd grid."""
    axes = torch.meshgrid(*[torch.arange(size, dtype=torch.float32)] * nd, indexing="ij")
    out = torch.zeros((n, 1) + (size,) * nd)
    for _ in range(5):
        k = torch.randint(1, 4, (nd,), generator=gen).tolist()
        phase = 2 * math.pi * torch.rand((n, 1) + (1,) * nd, generator=gen)
        out += torch.rand((n, 1) + (1,) * nd, generator=gen) * torch.sin(
            2 * math.pi * sum(ki * a for ki, a in zip(k, axes)) / size + phase
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, default=2, choices=(2, 3), help="2-D U-Net or 3-D (sharded along D)")
    parser.add_argument("--size", type=int, default=0, help="global grid size (default 32 for 2-D, 12 for 3-D)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    size = args.size or (32 if args.dims == 2 else 12)
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu", timeout=timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same serial model on every rank
    serial = UNet(nd=args.dims)
    plan = {"": tplayers.DomainParallel(shard_dims=(2,))}
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    if rank == 0:
        print(f"{world} rank(s); {args.dims}-D U-Net, each rank holds a slab of dim 2 of a {size}^{args.dims} field")

    # 1) parity with the serial model: output, loss and every parameter gradient.
    gen = torch.Generator().manual_seed(1)
    clean = fields(2, size, args.dims, gen)
    t = torch.rand(2, generator=gen)
    noisy = clean + t.reshape(-1, *([1] * (clean.dim() - 1))) * torch.randn(clean.shape, generator=gen)
    out = model(tplayers.shard(noisy, 2, mesh), t)
    loss = tplayers.domain_mean(F.mse_loss(out, tplayers.shard(clean, 2, mesh), reduction="none"), mesh)
    ref = serial(noisy, t)
    ref_loss = F.mse_loss(ref, clean)
    loss.backward(), ref_loss.backward()
    err_out = (tplayers.gather(out.detach(), 2, mesh) - ref.detach()).abs().max().item()
    err_grad = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), serial.parameters()))
    if rank == 0:
        print(
            f"parity vs serial: max |dy| = {err_out:.2e}, |dloss| = {abs(loss.item() - ref_loss.item()):.2e}, "
            f"max |dgrad| = {err_grad:.2e}"
        )
    assert err_out < 1e-4 and err_grad < 1e-4, (err_out, err_grad)
    model.zero_grad()

    # 2) training: the exact global mean-squared error, the same scalar on every rank.
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # built AFTER parallelize_module
    for step in range(args.steps):
        clean = fields(4, size, args.dims, gen)  # same generator state on every rank
        t = torch.rand(4, generator=gen)
        noisy = clean + t.reshape(-1, *([1] * (clean.dim() - 1))) * torch.randn(clean.shape, generator=gen)
        out = model(tplayers.shard(noisy, 2, mesh), t)
        loss = tplayers.domain_mean(F.mse_loss(out, tplayers.shard(clean, 2, mesh), reduction="none"), mesh)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.5f}")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
