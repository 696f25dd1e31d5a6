"""Full attention over H-sharded pixels: a U-Net mid-block attention on 2 ranks vs one process.

    torchrun --nproc-per-node 2 benchmarks/attention.py [--repeats 3] [--sizes 64 128]

The block (fp32, one thread per process): tokens = pixels of (N, C, H, W), a fused q/k/v
projection, multi-head attention (head dim 64), out projection, residual. Forward + backward of:

- ``1 proc``: the serial block on all tokens in one process (torch's fused CPU SDPA kernel);
- ``gather``: gather K/V tokens (all-gather forward, reduce-scatter backward), then torch's SDPA
  on this rank's queries against all keys;
- ``ring`` / ``all_gather``: ``tplayers.functional.scaled_dot_product_attention`` with each algorithm.

Also bytes received per rank for K/V against the minimum (every other rank's K and V once), and
the CPU ISA torch dispatches to. Timings alternate variants and report medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers
from tplayers.comm import gather_from_sequence_region
from tplayers.functional import scaled_dot_product_attention


class MidBlockAttention(nn.Module):
    """Self-attention over the pixels of (N, C, H, W) with a residual (a U-Net mid-block's)."""

    def __init__(self, channels: int, head_dim: int = 64) -> None:
        super().__init__()
        self.heads = max(1, channels // head_dim)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)

    def forward(self, x, attend):
        n, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (N, H*W, C)
        q, k, v = self.qkv(tokens).view(n, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = attend(q, k, v)  # (N, heads, H*W, hd)
        y = self.out(y.transpose(1, 2).reshape(n, h * w, c))
        return x + y.transpose(1, 2).reshape(n, c, h, w)


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = mesh.get_group(0)
    if rank == 0:
        print(
            f"CPU ISA (torch.backends.cpu.get_cpu_capability): {torch.backends.cpu.get_cpu_capability()}; "
            f"torch {torch.__version__}; {world} ranks, 1 thread each"
        )
        print(
            "| N | C | tokens | 1 proc (s) | gather (s) | ring (s) | all_gather (s) | 1 proc / ring | "
            "ring / all_gather | ring recv / min | all_gather recv / min |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    configs = [(1, 64), (2, 128)]
    for side in args.sizes:
        for n, c in configs:
            if side >= 128 and n * c > 128:
                continue  # keep the 128^2 runs within minutes on one core per rank
            torch.manual_seed(0)
            block = MidBlockAttention(c)
            x = torch.randn(n, c, side, side)
            xl = tplayers.shard(x, 2, mesh)
            cot = torch.randn_like(xl)

            def step(attend, inp=xl, grad=cot):
                inp = inp.detach().requires_grad_()
                block(inp, attend).backward(grad)

            def gather_then_serial(q, k, v):
                kf = gather_from_sequence_region(k, 2, group)
                vf = gather_from_sequence_region(v, 2, group)
                return F.scaled_dot_product_attention(q, kf, vf)

            variants = {
                "gather": gather_then_serial,
                "ring": lambda q, k, v: scaled_dot_product_attention(q, k, v, mesh=mesh, algorithm="ring"),
                "all_gather": lambda q, k, v: scaled_dot_product_attention(q, k, v, mesh=mesh, algorithm="all_gather"),
            }
            times = {name: _median_time(lambda f=f: step(f), args.repeats) for name, f in variants.items()}
            # the serial block, in one process (rank 0; the other rank waits at the barrier)
            serial = float("nan")
            if rank == 0:
                serial = _median_time(
                    lambda: step(F.scaled_dot_product_attention, x, torch.randn_like(x)), args.repeats
                )
            dist.barrier()
            recv = {}
            for name in ("ring", "all_gather"):
                with tplayers.count_collectives() as log:
                    block(xl, variants[name])
                recv[name] = sum(
                    r.nbytes
                    for r in log.records
                    if r.kind == "recv" or (r.kind == "all_gather" and r.tag.startswith("attention.all_gather"))
                )
            heads, hd = block.heads, c // block.heads
            local_tokens = xl.size(2) * side
            minimum = (world - 1) * 2 * n * heads * local_tokens * hd * 4  # other ranks' K and V, once
            # an all-gather's record is the gathered buffer (own block included)
            recv["all_gather"] -= 2 * n * heads * local_tokens * hd * 4
            if rank == 0:
                print(
                    f"| {n} | {c} | {side}^2 | {serial:.3f} | {times['gather']:.3f} | {times['ring']:.3f} | "
                    f"{times['all_gather']:.3f} | {serial / times['ring']:.2f} | "
                    f"{times['ring'] / times['all_gather']:.2f} | {recv['ring'] / minimum:.2f} | "
                    f"{recv['all_gather'] / minimum:.2f} |",
                    flush=True,
                )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
