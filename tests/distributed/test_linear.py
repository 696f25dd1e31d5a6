"""ColumnParallelLinear / RowParallelLinear against serial nn.Linear (fp64, gloo ranks)."""

import copy
import random

import pytest
import torch
from harness import run_ranks
from oracle import assert_params_match, gather_tensor
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _step_and_compare(serial, parallel, make_input, mesh):
    """Forward, backward and one SGD step on both, then a second input; compare everything."""
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1)
    for step in range(2):
        x = make_input()
        xs = x.clone().requires_grad_(True)
        xp = x.clone().requires_grad_(True)
        ys, yp = serial(xs), parallel(xp)
        torch.testing.assert_close(yp, ys, **TIGHT)
        cot = torch.randn_like(ys)
        (ys * cot).sum().backward()
        (yp * cot).sum().backward()
        torch.testing.assert_close(xp.grad, xs.grad, **TIGHT)
        assert_params_match(parallel, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(parallel, serial, grads=False, **TIGHT)


def _random_mlp_cases(rank, world, seed, count):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for _ in range(count):
        d_in, hidden, d_out = rng.randint(1, 9), rng.randint(1, 11), rng.randint(1, 7)
        bias1, bias2 = rng.random() < 0.7, rng.random() < 0.7
        lead = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
        torch.manual_seed(rng.randrange(1 << 30))  # same seed on every rank: identical data
        serial = nn.Sequential(
            nn.Linear(d_in, hidden, bias=bias1), nn.Tanh(), nn.Linear(hidden, d_out, bias=bias2)
        ).double()
        parallel = tplayers.parallelize_module(
            copy.deepcopy(serial), {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}, mesh=mesh
        )
        _step_and_compare(serial, parallel, lambda: torch.randn(*lead, d_in, dtype=torch.float64), mesh)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_mlp_parity_random_sizes(world):
    run_ranks(_random_mlp_cases, world, args=(100 + world, 12), timeout=60)


def _variants(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for _ in range(6):
        d_in, d_out = rng.randint(1, 10), rng.randint(1, 10)
        bias = rng.random() < 0.5
        torch.manual_seed(rng.randrange(1 << 30))
        dense = nn.Linear(d_in, d_out, bias=bias).double()
        # Column with gather_output=True is a drop-in nn.Linear.
        col = tplayers.ColumnParallelLinear.from_module(copy.deepcopy(dense), mesh=mesh, gather_output=True)
        _step_and_compare(copy.deepcopy(dense), col, lambda: torch.randn(2, 3, d_in, dtype=torch.float64), mesh)
        # Row with input_is_parallel=False is a drop-in nn.Linear too.
        row = tplayers.RowParallelLinear.from_module(copy.deepcopy(dense), mesh=mesh, input_is_parallel=False)
        _step_and_compare(copy.deepcopy(dense), row, lambda: torch.randn(4, d_in, dtype=torch.float64), mesh)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_output_and_full_input_variants(world):
    run_ranks(_variants, world, args=(7 * world,), timeout=60)


def _hand_written(rank, world):
    """Layers built directly (not from_module) with ranks seeded differently: shapes, init
    bounds, and a consistent function once the replicated Row bias is made equal."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(1234 + rank)  # different seeds per rank: slices of different draws
    col = tplayers.ColumnParallelLinear(20, 7, mesh=mesh)
    row = tplayers.RowParallelLinear(7, 5, mesh=mesh)
    sizes = tplayers.shard_sizes(7, world)
    assert col.weight.shape == (sizes[rank], 20) and col.bias.shape == (sizes[rank],)
    assert row.weight.shape == (5, sizes[rank]) and row.bias.shape == (5,)
    bound = 1 / 20**0.5
    assert col.weight.abs().max() <= bound and row.weight.abs().max() <= 1 / 7**0.5
    assert row.bias.abs().max() <= 1 / 7**0.5
    with torch.no_grad():
        torch.distributed.broadcast(row.bias, 0)  # replicated: must agree (see reset_parameters)
    x = torch.randn(3, 20)
    torch.distributed.broadcast(x, 0)
    y = row(col(x))
    full_w1 = gather_tensor(col, "weight", col.weight.detach())
    full_b1 = gather_tensor(col, "bias", col.bias.detach())
    full_w2 = gather_tensor(row, "weight", row.weight.detach())
    torch.testing.assert_close(y, (x @ full_w1.T + full_b1) @ full_w2.T + row.bias.detach(), rtol=1e-5, atol=1e-5)
    assert f"rank={rank}/{world}" in repr(col) and "out_features=7" in repr(col)
    return tuple(col.weight.shape)


def test_hand_written_layers():
    assert run_ranks(_hand_written, 3, timeout=30) == [(3, 20), (2, 20), (2, 20)]


def _count(rank, world, b, s, h, ffn):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h)).double()
    model = tplayers.parallelize_module(
        serial, {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}, mesh=mesh
    )
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    with tplayers.count_collectives() as fwd:
        y = model(x)
    with tplayers.count_collectives() as bwd:
        y.sum().backward()
    return fwd.summary(), bwd.summary()


def test_column_row_mlp_issues_one_all_reduce_each_way():
    b, s, h = 2, 5, 6
    for fwd, bwd in run_ranks(_count, 2, args=(b, s, h, 11), timeout=30):
        assert fwd == {"all_reduce": (1, b * s * h * 8)}
        assert bwd == {"all_reduce": (1, b * s * h * 8)}


def _bad_inputs(rank, world):
    mesh = tplayers.default_mesh()
    col = tplayers.ColumnParallelLinear(8, 6, mesh=mesh)
    row = tplayers.RowParallelLinear(6, 4, mesh=mesh)
    msgs = []
    bad = [
        (col, torch.randn(2, 7)),  # wrong width
        (col, torch.randn(2, 8, dtype=torch.float64)),  # wrong dtype
        (col, torch.empty(2, 8, device="meta")),  # wrong device
        (row, torch.randn(2, 6)),  # full width given to an input_is_parallel layer
    ]
    with tplayers.count_collectives() as log:
        for layer, x in bad:
            with pytest.raises(ValueError) as err:
                layer(x)
            msgs.append(str(err.value))
    assert log.count() == 0, "a bad input must be rejected before any collective"
    # Every rank is still in step: a real collective afterwards completes.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world
    return msgs


def test_bad_input_raises_on_every_rank_before_any_collective():
    out = run_ranks(_bad_inputs, 2, timeout=20)
    for msgs in out:
        assert "last dim 8, got shape (2, 7)" in msgs[0]
        assert "dtype" in msgs[1] and "torch.float64" in msgs[1]
        assert "device" in msgs[2] and "meta" in msgs[2]
        assert "last dim 3" in msgs[3]


def _constructor_errors(rank, world):
    with pytest.raises(ValueError, match="out_features must be a positive int, got 0"):
        tplayers.ColumnParallelLinear(3, 0)
    with pytest.raises(TypeError, match="nn.Linear"):
        tplayers.RowParallelLinear.from_module(nn.Conv2d(1, 1, 1))
    with pytest.raises(ValueError, match="1-D"):
        tplayers.ColumnParallelLinear(3, 4, mesh=torch.distributed.device_mesh.init_device_mesh("cpu", (1, 1)))


def test_constructor_errors():
    run_ranks(_constructor_errors, 1, timeout=20)
