"""A U-Net with a mid-block self-attention over all pixels, on an image split across ranks.

    torchrun --nproc-per-node 2 examples/unet_attention.py                    # attention by hand
    torchrun --nproc-per-node 2 examples/unet_attention.py --attention plan   # the plan alone
    python examples/unet_attention.py                                         # a world of one

The U-Net is ``examples/unet.py``'s with an attention block of our own after the mid block:
GroupNorm, a 1x1 conv to q/k/v, ``F.scaled_dot_product_attention`` over the flattened pixels
(every pixel attends to every pixel of the whole image), a 1x1 conv out, residual. With the image
split over H, each rank holds the queries of its rows; the keys and values of the other rows
live on the other ranks.

``--attention hand`` (default): the plan ``{"": DomainParallel(shard_dims=(2,))}`` swaps the
convolutions, norms and pools, and the attention block's ``attend`` is set by hand to
``tplayers.ContextParallelAttention(mesh=mesh)``: K/V blocks travel in a ring, exact.
``--attention plan``: the plan alone; exact once the domain region routes
``F.scaled_dot_product_attention`` on sharded tokens to ``tplayers.functional`` (the region
guard). The script prints the parity with the serial model (output, every parameter gradient),
asserts it, then trains a few steps with ``tplayers.domain_mean``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet import UNet, fields  # noqa: E402


class MidAttention(nn.Module):
    """Self-attention over all pixels of (N, C, H, W): norm, 1x1 q/k/v, SDPA, 1x1 out, residual.

    ``attend`` is the attention function (``F.scaled_dot_product_attention`` when None)."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(4, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.out = nn.Conv2d(channels, channels, 1)
        self.attend = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape  # h: this rank's rows
        qkv = self.qkv(self.norm(x)).reshape(n, 3, self.heads, c // self.heads, h * w)
        q, k, v = qkv.transpose(-1, -2).unbind(1)  # (N, heads, H*W, hd) each
        attend = self.attend if self.attend is not None else F.scaled_dot_product_attention
        y = attend(q, k, v)  # (N, heads, H*W, hd)
        return x + self.out(y.transpose(-1, -2).reshape(n, c, h, w))


class AttentionUNet(UNet):
    """``examples/unet.py``'s U-Net with :class:`MidAttention` after the mid block."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__(width=width, nd=2)
        self.mid_attn = MidAttention(2 * width, heads)

    def forward(self, x, t):
        e = self.embed(t)
        e1 = self.enc1(x, e)
        e2 = self.enc2(self.pool1(e1), e)
        m = self.mid_attn(self.mid(self.pool2(e2), e))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1), e)
        d1 = self.dec1(torch.cat([self.red1(self.up1(d2)), e1], 1), e)
        return self.head(d1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=("hand", "plan"), default="hand")
    parser.add_argument("--size", type=int, default=32, help="global image size (the mid block sees size/4)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu", timeout=timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same serial model everywhere
    serial = AttentionUNet().double()
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    if args.attention == "hand":
        model.mid_attn.attend = tplayers.ContextParallelAttention(mesh=mesh)
    if rank == 0:
        print(
            f"{world} rank(s); U-Net with mid-block attention over all {(args.size // 4) ** 2} mid pixels, "
            f"H of a {args.size}^2 image split over the ranks; attention: {args.attention}"
        )

    # 1) parity with the serial model (fp64): output, loss and every parameter gradient.
    gen = torch.Generator().manual_seed(1)
    clean = fields(2, args.size, 2, gen).double()
    t = torch.rand(2, generator=gen, dtype=torch.float64)
    noisy = clean + t.reshape(-1, 1, 1, 1) * torch.randn(clean.shape, generator=gen, dtype=torch.float64)
    out = model(tplayers.shard(noisy, 2, mesh), t)
    loss = tplayers.domain_mean(F.mse_loss(out, tplayers.shard(clean, 2, mesh), reduction="none"), mesh)
    ref = serial(noisy, t)
    ref_loss = F.mse_loss(ref, clean)
    loss.backward(), ref_loss.backward()
    err_out = (tplayers.gather(out.detach(), 2, mesh) - ref.detach()).abs().max().item()
    err_grad = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), serial.parameters()))
    if rank == 0:
        print(
            f"parity vs serial (fp64): max |dy| = {err_out:.2e}, |dloss| = {abs(loss.item() - ref_loss.item()):.2e}, "
            f"max |dgrad| = {err_grad:.2e}"
        )
    assert err_out < 1e-10 and err_grad < 1e-10, (err_out, err_grad)
    model.zero_grad()

    # 2) training: the exact global mean-squared error, the same scalar on every rank.
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # built AFTER parallelize_module
    for step in range(args.steps):
        clean = fields(4, args.size, 2, gen).double()
        t = torch.rand(4, generator=gen, dtype=torch.float64)
        noisy = clean + t.reshape(-1, 1, 1, 1) * torch.randn(clean.shape, generator=gen, dtype=torch.float64)
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
