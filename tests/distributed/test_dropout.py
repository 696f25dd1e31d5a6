"""Dropout RNG parity: ParallelDropout / ShardedDropout vs the serial model's nn.Dropout, same seed."""

import copy
import random

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from oracle import assert_params_match, same_on_all_ranks
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _mlp_parity(rank, world, seed):
    """Column -> dropout on the sharded hidden -> Row -> dropout on the replicated output."""
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(5):
        d, hidden = rng.randint(1, 6), rng.randint(1, 11)  # uneven, sometimes < world
        p = rng.choice([0.1, 0.5, 0.9])
        torch.manual_seed(rng.randrange(1 << 30))
        serial = nn.Sequential(
            nn.Linear(d, hidden), nn.Tanh(), nn.Dropout(p), nn.Linear(hidden, d), nn.Dropout(p)
        ).double()
        plan = {
            "0": tplayers.ColumnParallel(),
            "2": tplayers.ShardedDropout(dim=-1, full_size=hidden),
            "3": tplayers.RowParallel(),
        }
        par = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        assert isinstance(par[4], nn.Dropout)  # replicated: plain dropout, same mask on every rank
        opt_s, opt_p = torch.optim.SGD(serial.parameters(), lr=0.1), torch.optim.SGD(par.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(3, 4, d, dtype=torch.float64)
            xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            torch.manual_seed(case * 10 + step)
            ys = serial(xs)
            after = torch.random.get_rng_state()
            torch.manual_seed(case * 10 + step)
            yp = par(xp)
            assert torch.equal(torch.random.get_rng_state(), after)
            torch.testing.assert_close(yp, ys, **TIGHT)
            same_on_all_ranks(yp)
            ys.square().sum().backward(), yp.square().sum().backward()
            torch.testing.assert_close(xp.grad, xs.grad, **TIGHT)
            assert_params_match(par, serial, grads=True, **TIGHT)
            opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
            assert_params_match(par, serial, grads=False, **TIGHT)
        # eval: no dropout, no random numbers drawn
        par.eval(), serial.eval()
        x = torch.randn(2, d, dtype=torch.float64)
        state = torch.random.get_rng_state()
        torch.testing.assert_close(par(x), serial(x), **TIGHT)
        assert torch.equal(torch.random.get_rng_state(), state)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_dropout_in_mlp_equals_serial_dropout(world):
    assert all(run_ranks(_mlp_parity, world, args=(world,), timeout=60))


def _hand_written(rank, world):
    mesh = tplayers.default_mesh()
    for p in (0.0, 0.3, 1.0):
        for dim, full_size in ((1, None), (-1, 7), (0, None)):
            shape = [5, 6, 7]
            shape[dim] = 7 if full_size else 2 * world + 1  # uneven
            full = torch.randn(*shape, dtype=torch.float32)
            start, stop = tplayers.shard_range(shape[dim], world, rank)
            local = full.narrow(dim, start, stop - start).clone().requires_grad_(True)
            drop = tplayers.ParallelDropout(p, dim=dim, full_size=full_size, mesh=mesh)
            torch.manual_seed(11)
            ref = nn.functional.dropout(full, p, True)
            torch.manual_seed(11)
            with tplayers.count_collectives() as log:
                out = drop(local)
            assert torch.equal(out, ref.narrow(dim, start, stop - start)), (p, dim)  # bitwise
            exchanged = full_size is None and 0 < p and world > 1
            assert log.count() == (1 if exchanged else 0)
            out.sum().backward()
            torch.testing.assert_close(
                local.grad,
                (ref.narrow(dim, start, stop - start) != 0).float() / (1 - p) if p < 1 else torch.zeros_like(local),
            )
    # replicated: the same mask on every rank (generators seeded alike), no communication
    torch.manual_seed(3)
    with tplayers.count_collectives() as log:
        y = tplayers.ParallelDropout(0.5, mesh=mesh)(torch.ones(4, 9))
    same_on_all_ranks(y)
    assert log.count() == 0 and 0 < (y == 0).sum() < 36
    # the module's repr, from_module and errors (every rank alike)
    assert "p=0.25, dim=1" in repr(tplayers.ParallelDropout.from_module(nn.Dropout(0.25), mesh=mesh, dim=1))
    with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1\], got 1.5"):
        tplayers.ParallelDropout(1.5, mesh=mesh)
    with pytest.raises(ValueError, match="inplace=True"):
        tplayers.ParallelDropout.from_module(nn.Dropout(0.1, inplace=True), mesh=mesh)
    with pytest.raises(TypeError, match="expects an nn.Dropout, got AlphaDropout"):
        tplayers.ParallelDropout.from_module(nn.AlphaDropout(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"rank \d must hold \d of full_size=7"):
        tplayers.ParallelDropout(0.5, dim=1, full_size=7, mesh=mesh)(torch.ones(2, 7))
    bad = torch.ones(2, 1 if rank == 0 else 3)  # lengths [1, 3]: not shard_sizes(4, 2)
    with pytest.raises(
        ValueError, match=r"must be sharded as shard_sizes\(4, 2\) = \[2, 2\], got local lengths \[1, 3\]"
    ):
        tplayers.ParallelDropout(0.5, dim=1, mesh=mesh)(bad)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return True


def test_parallel_dropout_layer_slices_and_errors():
    assert all(run_ranks(_hand_written, 2, timeout=30))
