"""``tplayers.reset_layouts(model)``: with the global size changing between batches (H 9 -> 10 ->
11 on 2 ranks keeps rank 0 at 5 rows while rank 1 changes), resetting every cached layout on every
rank before the forward keeps every layer exact against the serial model."""

import copy

import torch
from harness import run_ranks
from torch import nn

import tplayers


def _case(rank, world):
    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.MaxPool2d(3, 1, 1),
        nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect"),
    ).double()
    mesh = tplayers.default_mesh()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    resets = []
    for h in (9, 10, 11, 10):
        resets.append(tplayers.reset_layouts(par))
        x = torch.randn(2, 2, h, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(h))
        xs, xp = x.clone().requires_grad_(True), tplayers.shard(x, 2, mesh).requires_grad_(True)
        ys, yp = serial(xs), par(xp)
        torch.testing.assert_close(yp, tplayers.shard(ys, 2, mesh), rtol=1e-12, atol=1e-12)
        ys.square().sum().backward()
        yp.square().sum().backward()
        torch.testing.assert_close(xp.grad, tplayers.shard(xs.grad, 2, mesh), rtol=1e-12, atol=1e-12)
    return resets


def test_reset_layouts_with_a_changing_global_size():
    out = run_ranks(_case, 2, timeout=60)
    assert out[0] == [3, 3, 3, 3]  # conv, pool, conv (the norm exchanges statistics every call: no cache)
