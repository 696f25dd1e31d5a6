"""Tensor-parallel MLP block: tplayers vs PyTorch DTensor, same weights, same run.

    python benchmarks/tp_mlp.py            # spawns 2 gloo ranks on the CPU

For each size, forward + backward of ``Linear(h, f) -> GELU -> Linear(f, h)``
split Megatron-style (column then row) on 2 ranks: tplayers
``parallelize_module`` with ColumnParallel/RowParallel vs
``torch.distributed.tensor.parallel.parallelize_module`` with
ColwiseParallel/RowwiseParallel. Prints median step times (max over ranks),
the ratio tplayers / DTensor (< 1 means tplayers is faster), and the
collectives and bytes each issues per step. Runs are interleaved so machine
load hits both alike.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module as dtensor_parallelize
from torch.utils._python_dispatch import TorchDispatchMode

import tplayers

SIZES = {
    # name: (hidden, ffn, tokens (batch * seq), repeats)
    "compute-bound 1024->4096->1024, 64x128 tokens": (1024, 4096, 64 * 128, 7),
    "overhead-bound 256->1024->256, 32 tokens": (256, 1024, 32, 300),
}


class CollectiveBytes(TorchDispatchMode):
    """Counts the c10d functional collectives DTensor issues and the bytes of their inputs."""

    def __init__(self):
        super().__init__()
        self.log = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops and collectives first
        name = func._overloadpacket.__name__
        is_collective = name.startswith(("all_", "reduce_scatter", "broadcast"))
        if func.namespace == "_c10d_functional" and is_collective:
            entry = self.log[name]
            entry[0] += 1
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            entry[1] += sum(t.numel() * t.element_size() for t in tensors[:1])
        return func(*args, **(kwargs or {}))


def mlp(hidden: int, ffn: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


def step(model: nn.Module, x: torch.Tensor) -> None:
    x.grad = None
    model(x).sum().backward()


def timed(model: nn.Module, x: torch.Tensor) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(model, x)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return elapsed.item()


def bench(rank: int, world: int, init_file: str, threads: int, quick: bool) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = tplayers.init_mesh(device_type="cpu")
    for label, (hidden, ffn, tokens, repeats) in SIZES.items():
        if quick:
            repeats = max(2, repeats // 10)
        torch.manual_seed(0)
        serial = mlp(hidden, ffn)
        ours = tplayers.parallelize_module(
            copy.deepcopy(serial), {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}, mesh=mesh
        )
        theirs = dtensor_parallelize(copy.deepcopy(serial), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(tokens, hidden, requires_grad=True)
        # Same function: check both against each other before timing.
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)

        with tplayers.count_collectives() as log:
            step(ours, x)
        with CollectiveBytes() as dt_log:
            step(theirs, x)
        for _ in range(2):  # warm-up
            step(ours, x), step(theirs, x)
        times = {"tplayers": [], "dtensor": []}
        for i in range(repeats):
            order = ("tplayers", "dtensor") if i % 2 == 0 else ("dtensor", "tplayers")
            for name in order:
                times[name].append(timed(ours if name == "tplayers" else theirs, x))
        if rank == 0:
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\n== {label} (fp32, {world} ranks, {threads} thread(s) per rank, {repeats} interleaved repeats)")
            print(
                f"  tplayers fwd+bwd median {med['tplayers'] * 1e3:9.3f} ms   collectives/step: "
                + ", ".join(f"{k} x{c} ({b / 2**20:.3f} MiB)" for k, (c, b) in log.summary().items())
            )
            print(
                f"  DTensor  fwd+bwd median {med['dtensor'] * 1e3:9.3f} ms   collectives/step: "
                + ", ".join(f"{k} x{c} ({b / 2**20:.3f} MiB)" for k, (c, b) in dt_log.log.items())
            )
            paired = sorted(a / b for a, b in zip(times["tplayers"], times["dtensor"]))
            print(
                f"  ratio tplayers / DTensor = {med['tplayers'] / med['dtensor']:.3f}   (per-repeat pairs: "
                f"median {statistics.median(paired):.3f}, range {paired[0]:.3f}-{paired[-1]:.3f})"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(bench, args=(args.world, os.path.join(tmp, "rdzv"), args.threads, args.quick), nprocs=args.world)


if __name__ == "__main__":
    main()
