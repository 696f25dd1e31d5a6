"""A whole FNO training step as its package writes it: neuraloperator's ``FNO`` under
``{"": DomainParallel}`` at N ranks against one process and against gathering the field.

    torchrun --nproc-per-node 2 benchmarks/fno_model.py [--repeats 5] [--sizes 128 256]

fp32 (neuraloperator hard-codes complex64), one thread per process. One step is forward, backward and an
AdamW step of ``FNO(n_modes=(modes, modes), hidden_channels=C, n_layers=4)`` with its grid positional
embedding, on ``(N, 1, S, S)`` inputs sharded along H:

- ``1 proc``: the serial model on the whole grid in one process (every rank runs it at once, on its own
  core, so the figure is what one process costs while the others are busy too);
- ``gather``: all-gather the field to every rank, the serial model, keep this rank's rows of the output
  (the gradient of the kept rows only, summed: what a user without domain parallelism would do to fit the
  model's parameters in every process);
- ``tplayers``: the same model object parallelized with ``{"": DomainParallel(shard_dims=(2,))}``, its
  code unchanged (the region guard routes its FFTs, slices, grid and 1x1 convs).

Also the bytes each rank sends per step. Medians of interleaved repeats; a step's time is the max over
ranks. The outputs of the three agree before timing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

import tplayers


def _timed(fn, group) -> float:
    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def main() -> None:
    from neuralop.models import FNO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--modes", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = mesh.get_group(0)
    if rank == 0:
        print(
            f"CPU ISA (torch.backends.cpu.get_cpu_capability): {torch.backends.cpu.get_cpu_capability()}; "
            f"torch {torch.__version__}; {world} ranks, 1 thread each; neuraloperator FNO, N={args.batch} "
            f"C={args.channels} modes={args.modes} layers=4, fp32"
        )
        print(
            "| grid | 1 proc (s) | gather (s) | tplayers (s) | speed-up vs 1 proc | vs gather | tplayers sent / rank (MiB) |"
        )
        print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        torch.manual_seed(0)
        serial = FNO(n_modes=(args.modes, args.modes), hidden_channels=args.channels, in_channels=1, out_channels=1)
        parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
        opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-4)
        opt_p = torch.optim.AdamW(parallel.parameters(), lr=1e-4)
        full = torch.randn(args.batch, 1, size, size)
        local = tplayers.shard(full, 2, mesh).contiguous()

        def one_proc():
            (serial(full) ** 2).mean().backward()
            opt_s.step(), opt_s.zero_grad()

        def gathered():
            x = tplayers.gather(local, 2, mesh)
            y = tplayers.shard(serial(x), 2, mesh)
            (y**2).sum().backward()
            for p in serial.parameters():  # every rank's rows: the full gradient
                dist.all_reduce(p.grad, group=group)
            opt_s.step(), opt_s.zero_grad()

        def ours():
            (tplayers.domain_sum(parallel(local) ** 2) / full.numel()).backward()
            opt_p.step(), opt_p.zero_grad()

        with torch.no_grad():
            torch.testing.assert_close(parallel(local), tplayers.shard(serial(full), 2, mesh), rtol=1e-3, atol=1e-4)
        with tplayers.count_collectives() as log:
            ours()
        sent = log.bytes()
        times = {"1 proc": [], "gather": [], "tplayers": []}
        for _ in range(args.repeats):  # interleaved
            times["1 proc"].append(_timed(one_proc, group))
            times["gather"].append(_timed(gathered, group))
            times["tplayers"].append(_timed(ours, group))
        med = {k: statistics.median(v) for k, v in times.items()}
        if rank == 0:
            print(
                f"| {size}x{size} | {med['1 proc']:.3f} | {med['gather']:.3f} | {med['tplayers']:.3f} | "
                f"{med['1 proc'] / med['tplayers']:.2f} | {med['gather'] / med['tplayers']:.2f} | "
                f"{sent / (1 << 20):.2f} |"
            )


if __name__ == "__main__":
    main()
