"""GPT-2-small block with tensor + sequence parallelism: tplayers vs PyTorch DTensor, same run.

    python benchmarks/tp_gpt2_block.py            # spawns 2 gloo ranks on the CPU, fp32

One GPT-2-small-shaped block (d=768, 12 heads, MLP 3072; the block of ``tests/gpt_block.py``)
forward + backward on a sequence-sharded input (B, S/2, 768) per rank:

- tplayers: ``parallelize_module`` with ``SequenceParallel()`` on the norms,
  ``ColumnParallel(sequence_parallel=True)`` on c_attn / c_fc and
  ``RowParallel(sequence_parallel=True)`` on the c_proj layers;
- DTensor: torchtitan's plan, its best for this block: ``SequenceParallel()`` on the norms,
  ``PrepareModuleInput(Shard(1) -> Replicate())`` on attn / mlp, ``ColwiseParallel`` and
  ``RowwiseParallel(output_layouts=Shard(1))``. (``loss_parallel`` acts on vocabulary logits;
  a block has none: it belongs to the vocab-parallel cross-entropy comparison.)

Both are checked against each other and the serial block before timing. Prints median step
times (max over ranks) of interleaved repeats, the ratio tplayers / DTensor, and the
collectives and bytes per step of each against Megatron's minimum for sequence parallelism:
per block, 2 all-gathers + 2 reduce-scatters of one (B, S, d) activation forward and the same
backward (plus the norms' small gradient all-reduce).

Then dropout's cost: :class:`tplayers.ParallelDropout`'s exact slice of the serial mask vs
``nn.Dropout`` on the full activation and on the local shard only (what a naive model does,
with the wrong mask), single process, same run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel import parallelize_module as dtensor_parallelize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the block under test: tests/gpt_block.py

from gpt_block import Block, sp_plan  # noqa: E402
from tp_mlp import CollectiveBytes  # noqa: E402

import tplayers  # noqa: E402
from tplayers.ops.dropout import dropout_slice  # noqa: E402

D, HEADS = 768, 12

DTENSOR_PLAN = {
    "ln_1": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.c_attn": ColwiseParallel(),
    "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    "ln_2": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.c_fc": ColwiseParallel(),
    "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
}


def step(model: nn.Module, x: torch.Tensor, cot: torch.Tensor, sum_partial: bool = True) -> None:
    x.grad = None
    for p in model.parameters():
        p.grad = None
    (model(x) * cot).sum().backward()
    for p in model.parameters() if sum_partial else ():
        # DTensor leaves the norms' gradients Partial (unsummed) after backward; any optimizer
        # step sums them first, so a step includes it (tplayers sums them in backward).
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate()] * len(p.grad.placements))


def timed(model, x, cot, sum_partial=True) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(model, x, cot, sum_partial)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def fmt(log: dict) -> str:
    return ", ".join(f"{k} x{c} ({b / 2**20:.2f} MiB)" for k, (c, b) in sorted(log.items())) or "-"


def bench(rank: int, world: int, init_file: str, batch: int, seq: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = tplayers.init_mesh(device_type="cpu")
    torch.manual_seed(0)
    serial = Block(D, HEADS)
    ours = tplayers.parallelize_module(copy.deepcopy(serial), sp_plan(HEADS), mesh=mesh)
    theirs = dtensor_parallelize(copy.deepcopy(serial), mesh, DTENSOR_PLAN)
    x_full = torch.randn(batch, seq, D)
    cot_full = torch.randn(batch, seq, D)
    start, stop = tplayers.shard_range(seq, world, rank)
    x = x_full[:, start:stop].clone().requires_grad_(True)
    cot = cot_full[:, start:stop].contiguous()
    ref = serial(x_full)[:, start:stop]
    torch.testing.assert_close(ours(x), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs(x), ref, rtol=1e-4, atol=1e-4)

    with tplayers.count_collectives() as log:
        step(ours, x, cot)
    with CollectiveBytes() as dt_log:
        step(theirs, x, cot)
    for _ in range(2):
        step(ours, x, cot), step(theirs, x, cot), step(theirs, x, cot, False)
    times = {"tplayers": [], "dtensor": [], "dtensor_unsummed": []}
    for i in range(repeats):
        names = list(times) if i % 2 == 0 else list(times)[::-1]
        for name in names:
            times[name].append(timed(ours if name == "tplayers" else theirs, x, cot, name != "dtensor_unsummed"))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        act = batch * seq * D * 4 / 2**20
        ln_grads = 2 * 2 * D * 4 / 2**20
        print(
            f"\n== GPT-2-small block (d={D}, {HEADS} heads, MLP {4 * D}), B={batch}, S={seq}, fp32, "
            f"{world} ranks x 1 thread, {repeats} interleaved repeats, fwd+bwd"
        )
        print(f"  tplayers median {med['tplayers'] * 1e3:8.1f} ms   {fmt(log.summary())}")
        dt = {k: (c, b * world if k.startswith("all_gather") else b) for k, (c, b) in dt_log.log.items()}
        print(f"  DTensor  median {med['dtensor'] * 1e3:8.1f} ms   {fmt(dt)}  (norm grads summed, as a step needs)")
        print(f"  DTensor  median {med['dtensor_unsummed'] * 1e3:8.1f} ms   (norm grads left Partial after backward)")
        print(
            "  (bytes: the buffer reduced or gathered, all ranks' pieces; tplayers' extra all_gathers are the "
            "per-call sequence lengths, one int64 per rank)"
        )
        print(
            f"  Megatron minimum: all_gather x4 ({4 * act:.2f} MiB), reduce_scatter x4 ({4 * act:.2f} MiB), "
            f"norm-grad all_reduce ({ln_grads:.3f} MiB)  [one (B,S,d) activation = {act:.2f} MiB]"
        )
        for other in ("dtensor", "dtensor_unsummed"):
            paired = sorted(a / b for a, b in zip(times["tplayers"], times[other]))
            print(
                f"  ratio tplayers / {other} = {med['tplayers'] / med[other]:.3f}   (per-repeat pairs: median "
                f"{statistics.median(paired):.3f}, range {paired[0]:.3f}-{paired[-1]:.3f})"
            )
    dist.destroy_process_group()


def dropout_cost(batch: int, seq: int, world: int, repeats: int) -> None:
    """ParallelDropout's exact slice vs nn.Dropout on the full tensor and on the local shard."""
    torch.set_num_threads(1)
    print(f"\n== dropout p=0.1, fp32, one process, medians of {repeats} (rank 0 of {world}'s slice)")
    for label, shape, dim in (
        ("MLP hidden (B,S,3072), features sharded", (batch, seq, 4 * D), 2),
        ("residual (B,S,768), sequence sharded", (batch, seq, D), 1),
    ):
        start, stop = tplayers.shard_range(shape[dim], world, 0)
        local = torch.randn(*[s if i != dim else stop - start for i, s in enumerate(shape)])
        full = torch.randn(*shape)
        runs = {
            "nn.Dropout on the full tensor (serial)": lambda: nn.functional.dropout(full, 0.1, True),
            "nn.Dropout on the local shard (wrong mask)": lambda: nn.functional.dropout(local, 0.1, True),
            "ParallelDropout exact slice": lambda: dropout_slice(local, 0.1, True, shape, dim, start),
        }
        t = {k: [] for k in runs}
        for i in range(repeats):
            for k, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                t[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        base = med["nn.Dropout on the local shard (wrong mask)"]
        print(f"  {label}:")
        for k, v in med.items():
            print(f"    {k:45s} {v:7.2f} ms  ({v / base:.2f}x the local-shard dropout)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            bench, args=(args.world, os.path.join(tmp, "rdzv"), args.batch, args.seq, args.repeats), nprocs=args.world
        )
    dropout_cost(args.batch, args.seq, args.world, max(5, args.repeats))


if __name__ == "__main__":
    main()
