"""An FNO layer's training step on an H-sharded grid: 2 ranks vs one process vs gathering the field.

    torchrun --nproc-per-node 2 benchmarks/spectral.py [--repeats 5] [--sizes 128 256]

The layer (fp32, one thread per process): ``gelu(SpectralConv2d(x) + Conv2d1x1(x))`` on (N, C, H, W),
the FNO paper's spectral convolution keeping ``modes x modes`` modes. Forward + backward of:

- ``1 proc``: the serial layer on the whole grid in one process (every rank runs it at once, on its
  own core, so the figure is what one process costs while the others are busy too);
- ``1 proc trunc``: the same layer in one process computed the way tplayers does it (``rfft`` along W,
  keep the ``modes`` columns, ``fft`` along H of those only), so ``1 proc trunc / tplayers`` is the
  speed-up of the sharding alone, without the algorithmic saving of skipping the discarded columns;
- ``gather``: all-gather the field to every rank, the serial layer, keep this rank's rows;
- ``tplayers``: ``tplayers.functional.spectral_conv2d`` on this rank's rows (only the kept
  ``modes`` columns of the spectrum travel) plus the local 1x1 conv.

Also the bytes each rank sends per step: tplayers' all-to-alls against the all-to-all minimum of a
distributed ``rfft2`` of the whole spectrum (``W // 2 + 1`` columns), and the gather's. Medians of
interleaved repeats; the step time is the max over ranks.
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
import tplayers.functional as TF


class SpectralConv2d(nn.Module):
    def __init__(self, c: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weights1 = nn.Parameter(torch.rand(c, c, modes, modes, dtype=torch.cfloat) / (c * c))
        self.weights2 = nn.Parameter(torch.rand(c, c, modes, modes, dtype=torch.cfloat) / (c * c))

    def forward(self, x):
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        out = torch.zeros(x.size(0), self.weights1.size(1), x.size(-2), x.size(-1) // 2 + 1, dtype=x_ft.dtype)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights1)
        out[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], self.weights2)
        return torch.fft.irfft2(out, s=(x.size(-2), x.size(-1)))


def truncated(x, w1, w2, m):
    """``SpectralConv2d.forward`` transforming along H only the ``m`` kept columns (the same result)."""
    h, w = x.shape[-2:]
    t = torch.fft.fft(torch.fft.rfft(x, dim=3)[..., :m], dim=2)
    out = torch.zeros(x.size(0), w1.size(1), h, m, dtype=t.dtype)
    out[:, :, :m] = torch.einsum("bixy,ioxy->boxy", t[:, :, :m], w1)
    out[:, :, -m:] = torch.einsum("bixy,ioxy->boxy", t[:, :, -m:], w2)
    out = torch.fft.ifft(out, dim=2)
    out = torch.cat([out, out.new_zeros(out.shape[:3] + (w // 2 + 1 - m,))], 3)
    return torch.fft.irfft(out, n=w, dim=3)


class Layer(nn.Module):
    def __init__(self, c: int, modes: int) -> None:
        super().__init__()
        self.spectral = SpectralConv2d(c, modes)
        self.skip = nn.Conv2d(c, c, 1)

    def forward(self, x, sharded: bool = False, trunc: bool = False):
        s = self.spectral
        if sharded:
            y = TF.spectral_conv2d(x, s.weights1, s.weights2, s.modes, s.modes, shard_dims=2)
        elif trunc:
            y = truncated(x, s.weights1, s.weights2, s.modes)
        else:
            y = s(x)
        return F.gelu(y + self.skip(x))


def _timed(fn, reps: int, group) -> list:
    times = []
    for _ in range(reps):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(float(t))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--modes", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = mesh.get_group(0)
    if rank == 0:
        print(
            f"CPU ISA (torch.backends.cpu.get_cpu_capability): {torch.backends.cpu.get_cpu_capability()}; "
            f"torch {torch.__version__}; {world} ranks, 1 thread each; N={args.batch} C={args.channels} "
            f"modes={args.modes}"
        )
        print(
            "| grid | 1 proc (s) | 1 proc trunc (s) | gather (s) | tplayers (s) | speed-up vs 1 proc | "
            "vs 1 proc trunc | vs gather | tplayers sent / rank (MiB) | rfft2 all-to-all min (MiB) | "
            "gather sent (MiB) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        torch.manual_seed(0)
        layer = Layer(args.channels, args.modes)
        full = torch.randn(args.batch, args.channels, size, size)
        local = tplayers.shard(full, 2, mesh).contiguous()

        def serial():
            layer(full.requires_grad_(True)).sum().backward()

        def serial_trunc():
            layer(full.requires_grad_(True), trunc=True).sum().backward()

        def gathered():
            x = local.detach().requires_grad_(True)
            y = layer(tplayers.gather(x, 2, mesh))
            tplayers.shard(y, 2, mesh).sum().backward()

        def ours():
            x = local.detach().requires_grad_(True)
            layer(x, sharded=True).sum().backward()

        with torch.no_grad():  # the two forms agree before timing
            a = layer(local, sharded=True)
            b = tplayers.shard(layer(full), 2, mesh)
            c = tplayers.shard(layer(full, trunc=True), 2, mesh)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5)
        with tplayers.count_collectives() as log:
            ours()
        sent = log.bytes("all_to_all")
        with tplayers.count_collectives() as glog:
            gathered()
        gather_sent = glog.bytes("all_gather") * (world - 1) // world
        rows = local.size(2)
        minimum = 2 * args.batch * args.channels * rows * (size // 2 + 1) * (world - 1) // world * 8  # out and back
        results = {"1 proc": [], "1 proc trunc": [], "gather": [], "tplayers": []}
        for _ in range(args.repeats):  # interleaved
            results["1 proc"] += _timed(serial, 1, group)
            results["1 proc trunc"] += _timed(serial_trunc, 1, group)
            results["gather"] += _timed(gathered, 1, group)
            results["tplayers"] += _timed(ours, 1, group)
        med = {k: statistics.median(v) for k, v in results.items()}
        if rank == 0:
            mib = 1 << 20
            print(
                f"| {size}x{size} | {med['1 proc']:.3f} | {med['1 proc trunc']:.3f} | {med['gather']:.3f} | "
                f"{med['tplayers']:.3f} | {med['1 proc'] / med['tplayers']:.2f} | "
                f"{med['1 proc trunc'] / med['tplayers']:.2f} | {med['gather'] / med['tplayers']:.2f} | "
                f"{sent / mib:.2f} | {minimum / mib:.2f} | {gather_sent / mib:.2f} |"
            )


if __name__ == "__main__":
    main()
