"""Domain-parallel CNN: learn one step of periodic 2-D diffusion on a field split across ranks.

    torchrun --nproc-per-node 2 examples/domain_cnn.py        # CPU, gloo
    python examples/domain_cnn.py                             # a world of one

A small encoder-decoder (circular convolutions, a stride-2 bottleneck, nearest
upsampling, a per-pixel channel mix) is swapped to domain parallelism with
``DomainParallel(shard_dims=(2,))``: every rank holds a band of rows of the
field. The script first checks the swapped model against the serial one (the
gathered output and every parameter gradient), then trains a few steps with
the loss summed over ranks.
"""

from __future__ import annotations

import argparse
import copy
import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import tplayers


class EncoderDecoder(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.enc = nn.Conv2d(1, width, 3, padding=1, padding_mode="circular")
        self.down = nn.Conv2d(width, width, 4, stride=2, padding=1, padding_mode="circular")
        self.mid = nn.Conv2d(width, width, 3, padding=2, dilation=2, padding_mode="circular")
        self.up = nn.Upsample(scale_factor=2, mode="nearest")  # per-row: exact on a band of rows
        self.mix = nn.Linear(2 * width, width)  # per-pixel channel mix (a replicated parameter)
        self.dec = nn.Conv2d(width, 1, 3, padding=1, padding_mode="circular")

    def forward(self, u):  # u: (N, 1, H_local, W)
        h = torch.nn.functional.gelu(self.enc(u))  # (N, w, H_local, W)
        z = torch.nn.functional.gelu(self.mid(torch.nn.functional.gelu(self.down(h))))  # (N, w, H/2 local, W/2)
        h = torch.cat([h, self.up(z)], 1).permute(0, 2, 3, 1)  # (N, H_local, W, 2w)
        h = torch.nn.functional.gelu(self.mix(h)).permute(0, 3, 1, 2)  # (N, w, H_local, W)
        return u + self.dec(h)


def diffusion_step(u: torch.Tensor, nu: float = 0.2) -> torch.Tensor:
    """One explicit step of periodic diffusion (the target the model learns)."""
    lap = sum(torch.roll(u, s, d) for s in (1, -1) for d in (2, 3)) - 4 * u
    return u + nu * lap


def smooth_fields(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """Random periodic fields: a few low Fourier modes."""
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    out = torch.zeros(n, 1, size, size)
    for _ in range(6):
        kx, ky = torch.randint(1, 5, (2,), generator=generator).tolist()
        amp, phase = (
            torch.rand(n, 1, 1, 1, generator=generator),
            2 * math.pi * torch.rand(n, 1, 1, 1, generator=generator),
        )
        out += amp * torch.sin(2 * math.pi * (kx * x + ky * y) / size + phase)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=96, help="global field is size x size")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(
        device_type="cpu", timeout=timedelta(minutes=2)
    )  # a stalled peer fails in minutes, not 30
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same serial model on every rank
    serial = EncoderDecoder()
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    if rank == 0:
        print(f"{world} rank(s); each holds a band of rows of a {args.size}x{args.size} field")
        tplayers.explain(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)

    # 1) parity with the serial model: output and every parameter gradient.
    gen = torch.Generator().manual_seed(1)
    full = smooth_fields(2, args.size, gen)
    local = tplayers.scatter(full if rank == 0 else None, 2, mesh)  # rank 0 holds the data
    out = tplayers.gather(model(local), 2, mesh)
    ref = serial(full)
    out.square().mean().backward()
    ref.square().mean().backward()
    err_out = (out - ref).abs().max().item()
    err_grad = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), serial.parameters()))
    if rank == 0:
        print(f"parity vs serial: max |dy| = {err_out:.2e}, max |dgrad| = {err_grad:.2e}")
    assert err_out < 1e-4 and err_grad < 1e-4, (err_out, err_grad)
    model.zero_grad()

    # 2) training: each rank computes the loss of its rows; their sum is the global loss.
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # built AFTER parallelize_module
    for step in range(args.steps):
        u = smooth_fields(4, args.size, gen)  # same generator state on every rank
        target = diffusion_step(u)
        u_local, t_local = tplayers.shard(u, 2, mesh), tplayers.shard(target, 2, mesh)
        loss = (model(u_local) - t_local).square().sum() / target.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total.item():.6f}")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
