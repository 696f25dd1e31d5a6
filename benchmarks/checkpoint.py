"""Checkpoint throughput vs safetensors' own save_file / load_file, and bytes read when resharding.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint.py --mb 500 --repeats 5 --dir /tmp/ckbench
    torchrun --standalone --nproc-per-node 3 benchmarks/checkpoint.py --mb 500 --dir /tmp/ckbench --reshard

Run 1 (2 ranks): a tensor-parallel MLP stack of about ``--mb`` MB (fp32) is
saved and loaded with tplayers, and each rank saves / loads the very same local
tensors with ``safetensors.torch.save_file`` / ``load_file`` (+ ``load_state_dict``
so the bytes are really read; ``load_file`` alone only maps the file). Repeats
are interleaved, the loads' order rotated each repeat (the first load after the saves meets their
writeback); medians are printed with the ratio tplayers / safetensors
(ratio of the medians, and the median and range of the per-repeat ratios).
"hot" loads read from the page cache; "cold" loads evict the files first. A verified
load checks every digest before it changes any parameter (docs/design.md, checkpoints), so it reads its bytes
twice where ``load_file`` reads them once: the "floor" line times ``load_file`` +
``load_state_dict`` preceded by one XXH3-128 pass over the same bytes, the least such a
load can cost, and prints the ratio it leaves reachable; the verified hot load is measured
against that floor (issue 21: >= 0.95x the floor's speed), and against the same floor plus the one
small all-ranks agreement (an 8-byte all-gather) that a distributed load must also make before any
rank changes a parameter ("floor hot verified+agreed").
Saves are compared with ``save_file`` as is (no fsync: the data may still be
only in the page cache) and with ``save_file`` + ``fsync`` (the durability
tplayers gives: every file and directory fsynced, atomic rename). Each ratio with a
target (issues 13 and 21) is printed with it and PASS / MISS; the first line gives the
same-run single-core rates of the digests, a memory copy and torch's 2-D
transpose (the limits a load meets), the last the load average. ~1 minute.

Run 2 (3 ranks, ``--reshard``): loads the 2-rank checkpoint at 3 ranks, one
rank at a time with a cold page cache (ranks on one machine share the page
cache), through the same staging code as ``load_checkpoint``; reports, per rank, the bytes the kernel read from disk
(``/proc/self/io`` read_bytes) and the tensor bytes it maps to read (what ``get_slice`` would),
against the ideal: the bytes that rank holds (~1/3 of the model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import tplayers
from tplayers.checkpoint import load_checkpoint, save_checkpoint
from tplayers.checkpoint.digest import block_digest
from tplayers.checkpoint.format import byte_view, itemsize
from tplayers.checkpoint.layout import describe, local_tensors
from tplayers.checkpoint.load import apply_copies, stage_load
from tplayers.checkpoint.progress import Progress


class BenchNet(nn.Module):
    def __init__(self, n_blocks: int, d: int, hidden: int, mesh) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, d)
        self.blocks = nn.ModuleList()
        for _ in range(n_blocks):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "ln": nn.LayerNorm(d),
                        "fc1": tplayers.ColumnParallelLinear(d, hidden, mesh=mesh),
                        "fc2": tplayers.RowParallelLinear(hidden, d, mesh=mesh),
                    }
                )
            )


def _model(mb: int, mesh) -> BenchNet:
    d, hidden = 1024, 4096
    per_block = 2 * d * hidden * 4 / 1e6
    return BenchNet(max(1, round(mb / per_block)), d, hidden, mesh)


def _nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _evict(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def hash_rates(mb: int = 256) -> dict:
    """Same-run GB/s of the digests on 256 KiB blocks, and of a memory copy (the limit a hot load meets)."""
    from tplayers.checkpoint.digest import block_digest
    from tplayers.checkpoint.format import byte_view

    data = torch.randint(0, 255, (mb << 20,), dtype=torch.uint8)
    view, block = byte_view(data), 256 << 10
    out = {}
    for name in ("sha256", "xxh3_128"):
        fn = block_digest(name)
        t0 = time.perf_counter()
        for i in range(0, len(view), block):
            fn(view[i : i + block])
        out[name] = len(view) / (time.perf_counter() - t0) / 1e9
    # Into memory already touched: a fresh torch.empty_like would time the kernel's first-touch page
    # faults (about 2 GB/s here), not the copy.
    dst = torch.zeros_like(data)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(data)
        best = min(best, time.perf_counter() - t0)
    out["memcpy"] = len(view) / best / 1e9
    # torch's blocked 2-D transpose (what a load pays for the pieces of tensors sharded on dim 1)
    src = data[: (mb << 20) // 4 * 4].view(torch.float32).view(-1, 1024)
    out_t = torch.zeros(src.shape[1], src.shape[0])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out_t.copy_(src.t())
        best = min(best, time.perf_counter() - t0)
    out["transpose"] = src.numel() * 4 / best / 1e9
    return out


#: Issue targets (throughput ratio tplayers / safetensors, same run).
# ("load ours hot", "floor hot verified"): issue 21's target for a verified hot load, against its same-run
# floor (issue 13's 0.8x of load_file was floor-bound: the floor itself allows ~0.7-0.85x)
TARGETS = {
    ("load ours hot", "floor hot verified"): 0.95,
    ("load ours hot", "floor hot verified+agreed"): 0.95,
    ("load ours hot verify=False", "load st hot"): 0.9,
    ("load ours cold", "load st cold"): 0.95,
    ("save ours", "save st+fsync"): 1.0,
    ("save ours", "save st"): 0.9,
}


def throughput(args, mesh) -> None:
    rank = dist.get_rank()
    if rank == 0:
        rates = hash_rates()
        print("same-run rates on one core, 256 KiB blocks: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    model = _model(args.mb, mesh)
    transposed = sum(v.numel() * v.element_size() for k, v in model.state_dict().items() if k.endswith("fc2.weight"))
    # the model's bytes counted once (replicated tensors are held by every rank)
    glob = sum(math.prod(shape) * itemsize(dtype) for _, shape, dtype, _, _ in describe(local_tensors(model)))
    ours, st = os.path.join(args.dir, "ours"), os.path.join(args.dir, "st")
    ours_sha = os.path.join(args.dir, "ours_sha256")
    os.makedirs(st, exist_ok=True)
    mine = os.path.join(st, f"rank{rank}.safetensors")
    local = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    times = {
        k: []
        for k in (
            "save ours",
            "save st",
            "save st+fsync",
            "load ours hot",
            "load ours hot verify=False",
            "load ours hot sha256",
            "load st hot",
            "load ours cold",
            "load ours cold verify=False",
            "load st cold",
            "floor hot verified",
            "floor hot verified+agreed",
        )
    }
    save_checkpoint(model, ours_sha, progress=False, digest="sha256")  # the previous default, for comparison

    def st_save(fsync):
        save_file(local, mine)
        if fsync:
            fd = os.open(mine, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def st_load():
        model.load_state_dict(load_file(mine))

    digest = block_digest("xxh3_128")

    flag = torch.zeros(8, dtype=torch.uint8)

    def floor_verified(agreed: bool = False):
        # The least a load that checks digests before changing any parameter (docs/design.md, checkpoints) can cost:
        # safetensors' load with one XXH3-128 pass over the same bytes, from the same page cache, first.
        # agreed: with the one small all-ranks agreement docs/design.md (checkpoints) also orders before any rank changes a
        # parameter (a distributed load cannot skip it; load_file has none), an all-gather of 8 bytes.
        tensors = load_file(mine)
        block = 256 << 10
        for t in tensors.values():
            view = byte_view(t)
            for i in range(0, len(view), block):
                digest(view[i : i + block])
        if agreed:
            dist.all_gather([torch.empty_like(flag) for _ in range(dist.get_world_size())], flag)
        model.load_state_dict(tensors)

    for rep in range(args.repeats):
        times["save ours"].append(_timed(lambda: save_checkpoint(model, ours, progress=False)))
        times["save st"].append(_timed(lambda: st_save(False)))
        times["save st+fsync"].append(_timed(lambda: st_save(True)))
        for cache in ("hot", "cold"):
            runs = [
                (f"load ours {cache}", lambda: load_checkpoint(model, ours)),
                (f"load ours {cache} verify=False", lambda: load_checkpoint(model, ours, verify=False)),
                (f"load st {cache}", st_load),
            ]
            if cache == "hot":
                runs.append(("load ours hot sha256", lambda: load_checkpoint(model, ours_sha)))
                runs.append(("floor hot verified", floor_verified))
                runs.append(("floor hot verified+agreed", lambda: floor_verified(True)))
            shift = rep % len(runs)  # rotated each repeat: no contender always runs first after the saves
            for name, fn in runs[shift:] + runs[:shift]:
                if cache == "cold":
                    if rank == 0:
                        _evict(ours)
                    _evict(st)
                times[name].append(_timed(fn))
    if rank == 0:
        mb = glob / 1e6
        print(f"model {mb:.0f} MB (fp32) at {dist.get_world_size()} ranks, {args.repeats} interleaved repeats, medians")
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"  {k:32s} {v:7.3f} s  {mb / v:8.0f} MB/s   (all: {', '.join(f'{x:.3f}' for x in times[k])})")
        pairs = [
            ("save ours", "save st"),
            ("save ours", "save st+fsync"),
            ("load ours hot", "load st hot"),
            ("load ours hot", "floor hot verified"),
            ("load ours hot", "floor hot verified+agreed"),
            ("load ours hot verify=False", "load st hot"),
            ("load ours hot sha256", "load st hot"),
            ("load ours cold", "load st cold"),
            ("load ours cold verify=False", "load st cold"),
        ]
        for a, b in pairs:
            # Repeats are interleaved, so repeat i of both ran under about the same machine load:
            # the per-repeat ratios show the spread that other jobs on the machine cause.
            per = sorted(y / x for x, y in zip(times[a], times[b]))
            target = TARGETS.get((a, b))
            goal = (
                f"  target >= {target:.2f}x  {'PASS' if med[b] / med[a] >= target else 'MISS'}"
                if target
                else "  (no target)"
            )
            print(
                f"  ratio {a} / {b}: {med[b] / med[a]:.2f}x{goal}   "
                f"(per repeat: median {statistics.median(per):.2f}x, range {per[0]:.2f}-{per[-1]:.2f}x)"
            )
        reach = med["load st hot"] / med["floor hot verified"]
        print(
            f"  floor of a verified hot load (load st hot + one XXH3-128 pass over the same bytes first, as docs/design.md (checkpoints) "
            f"orders): {med['floor hot verified']:.3f} s, so 'load ours hot' can reach at most {reach:.2f}x load st hot; "
            f"ours reaches {med['floor hot verified'] / med['load ours hot']:.2f} of that floor (target >= 0.95)"
        )
        how = "stored in their natural layout: a load copies them without a transpose"
        print(
            f"  {transposed / 1e6:.0f} MB of each rank's ~{mb / dist.get_world_size():.0f} MB are pieces sharded on dim 1, "
            f"{how} (a transpose of them at the rate above: {transposed / rates['transpose'] / 1e9 * 1e3:.0f} ms)"
        )
        print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


def reshard(args, mesh) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args.mb, mesh)
    ours = os.path.join(args.dir, "ours")
    ideal = _nbytes(model.state_dict())
    rows = []
    for verify in (False, True):
        # One rank at a time with a cold cache: ranks on one machine share the page cache.
        for turn in range(world):
            if rank == turn:
                _evict(ours)
                before = _disk_read_bytes()
                reader, copies, res = stage_load(model, ours, strict=True, verify=verify, cast=False)
                apply_copies(copies, Progress(0, "", False))
                reader.close()
                del reader, copies  # drop the mappings, or the next turn's eviction cannot drop those pages
                rows.append(torch.tensor([_disk_read_bytes() - before, res.bytes_read, ideal], dtype=torch.float64))
            dist.barrier()
    stats = torch.stack(rows)
    everyone = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(everyone, stats)
    if rank == 0:
        with open(os.path.join(ours, "index.json")) as f:
            saved_at = json.load(f)["world_size"]
        total = sum(os.path.getsize(os.path.join(ours, n)) for n in os.listdir(ours))
        print(f"reshard {saved_at} -> {world} ranks, checkpoint {total / 1e6:.0f} MB, cold page cache")
        for r, s in enumerate(everyone):
            for i, verify in enumerate((False, True)):
                disk, logical, want = s[i].tolist()
                print(
                    f"  rank {r} verify={verify!s:5s}: disk {disk / 1e6:7.1f} MB ({disk / want:.3f}x ideal), "
                    f"mapped {logical / 1e6:7.1f} MB ({logical / want:.3f}x), ideal (held) {want / 1e6:.1f} MB, "
                    f"1/N of the file bytes {total / world / 1e6:.1f} MB"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=500)
    p.add_argument("--dir", default="/tmp/tplayers-ckbench")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reshard", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    mesh = tplayers.init_mesh(device_type="cpu")
    os.makedirs(args.dir, exist_ok=True)
    (reshard if args.reshard else throughput)(args, mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
