"""GroupNorm and a U-Net training step on 2 ranks vs one process; collectives per step vs the minimum.

    torchrun --nproc-per-node 2 benchmarks/norm_unet.py [--repeats 5] [--size 128 --width 16] [--skip-norm]
    torchrun --nproc-per-node 2 benchmarks/norm_unet.py --size 256 --width 32 --skip-norm --repeats 3

1. DistributedGroupNorm forward+backward on an H-sharded (N, C, H, W) input vs nn.GroupNorm on
   the whole input in one process (one thread per process in both cases);
2. one U-Net training step (examples/unet.py: forward, domain_mean loss, backward, Adam) on 2
   ranks vs the serial model in one process;
3. collectives per step by kind (count_collectives), against the minimum for the norms (one
   forward and one backward collective per norm: the statistics need every rank's moments, the
   input gradient every rank's statistic sums);
4. the region guard's steady-state cost: the same 2-rank U-Net step with the guard's hooks removed and
   the replicated parameters' gradient sums done per module as before the guard (DomainReplicated),
   alternating with the guarded step in the same run (the guarded step also has the region's
   gradient buckets: one all-reduce for every convolution's parameter gradients, where the bare
   step sums per layer, so this ratio is the guard's cost net of the buckets' gain);
5. the step against two same-run floors (``--floors``, the default): *perfect scaling*, every
   rank running the serial step on a slab of its own shard's size at the same time with no
   communication at all (the best any domain decomposition of this step can do here), and
   *perfect scaling + syncs*, the same step with one bare 4-byte all-reduce wherever a layer of
   the 2-rank step must wait for its peers (forward and backward of each 3x3 convolution, norm,
   upsample and time-embedding boundary: the step's synchronisation points, counted beside the
   step's own). The second floor is what any implementation with that many synchronisation
   points pays on this machine's transport; the step's distance to it is the library's own
   overhead (main-thread CPU per step is printed for all three).

Issue-21 targets: the U-Net step on 2 ranks >= 1.2x one process at (4, 1, 128, 128), width 16, and
>= 1.5x at (4, 1, 256, 256), width 32.

Timings alternate (2-rank, then 1-process on rank 0 while rank 1 waits) and are medians.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers
from tplayers.domain.active import stepped_aside
from tplayers.ops.na_cpu import host_isa  # the CPU's vector ISA: avx512 / avx2 / base

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from unet import UNet  # noqa: E402


def _time(fn, reps: int = 3, cpu: list = None) -> float:
    """Wall seconds per call of ``fn`` (after a warm-up); ``cpu``: also appends this thread's CPU seconds
    per call (what the guard's own Python work costs, steadier than wall time on a shared machine)."""
    fn()  # warm-up (layouts cached)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(reps):
        fn()
    if cpu is not None:
        cpu.append((time.thread_time() - c0) / reps)
    return (time.perf_counter() - t0) / reps


_PARTITION_FIXED = types.SimpleNamespace(agreed=True)  # what a region's entry agreement tells its twins


def _without_guard(model: nn.Module, mesh) -> nn.Module:
    """``model`` with the domain regions' hooks removed and, as before the guard, every module with
    replicated parameters outside the twins wrapped in ``DomainReplicated`` (one gradient all-reduce
    each): the same kind of collectives without the guard's bookkeeping. For timing only (the
    wrapped time-embedding MLP's gradients are summed where they should not be)."""
    for m in model.modules():
        m.__dict__.pop("_tp_region_entry", None)  # nor the entry a twin opens its region by
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key, hook in list(hooks.items()):
                owner = type(getattr(hook, "__self__", None)).__name__
                if owner in ("DomainRegion", "Member"):
                    del hooks[key]
    return _wrap_replicated(model, mesh)


def _wrap_replicated(module: nn.Module, mesh) -> nn.Module:
    from tplayers.layers._common import RegionAware

    if isinstance(module, (RegionAware, tplayers.DomainReplicated)):
        return module
    for name, child in list(module.named_children()):
        setattr(module, name, _wrap_replicated(child, mesh))
    if next(module.parameters(recurse=False), None) is not None:
        return tplayers.DomainReplicated(module, mesh)
    return module


def _sync_hooks(model: nn.Module) -> int:
    """Put one bare 4-byte all-reduce in the forward and the backward of every module whose twin must
    wait for its peers (halo exchanges, norm statistics, the time embedding meeting the shards).
    Returns the number of synchronisation points per step (2 more: the region's entry agreement and
    the loss)."""
    token = torch.zeros(1)

    def sync(*_):
        dist.all_reduce(token)

    points = 0
    for name, m in model.named_modules():
        halo = isinstance(m, (nn.Conv2d, nn.Conv3d)) and any(k > 1 for k in m.kernel_size)
        norm, up = isinstance(m, nn.GroupNorm), isinstance(m, nn.Upsample)
        emb = isinstance(m, nn.Linear) and name.endswith(".emb")  # its output is broadcast onto the shards
        if halo or norm or up:
            m.register_forward_hook(sync)
            points += 1
        if halo or norm or up or emb:
            m.register_full_backward_hook(sync)
            points += 1
    return points


def _sync_points(log) -> int:
    """Points where a rank of the logged step waits for its peers: every receive (on 2 ranks one per halo
    exchange), all-gather and all-reduce."""
    return sum(log.count(kind) for kind in ("recv", "all_gather", "all_reduce"))


def floors(serial: nn.Module, u_local: torch.Tensor, tgt_local: torch.Tensor, t: torch.Tensor, par_step, repeats: int):
    """Median wall and main-thread CPU ms per step of: the 2-rank step, every rank's serial step on its own
    slab at once (perfect scaling), and the same with bare all-reduces at the step's sync points."""
    plain, synced = copy.deepcopy(serial), copy.deepcopy(serial)
    points = _sync_hooks(synced) + 2
    token = torch.zeros(1)
    u_local = u_local.clone().requires_grad_(True)  # as in the 2-rank step: every layer's input gradient

    def stepper(model, with_syncs):
        opt = torch.optim.Adam(model.parameters())

        def step():
            if with_syncs:
                dist.all_reduce(token)  # the region's entry agreement
            loss = F.mse_loss(model(u_local, t), tgt_local)
            if with_syncs:
                dist.all_reduce(token)  # the global loss
            opt.zero_grad(), loss.backward(), opt.step()
            dist.barrier()

        return step

    steps = {
        "2-rank step": par_step,
        "perfect scaling": stepper(plain, False),
        f"perfect scaling + {points} syncs": stepper(synced, True),
    }
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(repeats):
        for key, fn in steps.items():
            fn()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(3):
                fn()
            wall[key].append((time.perf_counter() - t0) / 3)
            cpu[key].append((time.thread_time() - c0) / 3)
    both = torch.tensor([[statistics.median(wall[k]), statistics.median(cpu[k])] for k in steps], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the slowest rank's figures
    return {k: (float(w) * 1e3, float(c) * 1e3) for k, (w, c) in zip(steps, both)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=128, help="U-Net input H = W (issue 21: 128 and 256)")
    parser.add_argument("--width", type=int, default=16, help="U-Net width (issue 21: 16 at 128, 32 at 256)")
    parser.add_argument("--skip-norm", action="store_true", help="time the U-Net step only (no GroupNorm part)")
    parser.add_argument("--no-floors", action="store_true", help="skip the perfect-scaling floors (item 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    # 1) GroupNorm
    x = torch.randn(4, 64, 256, 256)
    gn = nn.GroupNorm(8, 64)
    dgn = tplayers.DistributedGroupNorm.from_module(gn, mesh=mesh)
    xl = tplayers.shard(x, 2, mesh).contiguous().requires_grad_(True)  # this rank's own slab, as when loaded
    xs = x.clone().requires_grad_(True)

    def par_gn():
        dgn(xl).sum().backward()
        dist.barrier()

    def ser_gn():
        gn(xs).sum().backward()

    # 2) U-Net step
    serial = UNet(width=args.width)
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    opt_p, opt_s = torch.optim.Adam(model.parameters()), torch.optim.Adam(serial.parameters())
    u, tgt, t = torch.randn(4, 1, args.size, args.size), torch.randn(4, 1, args.size, args.size), torch.rand(4)
    ul, tl = tplayers.shard(u, 2, mesh).contiguous(), tplayers.shard(tgt, 2, mesh).contiguous()

    def par_unet():
        loss = tplayers.domain_mean(F.mse_loss(model(ul, t), tl, reduction="none"), mesh)
        opt_p.zero_grad(), loss.backward(), opt_p.step()
        dist.barrier()

    bare = _without_guard(copy.deepcopy(model), mesh)
    opt_b = torch.optim.Adam(bare.parameters())

    def bare_unet():
        # As before the guard, the twins keep their layouts cached per local shape: the partition is
        # marked agreed (outside a region a twin otherwise agrees on it every call).
        with stepped_aside(_PARTITION_FIXED, settle=False):
            loss = tplayers.domain_mean(F.mse_loss(bare(ul, t), tl, reduction="none"), mesh)
        opt_b.zero_grad(), loss.backward(), opt_b.step()
        dist.barrier()

    def ser_unet():
        loss = F.mse_loss(serial(u, t), tgt)
        opt_s.zero_grad(), loss.backward(), opt_s.step()

    results = {}
    cases = [] if args.skip_norm else [("GroupNorm fwd+bwd (4, 64, 256, 256)", par_gn, ser_gn)]
    cases.append((f"U-Net train step (4, 1, {args.size}, {args.size}), width {args.width}", par_unet, ser_unet))
    for name, par, ser in cases:
        pt, st = [], []
        for _ in range(args.repeats):
            pt.append(_time(par))
            dist.barrier()
            if rank == 0:
                st.append(_time(ser))
            dist.barrier()
        results[name] = (statistics.median(pt), statistics.median(st) if st else float("nan"))
    guarded, unguarded, guarded_cpu, unguarded_cpu = [], [], [], []
    for _ in range(args.repeats):  # alternating, same run
        guarded.append(_time(par_unet, cpu=guarded_cpu))
        unguarded.append(_time(bare_unet, cpu=unguarded_cpu))
    guard_ratio = statistics.median(guarded) / statistics.median(unguarded)
    guard_cpu_ratio = statistics.median(guarded_cpu) / statistics.median(unguarded_cpu)

    floor = None if args.no_floors else floors(serial, ul, tl, t, par_unet, args.repeats)

    with tplayers.count_collectives() as log:
        loss = tplayers.domain_mean(F.mse_loss(model(ul, t), tl, reduction="none"), mesh)
        loss.backward()
    norms = sum(isinstance(m, tplayers.DistributedGroupNorm) for m in model.modules())
    norm_fwd = sum(1 for r in log.records if r.tag == "norm_stats.fwd")
    norm_bwd = sum(1 for r in log.records if r.tag == "norm_stats.bwd")
    if rank == 0:
        print(
            f"{world} ranks (gloo, CPU, 1 thread each) vs 1 process (1 thread); CPU {host_isa()}, torch {torch.__version__}"
        )
        for name, (p, s) in results.items():
            print(f"{name}: 2-rank {p * 1e3:.1f} ms, 1-process {s * 1e3:.1f} ms, speed-up {s / p:.2f}x")
        print(
            f"region guard: U-Net step {statistics.median(guarded) * 1e3:.1f} ms guarded vs "
            f"{statistics.median(unguarded) * 1e3:.1f} ms without it: {100 * (guard_ratio - 1):+.1f}% "
            f"(target <= +2%; CPU {host_isa()}); main-thread CPU {statistics.median(guarded_cpu) * 1e3:.1f} vs "
            f"{statistics.median(unguarded_cpu) * 1e3:.1f} ms: {100 * (guard_cpu_ratio - 1):+.1f}%"
        )
        print(f"U-Net step collectives by kind: {log.summary()}")
        print(
            f"norm collectives: forward {norm_fwd}, backward {norm_bwd} for {norms} GroupNorms "
            f"(minimum {norms} + {norms})"
        )
        if floor is not None:
            print(f"sync points of the 2-rank step: {_sync_points(log)} (halo exchanges, all-gathers, all-reduces)")
            ser = results[cases[-1][0]][1] * 1e3
            base = floor["perfect scaling"][0]
            print(
                "U-Net step against same-run floors (wall ms / main-thread CPU ms per step, slowest rank; "
                "speed-up = 1 process / this):"
            )
            for key, (w, c) in floor.items():
                print(f"  {key:32s} {w:7.1f} / {c:6.1f}   speed-up {ser / w:4.2f}x   x floor {w / base:4.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
