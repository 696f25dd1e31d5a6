"""Autograd-paired collectives: values, adjoint gradients, uneven/empty shards, accounting."""

import random

import pytest
import torch

import tplayers
from harness import run_ranks
from tplayers.comm import (
    all_gather_along_dim,
    copy_to_parallel_region,
    exchange_sizes,
    gather_along_dim,
    reduce_from_parallel_region,
    split_along_dim,
)


def _adjoint(fn, x, y_like):
    """<fn(x), y> and <x, fn^T(y)> computed through autograd."""
    x = x.clone().requires_grad_(True)
    out = fn(x)
    y = y_like(out)
    (out * y).sum().backward()
    return (out.detach() * y).sum(), (x.detach() * x.grad).sum(), out.detach(), x.grad


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
        torch.manual_seed(seed + rank)
        x = torch.randn(local_shape, dtype=torch.float64)
        full = gather_along_dim(x, dim, group)  # sizes exchanged
        assert full.shape[dim] == sum(sizes)
        parts = torch.split(full, sizes, dim)
        assert torch.equal(parts[rank], x)
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


def _bad_layout(rank, world):
    group = tplayers.default_mesh().get_group(0)
    with pytest.raises(ValueError, match="holds 2 rows along dim 0, but the layout says 3"):
        all_gather_along_dim(torch.zeros(2, 1), 0, [3] * world, group)


def test_gather_checks_the_layout_before_communicating():
    run_ranks(_bad_layout, 2, timeout=20)
