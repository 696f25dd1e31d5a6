"""tplayers.repartition: values, adjoint gradients, uneven and empty shards, bytes at the minimum,
1-D and 2-D meshes, swaps, and errors raised on every rank before any data moves."""

import random

import pytest
import torch
from harness import raised, run_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.comm.all_to_all import plan_moves
from tplayers.sharding import offsets_from_sizes, shard_sizes


def _full(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(
            torch.randn(shape, dtype=torch.float64, generator=g), torch.randn(shape, dtype=torch.float64, generator=g)
        ).to(dtype)
    return torch.randn(shape, dtype=torch.float64, generator=g).to(dtype)


def _slice(full, dims, sizes_per_mesh_dim, coords):
    out = full
    for d, sizes, c in zip(dims, sizes_per_mesh_dim, coords):
        out = out.narrow(d, offsets_from_sizes(sizes)[c], sizes[c])
    return out


def _check(full, weight, mesh, src, dst, src_sizes):
    """repartition of this rank's (arbitrary-partition) slice equals the balanced slice along ``dst``;
    its gradient equals the serial gradient's slice; returns (forward log, backward log)."""
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    x = _slice(full, src, src_sizes, coords).clone().requires_grad_(True)
    with tplayers.count_collectives() as fwd:
        y = tplayers.repartition(x, mesh, src if mesh.ndim > 1 else src[0], dst if mesh.ndim > 1 else dst[0])
    # a mesh dim whose dim changes gets the balanced cut; one that keeps its dim keeps its partition
    dst_sizes = [src_sizes[i] if d == src[i] else shard_sizes(full.size(d), mesh.size(i)) for i, d in enumerate(dst)]
    assert torch.equal(y, _slice(full, dst, dst_sizes, coords)), (src, dst, src_sizes)
    z = full.clone().requires_grad_(True)
    (z * weight).real.sum().backward()  # the serial loss; its gradient is weight (conj for complex)
    with tplayers.count_collectives() as bwd:
        (y * _slice(weight, dst, dst_sizes, coords)).real.sum().backward()
    assert torch.equal(x.grad, _slice(z.grad, src, src_sizes, coords))
    return fwd, bwd


def _one_d(rank, world, seed):
    mesh = DeviceMesh("cpu", torch.arange(world))
    rng = random.Random(seed)
    for trial in range(12):
        ndim = rng.choice([2, 3, 4])
        shape = [rng.randint(1, 7) for _ in range(ndim)]
        src, dst = rng.sample(range(ndim), 2)
        sizes = [rng.randint(0, 3) for _ in range(world)]  # arbitrary partition, empty shards included
        shape[src] = sum(sizes)
        dtype = rng.choice([torch.float64, torch.complex128, torch.float32])
        full, weight = _full(shape, seed + trial, dtype), _full(shape, seed + 100 + trial, dtype)
        fwd, bwd = _check(full, weight, mesh, (src,), (dst,), [sizes])
        assert fwd.count("all_to_all") == 1 and bwd.count("all_to_all") == 1
        assert fwd.count() == 2  # the agreement, then the data
        # bytes at the minimum: every element that changes owner crosses the wire once, in each direction
        t = shard_sizes(shape[dst], world)
        per_row = full.numel() // max(shape[src] * shape[dst], 1) if full.numel() else 0
        out_bytes = sizes[rank] * (shape[dst] - t[rank]) * per_row * full.element_size()
        back_bytes = t[rank] * (shape[src] - sizes[rank]) * per_row * full.element_size()
        assert fwd.bytes("all_to_all") == out_bytes and bwd.bytes("all_to_all") == back_bytes, (shape, src, dst)
    # identity: same dims, only the agreement
    full = _full((2, 3, 5), seed, torch.float64)
    with tplayers.count_collectives() as log:
        y = tplayers.repartition(tplayers.shard(full, 2, mesh), mesh, 2, 2)
    assert torch.equal(y, tplayers.shard(full, 2, mesh)) and log.count("all_to_all") == 0
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_repartition_1d(world):
    run_ranks(_one_d, world, args=(world * 7,), timeout=60)


def _two_d(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    cases = [
        ((2, 3), (1, 3), 1),  # H -> channels over mesh dim 0
        ((2, 3), (3, 4), 2),  # both move; W is freed first
        ((2, 3), (3, 2), 3),  # a swap: through a third dim
        ((2, 3), (0, 1), 2),
    ]
    for i, (src, dst, n) in enumerate(cases):
        for dtype in (torch.float64, torch.complex128):
            shape = (2, 3, 5, 7, 3)
            full, weight = _full(shape, i, dtype), _full(shape, 50 + i, dtype)
            sizes = [[3, 2], [2, 5]] if i % 2 else [shard_sizes(5, 2), shard_sizes(7, 2)]
            fwd, bwd = _check(full, weight, mesh, src, dst, sizes)
            assert fwd.count("all_to_all") == n and bwd.count("all_to_all") == n, (src, dst)
    return True


def test_repartition_2d_mesh():
    run_ranks(_two_d, 4, timeout=60)


def _errors(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(world))
    x = torch.zeros(2, 3, 4 + rank, 6)
    out = []
    # the same bad argument on every rank: each raises it (after the agreement, no data moved)
    out.append(raised(lambda: tplayers.repartition(x, mesh, 2, 2 + 7)))
    out.append(raised(lambda: tplayers.repartition(x, mesh, (2, 3), 3)))
    out.append(raised(lambda: tplayers.repartition(x, mesh, 2, "w")))
    # one rank's own mistakes: every rank raises
    out.append(raised(lambda: tplayers.repartition(x if rank else "x", mesh, 2, 3)))
    out.append(raised(lambda: tplayers.repartition(x.double() if rank == 1 else x, mesh, 2, 3)))
    out.append(raised(lambda: tplayers.repartition(x, mesh, 2, 3 if rank else 1)))
    out.append(raised(lambda: tplayers.repartition(x[..., : 6 - rank], mesh, 2, 3)))
    # the ranks still work together afterwards
    y = tplayers.repartition(x, mesh, 2, 3)
    assert y.shape == (2, 3, 4 * world + sum(range(world)), shard_sizes(6, world)[rank])
    return out


def test_repartition_errors_on_every_rank():
    results = run_ranks(_errors, 2, timeout=30)
    for rank, out in enumerate(results):
        assert out[0][0] == "ValueError" and "to_dims" in out[0][1]
        assert out[1][0] == "ValueError" and "from_dims" in out[1][1] and "one tensor dim per mesh dim" in out[1][1]
        assert out[2][0] == "TypeError" and "to_dims" in out[2][1]
        assert "x must be a torch.Tensor" in out[3][1] or "rank(s) [0]" in out[3][1]
        assert out[3][0] == ("TypeError" if rank == 0 else "ValueError")
        assert out[4][0] == "ValueError" and "dtype differs" in out[4][1]
        assert out[5][0] == "ValueError" and "to_dims differs" in out[5][1]
        assert out[6][0] == "ValueError" and "other dims differs" in out[6][1]


def test_plan_moves():
    assert plan_moves((2,), (2,), ()) == []
    assert plan_moves((2,), (3,), ()) == [(0, 2, 3)]
    assert plan_moves((2, 3), (3, 4), (0, 1)) == [(1, 3, 4), (0, 2, 3)]
    assert plan_moves((2, 3), (3, 2), (4, 1)) == [(0, 2, 4), (1, 3, 2), (0, 4, 3)]
    with pytest.raises(ValueError, match="no other dim"):
        plan_moves((0, 1), (1, 0), (0, 1))


def _not_a_grid(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    c1 = mesh.get_local_rank(1)
    rows = 3 + (rank == 3)  # mesh position (1, 1) holds 4 rows where its mesh row holds 3
    x = torch.zeros(1, 2, rows, 2 + c1)
    return raised(lambda: tplayers.repartition(x, mesh, (2, 3), (1, 3)))


def test_repartition_2d_shards_must_form_a_grid():
    for name, msg in run_ranks(_not_a_grid, 4, timeout=30):
        assert name == "ValueError" and "do not form a grid" in msg and "(1, 1)" in msg


def test_module_doctests():
    import doctest

    import tplayers.comm.all_to_all as all_to_all
    import tplayers.functional.fft as fft

    for mod in (all_to_all, fft):
        result = doctest.testmod(mod)
        assert result.attempted >= 1 and result.failed == 0, (mod.__name__, result)


def _two_d_random(rank, world, seed):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    rng = random.Random(seed)
    for trial in range(10):
        ndim = rng.choice([3, 4, 5])
        src = tuple(rng.sample(range(ndim), 2))
        dst = tuple(rng.sample(range(ndim), 2))
        shape = [rng.randint(1, 6) for _ in range(ndim)]
        sizes = [[rng.randint(0, 4) for _ in range(2)] for _ in range(2)]  # a grid, empty rows included
        for i in range(2):
            shape[src[i]] = sum(sizes[i])
        dtype = rng.choice([torch.float64, torch.complex128])
        full, weight = _full(shape, seed + trial, dtype), _full(shape, seed + 50 + trial, dtype)
        fwd, bwd = _check(full, weight, mesh, src, dst, sizes)
        assert fwd.count("all_to_all") == bwd.count("all_to_all") == len(plan_moves(src, dst, range(ndim)))
    return True


def test_repartition_2d_mesh_random():
    run_ranks(_two_d_random, 4, args=(5,), timeout=90)
