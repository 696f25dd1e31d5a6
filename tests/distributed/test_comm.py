"""Autograd-paired collectives: values, adjoint gradients, uneven/empty shards, accounting."""

import random

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import tplayers
from tplayers.comm import (
    all_gather_along_dim,
    copy_many_to_parallel_region,
    copy_to_parallel_region,
    exchange_sizes,
    gather_along_dim,
    gather_from_sequence_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_region,
    split_along_dim,
)

# How a tensor is spread over the ranks, for the inner product of the whole (distributed) space:
# REPLICATED: one logical tensor held identically by every rank (counted once);
# PER_RANK: every rank holds its own independent part (a shard, or a partial sum): summed over ranks.
REPLICATED, PER_RANK = "replicated", "per-rank"


def _randn(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _dot(a, b, kind, group):
    """<a, b> over the whole space: a REPLICATED pair must agree bitwise on every rank and is counted
    once; PER_RANK parts are summed over the ranks (raw torch.distributed, outside the accounting)."""
    local = (a.detach() * b.detach()).sum().reshape(1)
    world = dist.get_world_size(group)
    if kind == REPLICATED:
        for t in (a, b):
            t = t.detach().contiguous()
            every = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(every, t, group=group)
            assert all(torch.equal(e, t) for e in every), "a replicated tensor differs across ranks"
        return local[0]
    dist.all_reduce(local, group=group)
    return local[0]


def _adjoint(fn, x, y, kinds, group):
    """<fn(x), y> == <x, fn*(y)> over all ranks, fn* being what autograd runs (fn's backward).

    ``kinds = (input kind, output kind)``; ``x`` and ``y`` must be spread that way (a REPLICATED one
    made from the same seed on every rank). Returns both sides."""
    x = x.clone().requires_grad_(True)
    out = fn(x)
    assert out.shape == y.shape, (out.shape, y.shape)
    (out * y).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    return _dot(out, y, kinds[1], group), _dot(x, x.grad, kinds[0], group)


def _collectives(rank, world, seed):
    group = tplayers.default_mesh().get_group(0)
    rng = random.Random(seed)
    for _ in range(8):
        shape = [rng.randint(1, 4) for _ in range(3)]
        dim = rng.randrange(3)
        # Arbitrary uneven partition (some shards empty), same on every rank.
        sizes = [rng.randint(0, 3) for _ in range(world)]
        local_shape = list(shape)
        local_shape[dim] = sizes[rank]
        x = _randn(local_shape, seed + rank)
        full = gather_along_dim(x, dim, group)  # sizes exchanged
        # the WHOLE result, every rank's slot: the serial concatenation of every rank's piece
        pieces = [_randn(shape[:dim] + [sizes[r]] + shape[dim + 1 :], seed + r) for r in range(world)]
        assert torch.equal(full, torch.cat(pieces, dim)), (sizes, dim)
        with tplayers.count_collectives() as log:
            again = gather_along_dim(x, dim, group, sizes)
        assert torch.equal(again, full)
        assert log.count() == (1 if world > 1 else 0)
        # Split (balanced) forward / all-gather backward.
        torch.manual_seed(seed)  # replicated input
        rep = torch.randn(shape, dtype=torch.float64)
        piece = split_along_dim(rep, dim, group)
        start, stop = tplayers.shard_range(shape[dim], world, rank)
        assert torch.equal(piece, rep.narrow(dim, start, stop - start))
        # copy_to: identity forward, gradient summed over ranks.
        g = torch.full(shape, float(rank + 1), dtype=torch.float64)
        g_before = g.clone()
        xr = rep.clone().requires_grad_(True)
        copy_to_parallel_region(xr, group).backward(g)
        assert torch.equal(xr.grad, torch.full(shape, world * (world + 1) / 2, dtype=torch.float64))
        assert torch.equal(g, g_before), "the caller's gradient must not be reduced in place"
        # reduce_from: sum forward, identity backward; its input is left untouched.
        xr = torch.full(shape, float(rank), dtype=torch.float64, requires_grad=True)
        inner = xr * 1.0
        out = reduce_from_parallel_region(inner, group)
        assert torch.equal(out, torch.full(shape, world * (world - 1) / 2, dtype=torch.float64))
        assert torch.equal(inner, torch.full(shape, float(rank), dtype=torch.float64))
        out.backward(g)
        assert torch.equal(xr.grad, g_before)
        # An op that saved reduce_from's input for its backward still sees the original values.
        w = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        reduce_from_parallel_region(torch.exp(w), group).sum().backward()
        assert torch.equal(w.grad, torch.ones(shape, dtype=torch.float64))
    assert exchange_sizes(rank * 10, group) == [r * 10 for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_uneven_and_empty(world):
    run_ranks(_collectives, world, args=(world,), timeout=30)


def _adjoints(rank, world, seed):
    """Every autograd-paired collective of tplayers.comm: its backward is its forward's adjoint,
    <f(x), y> == <x, f*(y)> with both sides summed over all ranks (fp64, random uneven shapes)."""
    group = tplayers.default_mesh().get_group(0)
    rng = random.Random(seed)
    checked = 0
    for case in range(6):
        shape = [rng.randint(1, 4) for _ in range(3)]
        dim = rng.randrange(3)
        sizes = [rng.randint(0, 3) for _ in range(world)]  # uneven, some shards empty
        local_shape = shape[:dim] + [sizes[rank]] + shape[dim + 1 :]
        full_shape = shape[:dim] + [sum(sizes)] + shape[dim + 1 :]
        base = 1000 * seed + 100 * case
        mine = lambda s, k: _randn(s, base + 10 * k + rank)  # noqa: E731 - this rank's own values
        same = lambda s, k: _randn(s, base + 10 * k + 9)  # noqa: E731 - the same on every rank
        seq_sizes = tplayers.shard_sizes(shape[dim], world)
        seq_local = shape[:dim] + [seq_sizes[rank]] + shape[dim + 1 :]
        parts = [(2, 3), (4,), ()]
        many = lambda x: torch.cat(
            [
                t.reshape(-1)
                for t in copy_many_to_parallel_region(  # noqa: E731
                    [p.reshape(s) for p, s in zip(x.split([6, 4, 1]), parts)], group
                )
            ]
        )
        cases = {
            # name: (fn, x, y, (input kind, output kind))
            "gather_along_dim": (
                lambda x: gather_along_dim(x, dim, group, sizes),
                mine(local_shape, 0),
                same(full_shape, 1),
                (PER_RANK, REPLICATED),
            ),
            "split_along_dim": (
                lambda x: split_along_dim(x, dim, group),
                same(shape, 2),
                mine(seq_local, 3),
                (REPLICATED, PER_RANK),
            ),
            "copy_to_parallel_region": (
                lambda x: copy_to_parallel_region(x, group),
                same(shape, 4),
                mine(shape, 5),
                (REPLICATED, PER_RANK),
            ),
            "reduce_from_parallel_region": (
                lambda x: reduce_from_parallel_region(x, group),
                mine(shape, 6),
                same(shape, 7),
                (PER_RANK, REPLICATED),
            ),
            "copy_many_to_parallel_region": (many, same((11,), 8), mine((11,), 9), (REPLICATED, PER_RANK)),
            # sequence parallelism: the gathered sequence feeds a per-rank (partial) region
            "gather_from_sequence_region": (
                lambda x: gather_from_sequence_region(x, dim, group),
                mine(seq_local, 10),
                mine(shape, 11),
                (PER_RANK, PER_RANK),
            ),
            "reduce_scatter_to_sequence_region": (
                lambda x: reduce_scatter_to_sequence_region(x, dim, group),
                mine(shape, 12),
                mine(seq_local, 13),
                (PER_RANK, PER_RANK),
            ),
        }
        for name, (fn, x, y, kinds) in cases.items():
            lhs, rhs = _adjoint(fn, x, y, kinds, group)
            torch.testing.assert_close(
                rhs, lhs, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} (world {world}, dim {dim}, sizes {sizes}): {m}"
            )
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_backward_is_the_adjoint_over_all_ranks(world):
    assert run_ranks(_adjoints, world, args=(world,), timeout=30) == [6 * 7] * world


def _bad_layout(rank, world):
    group = tplayers.default_mesh().get_group(0)
    with pytest.raises(ValueError, match="holds 2 rows along dim 0, but the layout says 3"):
        all_gather_along_dim(torch.zeros(2, 1), 0, [3] * world, group)


def test_gather_checks_the_layout_before_communicating():
    run_ranks(_bad_layout, 2, timeout=20)
