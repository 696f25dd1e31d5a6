"""The window core's N-d halo exchange: the adjoint identity <Hx, y> = <x, H*y> (gather and
scatter-add, 1-D and 2-D meshes, every boundary mode), and halo bytes equal the brute-force
minimum for each op family."""

import random

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.domain.window import gather_windows, scatter_add_windows
from tplayers.sharding import offsets_from_sizes, shard_sizes
from tplayers.window_plan import (
    conv_out_len,
    conv_window,
    out_partition,
    plan_ranges,
    plan_windows,
    transposed_needs,
    transposed_out_len,
)


def _dot(a, b):
    t = (a * b).sum().reshape(1)
    dist.all_reduce(t)
    return float(t)


def _plans(mesh, dims, sizes, shape, local, plans, tplans, own, k, s, dil, p, mode):
    for i, d in enumerate(dims):
        c = mesh.get_local_rank(i)
        local[d] = sizes[d][c]
        out_len = conv_out_len(shape[d], k, s, dil, (p, p))
        plans[d] = plan_windows(sizes[d], out_len, conv_window(k, s, dil, p), mode=mode, what="t")[c]
        t_len = transposed_out_len(shape[d], k, s, dil, 0, 0)
        outs = out_partition(sizes[d], t_len)
        tplans[d] = plan_ranges(outs, transposed_needs(sizes[d], k, s, dil, 0), outs, mode="zeros", what="t")[c]
        own[d] = outs[c]


def _adjoint(rank, world, mesh_shape, seed):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    dims = (2, 3)[: mesh.ndim]
    groups = {d: mesh.get_group(i) for i, d in enumerate(dims)}
    rng = random.Random(seed)
    done = 0
    for trial in range(16):
        mode = rng.choice(["zeros", "circular", "reflect", "replicate"])
        shape = [2, 3, rng.randint(6, 12), rng.randint(6, 12)]
        sizes = {d: shard_sizes(shape[d], mesh.size(i)) for i, d in enumerate(dims)}
        k, s, dil = rng.randint(1, 4), rng.randint(1, 2), rng.randint(1, 2)
        p = rng.randint(0, 2)
        local = list(shape)
        plans, tplans, own = {}, {}, {}
        try:
            _plans(mesh, dims, sizes, shape, local, plans, tplans, own, k, s, dil, p, mode)
        except ValueError:
            continue  # every rank alike: a shard too small for this window
        done += 1
        g = torch.Generator().manual_seed(seed * 100 + trial * 10 + rank)
        # gather: H x, and H* y by its backward
        x = torch.randn(local, dtype=torch.float64, generator=g).requires_grad_(True)
        hx = gather_windows(x, plans, groups, mode)
        y = torch.randn(hx.shape, dtype=torch.float64, generator=g)
        (hty,) = torch.autograd.grad(hx, x, y)
        lhs, rhs = _dot(hx, y), _dot(x, hty)
        assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (mode, lhs, rhs)
        # scatter-add (the transposed convolution's exchange): S p, and S* z by its backward
        part_shape = list(local)
        for d in dims:
            part_shape[d] = (local[d] - 1) * s + dil * (k - 1) + 1 if local[d] else 0
        part = torch.randn(part_shape, dtype=torch.float64, generator=g).requires_grad_(True)
        sp = scatter_add_windows(part, tplans, groups, own)
        z = torch.randn(sp.shape, dtype=torch.float64, generator=g)
        (stz,) = torch.autograd.grad(sp, part, z)
        lhs, rhs = _dot(sp, z), _dot(part, stz)
        assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), ("scatter", lhs, rhs)
    assert done >= 8, done
    return True


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (3, (3,)), (4, (2, 2))])
def test_halo_adjoint_identity(world, mesh_shape):
    run_ranks(_adjoint, world, args=(mesh_shape, 7 + world), timeout=60)


def _min_rows(reads, sizes, length, periodic):
    """Distinct foreign input rows read by each rank's owned outputs, summed (brute force)."""
    starts, total = offsets_from_sizes(sizes), 0
    for c, rows in enumerate(reads):
        mine = set()
        for r in rows:
            r = r % length if periodic else r
            if 0 <= r < length and not starts[c] <= r < starts[c] + sizes[c]:
                mine.add(r)
        total += len(mine)
    return total


def _bytes(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    checked = 0
    for trial in range(10):
        n, c, h, w = 2, 3, rng.randint(12, 24), 5
        k, dil = rng.randint(1, 5), 1
        s = rng.randint(1, k)  # windows without gaps: every row of the halo range is read
        p = rng.randint(0, k // 2)
        mode = rng.choice(["zeros", "circular"])
        sizes = shard_sizes(h, world)
        outs = out_partition(sizes, conv_out_len(h, k, s, dil, (p, p)))
        o_starts = offsets_from_sizes(outs)
        reads = [
            [o * s - p + j for o in range(o_starts[r], o_starts[r] + outs[r]) for j in range(k)] for r in range(world)
        ]
        pool_outs = out_partition(sizes, (h + 2 * p - k) // s + 1)
        p_starts = offsets_from_sizes(pool_outs)
        pool_reads = [
            [o * s - p + j for o in range(p_starts[r], p_starts[r] + pool_outs[r]) for j in range(k)]
            for r in range(world)
        ]
        layers = [
            (
                nn.Conv2d(c, c, k, s, p, padding_mode=mode),
                tplayers.DistributedConv2d,
                _min_rows(reads, sizes, h, mode == "circular"),
            ),
            (nn.MaxPool2d(k, s, p), tplayers.DistributedMaxPool2d, _min_rows(pool_reads, sizes, h, False)),
            (nn.AvgPool2d(k, s, p), tplayers.DistributedAvgPool2d, _min_rows(pool_reads, sizes, h, False)),
        ]
        sf, umode = rng.choice([2, 3, 1.5]), rng.choice(["nearest", "bilinear", "bicubic"])
        up = nn.Upsample(scale_factor=sf, mode=umode)
        eye = torch.eye(h, dtype=torch.float64).view(1, h, h, 1)  # weights of H alone (W kept)
        wmat = torch.nn.functional.interpolate(eye, scale_factor=(sf, 1.0), mode=umode).reshape(h, -1)
        u_outs = out_partition(sizes, wmat.shape[1])
        u_starts = offsets_from_sizes(u_outs)
        u_reads = [
            [i for o in range(u_starts[r], u_starts[r] + u_outs[r]) for i in wmat[:, o].nonzero().flatten().tolist()]
            for r in range(world)
        ]
        layers.append((up, tplayers.DistributedUpsample, _min_rows(u_reads, sizes, h, False)))
        for serial, cls, rows in layers:
            twin = cls.from_module(serial, mesh=mesh)
            x = torch.randn(n, c, sizes[rank], w)
            try:
                twin(x)  # the layout exchange, not counted
            except ValueError:
                continue  # the same on every rank: a shard too small for this window
            with tplayers.count_collectives() as log:
                twin(x)
            sent = torch.tensor([log.bytes("send")])
            dist.all_reduce(sent)
            assert int(sent) == rows * n * c * w * 4, (repr(serial), sizes, int(sent), rows * n * c * w * 4)
            checked += 1
    assert checked >= 25
    return True


def test_halo_bytes_equal_the_minimum():
    run_ranks(_bytes, 3, args=(11,), timeout=60)
