"""3-D domain parallelism benchmark: halo bytes, speed vs nn modules and vs PhysicsNeMo ShardTensor.

    torchrun --nproc-per-node 2 benchmarks/conv3d_halo.py [--repeats 5]

Prints, in one run (gloo, CPU, one thread per rank, D sharded over 2 ranks):
1. halo bytes sent per layer vs the minimum (distinct foreign input rows the owned outputs read,
   counted by brute force) for Conv3d, MaxPool3d, AvgPool3d and trilinear Upsample;
2. 2-rank forward+backward of DistributedConv3d vs ShardTensor's conv3d (``nvidia-physicsnemo``
   in a separate venv, see docs/testing-and-benchmarks.md) and vs one process running
   ``nn.Conv3d`` on the global input;
3. 2-rank forward+backward of the pooling / upsampling twins vs one process running the nn module
   (ShardTensor's pooling needs stride == kernel and its interpolation a fixed halo; not compared).

Timings are interleaved and reported as medians, since the machine may be shared. Every
distributed result is checked against the serial module before timing.
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
from tplayers.sharding import offsets_from_sizes, shard_sizes

CONV_SHAPES = {  # name: (N, C_in, D, H, W, C_out, k)
    "compute-bound": (1, 16, 32, 48, 48, 16, 3),
    "overhead-bound": (1, 4, 16, 16, 16, 4, 3),
}


def load_shardtensor():
    """ShardTensor and Shard, or the reason they cannot run here."""
    try:
        from physicsnemo.domain_parallel import ShardTensor
        from physicsnemo.domain_parallel.shard_utils import conv_patches  # noqa: F401  registers F.conv3d
        from torch.distributed.tensor.placement_types import Shard
    except Exception as err:  # noqa: BLE001 - report any import failure as the blocker
        return None, f"{type(err).__name__}: {err}"
    return (ShardTensor, Shard), None


def min_rows(serial: nn.Module, length: int, sizes) -> int:
    """Distinct foreign rows along D the owned outputs read, summed over ranks (brute force via the
    serial module's own dependence: the output rows each input row reaches, probed one row at a time)."""
    reach = []
    with torch.no_grad():
        for r in range(length):
            x = torch.zeros(1, 1, length, 6, 6, dtype=torch.float64)
            x[:, :, r] = 1.0
            y = serial(x)
            reach.append(set(y.abs().sum((0, 1, 3, 4)).nonzero().flatten().tolist()))
    out_len = serial(torch.zeros(1, 1, length, 6, 6, dtype=torch.float64)).shape[2]
    outs = sizes if out_len == length else shard_sizes(out_len, len(sizes))
    starts, o_starts, total = offsets_from_sizes(sizes), offsets_from_sizes(outs), 0
    for c in range(len(sizes)):
        owned = set(range(o_starts[c], o_starts[c] + outs[c]))
        total += sum(1 for r in range(length) if not starts[c] <= r < starts[c] + sizes[c] and reach[r] & owned)
    return total


def halo_table(mesh, rank, world):
    d, h, w, c, n = 32, 16, 16, 8, 1
    torch.manual_seed(0)  # replicated weights: the same on every rank (twins check it)
    cases = [
        (
            "Conv3d 3 same",
            nn.Conv3d(1, 1, 3, padding=1, bias=False),
            tplayers.DistributedConv3d,
            nn.Conv3d(c, c, 3, padding=1),
        ),
        ("Conv3d 4 s2", nn.Conv3d(1, 1, 4, 2, 1, bias=False), tplayers.DistributedConv3d, nn.Conv3d(c, c, 4, 2, 1)),
        ("MaxPool3d 3 s2", nn.MaxPool3d(3, 2, 1), tplayers.DistributedMaxPool3d, nn.MaxPool3d(3, 2, 1)),
        ("AvgPool3d 2", nn.AvgPool3d(2), tplayers.DistributedAvgPool3d, nn.AvgPool3d(2)),
        (
            "Upsample x2 tri",
            nn.Upsample(scale_factor=2, mode="trilinear"),
            tplayers.DistributedUpsample,
            nn.Upsample(scale_factor=2, mode="trilinear"),
        ),
    ]
    if rank == 0:
        print("\n## Halo bytes per layer (forward, all ranks) vs the minimum, D sharded")
        print(f"{'layer':18s} {'sent':>10s} {'minimum':>10s} {'ratio':>6s}")
    sizes = shard_sizes(d, world)
    for label, probe, cls, layer in cases:
        if isinstance(probe, nn.Conv3d):
            nn.init.constant_(probe.weight, 1.0)
        twin = cls.from_module(layer, mesh=mesh)
        x = torch.randn(n, c, sizes[rank], h, w)
        twin(x)  # layout exchange, not counted
        with tplayers.count_collectives() as log:
            twin(x)
        sent = torch.tensor([log.bytes("send")])
        dist.all_reduce(sent)
        minimum = min_rows(probe.double(), d, sizes) * n * c * h * w * 4
        if rank == 0:
            ratio = f"{int(sent) / minimum:6.2f}" if minimum else ("  1.00" if int(sent) == 0 else "   inf")
            print(f"{label:18s} {int(sent):10d} {minimum:10d} {ratio}")


def timed(fn, iters):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def race(steps, repeats, iters):
    times = {k: [] for k in steps}
    for fn in steps.values():
        fn()  # warm-up (and the layout exchange)
    for _ in range(repeats):
        for k, fn in steps.items():
            times[k].append(timed(fn, iters if k != "serial" else max(1, iters // 2)))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def conv_table(mesh, rank, world, repeats, st, memory_format=None):
    if rank == 0:
        print(f"\n## Conv3d: 2-rank forward+backward (ms, median) and ratios; memory_format={memory_format}")
        print(
            f"{'shape':16s} {'tplayers':>9s} {'ShardTensor':>12s} {'nn.Conv3d 1 proc':>17s} {'tpl/ST':>7s} "
            f"{'tpl/serial':>10s}"
        )
    for name, (n, c, d, h, w, co, k) in CONV_SHAPES.items():
        torch.manual_seed(0)
        serial = nn.Conv3d(c, co, k, padding=k // 2)
        conv = tplayers.DistributedConv3d.from_module(serial, mesh=mesh, memory_format=memory_format)
        x = torch.randn(n, c, d, h, w)
        local = x.chunk(world, dim=2)[rank].clone().requires_grad_(True)
        xs = x.clone().requires_grad_(True)
        iters = 2 if name == "compute-bound" else 20
        steps = {"tpl": lambda: conv(local).sum().backward()}
        if st is not None:
            ShardTensor, Shard = st

            def step_st():
                t = ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes="chunk", global_shape=x.shape)
                F.conv3d(t, serial.weight, serial.bias, padding=k // 2).to_local().sum().backward()

            steps["st"] = step_st
        steps["serial"] = lambda: serial(xs).sum().backward() if rank == 0 else None
        with torch.no_grad():
            ref = serial(x).chunk(world, dim=2)[rank]
            torch.testing.assert_close(conv(local), ref, rtol=1e-4, atol=1e-4)
            if st is not None:
                t = ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes="chunk", global_shape=x.shape)
                torch.testing.assert_close(
                    F.conv3d(t, serial.weight, serial.bias, padding=k // 2).to_local(), ref, rtol=1e-4, atol=1e-4
                )
        med = race(steps, repeats, iters)
        st_ms = med.get("st", float("nan"))
        if rank == 0:
            print(
                f"{name:16s} {med['tpl']:9.2f} {st_ms:12.2f} {med['serial']:17.2f} {med['tpl'] / st_ms:7.2f} "
                f"{med['tpl'] / med['serial']:10.2f}   (input {n}x{c}x{d}x{h}x{w}, {co} out, k={k})"
            )


def window_table(mesh, rank, world, repeats):
    if rank == 0:
        print("\n## Pooling / upsampling: 2-rank forward+backward (ms, median) vs one process")
        print(f"{'layer':22s} {'tplayers':>9s} {'nn 1 proc':>10s} {'tpl/serial':>10s}")
    x = torch.randn(2, 16, 32, 32, 32)
    for label, serial, cls in (
        ("MaxPool3d(3, 2, 1)", nn.MaxPool3d(3, 2, 1), tplayers.DistributedMaxPool3d),
        ("AvgPool3d(2)", nn.AvgPool3d(2), tplayers.DistributedAvgPool3d),
        ("Upsample x2 trilinear", nn.Upsample(scale_factor=2, mode="trilinear"), tplayers.DistributedUpsample),
    ):
        twin = cls.from_module(serial, mesh=mesh)
        local = tplayers.shard(x, 2, mesh).clone().requires_grad_(True)
        xs = x.clone().requires_grad_(True)
        with torch.no_grad():
            torch.testing.assert_close(tplayers.gather(twin(local), 2, mesh), serial(x), rtol=1e-5, atol=1e-5)
        med = race(
            {
                "tpl": lambda: twin(local).sum().backward(),
                "serial": lambda: serial(xs).sum().backward() if rank == 0 else None,
            },
            repeats,
            4,
        )
        if rank == 0:
            print(f"{label:22s} {med['tpl']:9.2f} {med['serial']:10.2f} {med['tpl'] / med['serial']:10.2f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-format", choices=["auto", "contiguous", "channels_last"], default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    st, why = load_shardtensor()
    if rank == 0:
        print(f"# 3-D domain parallelism on {world} ranks (gloo, CPU, 1 thread each), torch {torch.__version__}")
        print("ShardTensor: " + ("available" if st else f"unavailable ({why})"))
    halo_table(mesh, rank, world)
    fmt = {"auto": None, "contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    conv_table(mesh, rank, world, args.repeats, st, fmt[args.memory_format])
    window_table(mesh, rank, world, args.repeats)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
