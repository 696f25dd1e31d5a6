"""Overhead-bound DistributedConv2d step vs its structural minimum (issue 13 item 2, 2 ranks).

    torchrun --nproc-per-node 2 benchmarks/conv_overhead.py [--repeats 9] [--iters 100]

The default twin's forward+backward (halo-padded at this size) is: one halo exchange, the local
convolution, its backward, one exchange carrying the adjoint halo and the weight+bias
gradients. This script times, interleaved in one run (medians; wall and this thread's CPU
time per step, mean of the ranks):

- ``tplayers``: ``DistributedConv2d`` fwd+bwd on (1, 8, 64, 64) -> 8 channels, 3x3;
- ``limit``: the same work with nothing else: the local convolution fwd+bwd on a slab of the
  halo-padded size in the twin's layout, each half followed by one bare gloo exchange of the
  same message sizes with the peer (what any halo scheme over gloo must do);
- ``exchange``: the two bare exchanges alone (back to back, no compute between).

and prints ``tplayers / limit`` (1.0 = no overhead beyond the structural minimum) and the
per-step overhead ``tplayers - limit`` in ms and in CPU ms (the part this library controls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers

SHAPE = (1, 8, 64, 64, 8, 3)  # N, C_in, H, W, C_out, k: the overhead-bound shape of conv_halo.py


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run on 2 ranks"
    n, c, h, w, co, k = SHAPE
    torch.manual_seed(0)
    serial = nn.Conv2d(c, co, k, padding=k // 2)
    conv = tplayers.DistributedConv2d.from_module(serial, mesh=mesh)
    x = torch.randn(n, c, h, w)
    local = x.chunk(world, dim=2)[rank].clone().requires_grad_(True)
    with torch.no_grad():
        torch.testing.assert_close(conv(local), serial(x).chunk(world, dim=2)[rank], rtol=1e-4, atol=1e-4)

    fmt = conv.memory_format or torch.contiguous_format  # None: the input's layout (contiguous here)
    slab = torch.randn(n, c, h // world + 2 * (k // 2), w).contiguous(memory_format=fmt).requires_grad_(True)
    weight = serial.weight.detach().contiguous(memory_format=fmt).requires_grad_(True)
    bias = serial.bias.detach().clone().requires_grad_(True)
    group, peer = dist.group.WORLD, 1 - rank
    halo = torch.randn(n * c * w * (k // 2))  # one face each way
    grads = torch.randn(halo.numel() + weight.numel() + bias.numel())  # the adjoint face + weight + bias
    got_h, got_g = torch.empty_like(halo), torch.empty_like(grads)

    def exchange(mine, theirs):
        works = [group.recv([theirs], peer, 3), group.send([mine], peer, 3)]
        for work in works:
            work.wait()

    def step_tpl():
        conv(local).sum().backward()

    def step_limit():
        exchange(halo, got_h)
        y = F.conv2d(slab, weight, bias, padding=(0, k // 2))
        y.sum().backward()
        exchange(grads, got_g)

    def step_exchange():
        exchange(halo, got_h)
        exchange(grads, got_g)

    steps = {"tplayers": step_tpl, "limit": step_limit, "exchange": step_exchange}
    for fn in steps.values():
        for _ in range(20):
            fn()
    wall = {key: [] for key in steps}
    cpu = {key: [] for key in steps}
    for r in range(args.repeats):
        for key, fn in steps.items() if r % 2 == 0 else reversed(steps.items()):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.iters):
                fn()
            c1 = time.thread_time()
            dist.barrier()
            wall[key].append((time.perf_counter() - t0) / args.iters * 1e3)
            cpu[key].append((c1 - c0) / args.iters * 1e3)
    med = torch.tensor(
        [[statistics.median(wall[key]), statistics.median(cpu[key])] for key in steps], dtype=torch.float64
    )
    dist.all_reduce(med)
    med /= world
    if rank == 0:
        print(
            f"# overhead-bound DistributedConv2d fwd+bwd, {world} ranks (gloo, 1 thread each), "
            f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}"
        )
        print(f"{'step':10s} {'wall ms':>8s} {'CPU ms':>8s}")
        for i, key in enumerate(steps):
            print(f"{key:10s} {med[i, 0]:8.3f} {med[i, 1]:8.3f}")
        (tw, tc), (lw, lc) = med[0].tolist(), med[1].tolist()
        print(f"\n{'ratio':28s} {'value':>6s} {'limit':>6s}")
        print(f"{'tplayers / limit (wall)':28s} {tw / lw:6.2f} {1.0:6.2f}")
        print(f"{'tplayers / limit (CPU)':28s} {tc / lc:6.2f} {1.0:6.2f}")
        print(f"overhead per step: {tw - lw:.3f} ms wall, {tc - lc:.3f} ms CPU")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
