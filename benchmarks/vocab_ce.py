"""Vocab-parallel cross-entropy: tplayers vs DTensor ``loss_parallel`` vs gathering the logits, same run.

    python benchmarks/vocab_ce.py            # spawns 2 gloo ranks on the CPU

Each rank holds ``(tokens, vocab / 2)`` fp32 logits (what a column-parallel
``lm_head`` returns). Forward + backward of the mean cross-entropy with
label smoothing 0 (``loss_parallel`` has none) by:

- ``tplayers.vocab_parallel_cross_entropy`` (2 all-reduces of ``tokens`` and ``3 x tokens`` floats),
- PyTorch ``loss_parallel()`` around ``F.cross_entropy`` on a ``Shard(-1)`` DTensor,
- a full gather: all-gather the logits (``tokens x vocab`` on every rank), ``F.cross_entropy``.

Values and gradients are checked equal before timing. Prints median step
times (max over ranks) of interleaved repeats, the ratios to tplayers, and
per-rank peak extra memory is implied by the gather's ``tokens x vocab`` buffer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from tp_mlp import CollectiveBytes  # counts DTensor's functional collectives

import tplayers
from tplayers.comm import gather_along_dim

SIZES = {
    # name: (tokens, vocab, repeats)
    "GPT-2 vocab 50304, 2048 tokens": (2048, 50304, 7),
    "small: vocab 4096, 256 tokens": (256, 4096, 40),
}


def run_tplayers(local, target, mesh):
    local.grad = None
    tplayers.vocab_parallel_cross_entropy(local, target, mesh).backward()
    return local.grad


def run_dtensor(local, target, mesh):
    local.grad = None
    dt = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)
    with loss_parallel():
        loss = F.cross_entropy(dt, target)
        loss.backward()
    return local.grad


def run_gather(local, target, mesh):
    local.grad = None
    full = gather_along_dim(local, -1, mesh.get_group(0))  # (tokens, vocab) on every rank
    F.cross_entropy(full, target).backward()
    return local.grad


RUNNERS = {"tplayers": run_tplayers, "dtensor": run_dtensor, "gather": run_gather}


def timed(fn, *args) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bench(rank: int, world: int, init_file: str, threads: int, quick: bool) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = tplayers.init_mesh(device_type="cpu")
    for label, (tokens, vocab, repeats) in SIZES.items():
        if quick:
            repeats = 2
        torch.manual_seed(0)
        full = torch.randn(tokens, vocab) * 2
        target = torch.randint(0, vocab, (tokens,))
        local = tplayers.ShardSpec.balanced(full.shape, 1, world, rank).take(full).clone().requires_grad_(True)
        grads = {name: fn(local, target, mesh).clone() for name, fn in RUNNERS.items()}
        for name in ("dtensor", "gather"):
            torch.testing.assert_close(grads["tplayers"], grads[name], rtol=1e-4, atol=1e-7)
        with tplayers.count_collectives() as log:
            run_tplayers(local, target, mesh)
        with CollectiveBytes() as dt_log:
            run_dtensor(local, target, mesh)
        times = {name: [] for name in RUNNERS}
        names = list(RUNNERS)
        for i in range(repeats):
            for name in names[i % 3 :] + names[: i % 3]:  # rotate the order so load hits all alike
                times[name].append(timed(RUNNERS[name], local, target, mesh))
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\n== {label} (fp32, {world} ranks, {threads} thread(s) per rank, {repeats} repeats)")
            print(
                f"  tplayers vocab_parallel_cross_entropy  {med['tplayers'] * 1e3:9.2f} ms  collectives: "
                + ", ".join(f"{k} x{c} ({b / 2**10:.1f} KiB)" for k, (c, b) in log.summary().items())
            )
            print(
                f"  DTensor loss_parallel                  {med['dtensor'] * 1e3:9.2f} ms  collectives: "
                + ", ".join(f"{k} x{c} ({b / 2**10:.1f} KiB)" for k, (c, b) in dt_log.log.items())
            )
            print(
                f"  all-gather + F.cross_entropy           {med['gather'] * 1e3:9.2f} ms  "
                f"(gathers {tokens * vocab * 4 / 2**20:.0f} MiB of logits per rank)"
            )
            for name in ("dtensor", "gather"):
                pairs = sorted(a / b for a, b in zip(times["tplayers"], times[name]))
                print(
                    f"  ratio tplayers / {name:8s} = {med['tplayers'] / med[name]:.3f}  "
                    f"(per-repeat pairs {pairs[0]:.3f}-{pairs[-1]:.3f})"
                )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="2 repeats (smoke test)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(bench, args=(args.world, os.path.join(tmp, "rdzv"), args.threads, args.quick), nprocs=args.world)


if __name__ == "__main__":
    main()
