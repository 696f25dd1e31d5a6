"""Which library files one call visits, in order: a region's convolution forward and a
tensor-parallel linear's forward (the design's data paths, measured rather than drawn).

Run: ``torchrun --nproc-per-node 2 benchmarks/walk.py`` (rank 0 prints). Each call is traced on
its second run (layouts already cached), with ``sys.setprofile``: a "visit" is a Python call
entering a ``tplayers`` file; "package changes" counts moves between subpackages
(``layers`` -> ``domain`` -> ``layers`` is two).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import tplayers

ROOT = os.path.dirname(tplayers.__file__)


def trace(fn):
    """The tplayers files entered while ``fn()`` runs, in order of first entry, and the sequence of
    subpackages along the way (consecutive repeats collapsed)."""
    files, seq = [], []

    def prof(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        rel = os.path.relpath(path, ROOT)
        if rel not in files:
            files.append(rel)
        pkg = rel.split(os.sep)[0] if os.sep in rel else rel
        if not seq or seq[-1] != pkg:
            seq.append(pkg)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files, seq


def report(name, files, seq):
    edges = sorted({f"{a}->{b}" for a, b in zip(seq, seq[1:])})
    print(f"{name}: {len(files)} files, {len(seq) - 1} package changes over {len(edges)} distinct steps")
    print("  files: " + ", ".join(files))
    print("  steps: " + ", ".join(edges))


def main():
    mesh = tplayers.init_mesh()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    net = tplayers.parallelize_module(net, {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    x = tplayers.shard(torch.randn(2, 3, 16, 12), 2, mesh)
    conv = net[0]
    net(x)  # layouts planned and cached
    with torch.no_grad():
        region = trace(lambda: net(x))
        twin = trace(lambda: conv(x))
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    mlp = tplayers.parallelize_module(mlp, {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}, mesh=mesh)
    h = torch.randn(4, 16)
    mlp(h)
    with torch.no_grad():
        col = trace(lambda: mlp[0](h))
    if dist.get_rank() == 0:
        report("region call (conv, GroupNorm, ReLU, conv)", *region)
        report("convolution twin alone", *twin)
        report("tensor-parallel linear (column)", *col)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
