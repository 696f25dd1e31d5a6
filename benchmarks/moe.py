"""A mixture-of-experts layer step: expert parallelism against replicated experts, same run.

    python benchmarks/moe.py               # spawns 2 gloo ranks on the CPU
    python benchmarks/moe.py --quick       # fewer repeats (smoke test)

For each size, forward + backward of transformers' ``MixtralSparseMoeBlock`` (a replicated router,
top-2 of E experts, each a SwiGLU MLP) on 2 ranks, fp32, the same weights and tokens:

- **replicated**: every rank holds and runs all the experts on all the tokens (what
  ``plan_from_transformers(..., replicate_experts=True)`` leaves; no communication in the layer);
- **expert-parallel**: ``tplayers.ExpertParallel()`` on the experts (each rank holds E/2 experts,
  the tokens travel by all-to-all and back, then an all-gather).

Prints median step times (the max over ranks), the ratio expert-parallel / replicated (< 1: expert
parallelism is faster), the expert parameter bytes per rank, the collectives and bytes per step,
the time of those collectives alone (the same kinds and sizes replayed on plain buffers, timed in
the same interleaved loop: the communication floor of the expert-parallel step), and the CPU ISA
torch dispatches to. Repeats alternate the variants so machine load hits them alike.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import tplayers

# torch >= 2.13 names it all_gather_single; all_gather_into_tensor is its deprecated alias.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SIZES = {
    # name: (hidden, expert intermediate, experts, top-k, tokens, repeats)
    "compute-bound H 512, I 1024, 8 experts top-2, 2048 tokens": (512, 1024, 8, 2, 2048, 7),
    "overhead-bound H 128, I 256, 8 experts top-2, 64 tokens": (128, 256, 8, 2, 64, 200),
}


def block(hidden, inter, experts, k, impl):
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=k
    )
    config._experts_implementation = impl
    torch.manual_seed(0)
    moe = MixtralSparseMoeBlock(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5)
    return moe


def step(model, x):
    x.grad = None
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()


def timed(model, x) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(model, x)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return elapsed.item()


def replay_plan(records, world):
    """``[(kind, fp32 elements per rank)]`` of the step's collectives, the largest rank's size each (a2a
    counts differ by rank; the replay must use one size everywhere)."""
    sizes = []
    for rec in records:
        if rec.kind == "all_to_all":  # bytes sent to other ranks: the whole buffer is world / (world - 1) of it
            sizes.append(max(world, rec.nbytes * world // (world - 1) // 4 // world * world))
        else:  # all_gather: bytes of the gathered output
            sizes.append(max(1, rec.nbytes // 4 // world))
    agreed = torch.tensor(sizes, dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return [(rec.kind, int(n)) for rec, n in zip(records, agreed.tolist())]


def replay(plan, world):
    """The step's collectives on plain fp32 buffers (no autograd, no routing)."""
    for kind, n in plan:
        if kind == "all_to_all":
            dist.all_to_all_single(torch.empty(n), torch.empty(n))
        else:
            _all_gather_single(torch.empty(n * world), torch.empty(n))


def timed_replay(records, world) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    replay(records, world)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bench(rank, world, init_file, threads, quick, impl):
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = tplayers.init_mesh(device_type="cpu")
    if rank == 0:
        print(
            f"CPU ISA (torch.backends.cpu.get_cpu_capability): {torch.backends.cpu.get_cpu_capability()}; "
            f"torch {torch.__version__}; transformers {transformers.__version__}; experts implementation {impl!r}"
        )
    for label, (hidden, inter, experts, k, tokens, repeats) in SIZES.items():
        if quick:
            repeats = max(2, repeats // 10)
        serial = block(hidden, inter, experts, k, impl)
        replicated = copy.deepcopy(serial)
        ep = tplayers.parallelize_module(copy.deepcopy(serial), {"experts": tplayers.ExpertParallel()}, mesh=mesh)
        x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.testing.assert_close(ep(x), replicated(x), rtol=1e-4, atol=1e-4)  # the same function first
        for _ in range(2):  # warm-up (the expert-parallel layer's first call agrees on the shapes)
            step(ep, x), step(replicated, x)
        with tplayers.count_collectives() as log:
            step(ep, x)
        records = replay_plan([r for r in log.records if r.kind in ("all_to_all", "all_gather")], world)
        times = {"expert-parallel": [], "replicated": [], "collectives": []}
        for i in range(repeats):
            order = ("expert-parallel", "replicated", "collectives")
            for name in order if i % 2 == 0 else order[::-1]:
                if name == "collectives":
                    times[name].append(timed_replay(records, world))
                else:
                    times[name].append(timed(ep if name == "expert-parallel" else replicated, x))
        if rank == 0:
            med = {name: statistics.median(v) for name, v in times.items()}
            mib = lambda m: sum(p.numel() * p.element_size() for p in m.experts.parameters()) / 2**20  # noqa: E731
            print(f"\n== {label} (fp32, {world} ranks, {threads} thread(s) per rank, {repeats} interleaved repeats)")
            print(
                f"  replicated      fwd+bwd median {med['replicated'] * 1e3:9.3f} ms   experts {mib(replicated):.2f} MiB/rank"
            )
            print(
                f"  expert-parallel fwd+bwd median {med['expert-parallel'] * 1e3:9.3f} ms   experts {mib(ep):.2f} MiB/rank;"
                " collectives/step: "
                + ", ".join(f"{kind} x{c} ({b / 2**20:.3f} MiB)" for kind, (c, b) in log.summary().items())
            )
            print(
                f"  its collectives alone        {med['collectives'] * 1e3:9.3f} ms   (the same kinds and sizes, replayed)"
            )
            paired = sorted(a / b for a, b in zip(times["expert-parallel"], times["replicated"]))
            print(
                f"  ratio expert-parallel / replicated = {med['expert-parallel'] / med['replicated']:.3f}   "
                f"(per-repeat pairs: median {statistics.median(paired):.3f}, range {paired[0]:.3f}-{paired[-1]:.3f})"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke test)")
    parser.add_argument("--impl", default="eager", help="transformers experts implementation (eager, batched_mm, ...)")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            bench,
            args=(args.world, os.path.join(tmp, "rdzv"), args.threads, args.quick, args.impl),
            nprocs=args.world,
        )


if __name__ == "__main__":
    main()
