"""Sequence parallelism: a GPT-2 block with SP (and dropout) vs the serial block, fp64 (gloo ranks)."""

import copy

import pytest
import torch
import torch.distributed as dist
from gpt_block import Block, sp_plan
from harness import run_ranks
from oracle import assert_params_match
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-10, atol=1e-10)


def _seq_slice(t, world, rank):
    start, stop = tplayers.shard_range(t.size(1), world, rank)
    return t[:, start:stop]


def _block_parity(rank, world, seqs, heads, rms, p):
    mesh = tplayers.default_mesh()
    d = 4 * heads
    torch.manual_seed(7)  # one seed everywhere: same serial block, data and dropout masks
    serial = Block(d, heads, p=p, dtype=torch.float64, rms=rms)
    par = tplayers.parallelize_module(copy.deepcopy(serial), sp_plan(heads), mesh=mesh)
    assert isinstance(par.ln_1, tplayers.DomainReplicated)
    assert isinstance(par.mlp.dropout, tplayers.ParallelDropout) and par.mlp.dropout.dim == 1
    # SGD with momentum: AdamW would turn the key bias's gradient (zero up to rounding:
    # softmax ignores it) into +-lr steps of noise in both models alike
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)
    for step, s in enumerate(seqs):  # two steps, the sequence length changes (uneven)
        x = torch.randn(2, s, d, dtype=torch.float64)
        cot = torch.randn(2, s, d, dtype=torch.float64)
        xs = x.clone().requires_grad_(True)
        xp = _seq_slice(x, world, rank).clone().requires_grad_(True)  # this rank's tokens
        seed = 100 + step
        torch.manual_seed(seed)
        ys = serial(xs)
        state_after_serial = torch.random.get_rng_state()
        torch.manual_seed(seed)
        with tplayers.count_collectives() as fwd:
            yp = par(xp)
        assert torch.equal(torch.random.get_rng_state(), state_after_serial)  # generators in step
        torch.testing.assert_close(yp, _seq_slice(ys, world, rank), **TIGHT)
        (ys * cot).sum().backward()
        with tplayers.count_collectives() as bwd:
            (yp * _seq_slice(cot, world, rank)).sum().backward()
        torch.testing.assert_close(xp.grad, _seq_slice(xs.grad, world, rank), **TIGHT)
        assert_params_match(par, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(par, serial, grads=False, **TIGHT)
        if world > 1:
            _check_collectives(fwd, bwd, world, s, d, p)
    return True


def _check_collectives(fwd, bwd, world, s, d, p):
    """Per block: all-gather + reduce-scatter forward (twice: attention, MLP), the adjoints backward."""
    largest = tplayers.shard_sizes(s, world)[0]
    act = 2 * world * largest * d * 8  # one (B, S, d) fp64 activation as padded on the wire
    data = lambda log, kind: [r for r in log.records if r.kind == kind and r.tag != "sizes"]  # noqa: E731
    assert [(r.tag, r.nbytes) for r in data(fwd, "all_gather")] == [("sp.linear.fwd", act)] * 2
    assert [(r.tag, r.nbytes) for r in data(fwd, "reduce_scatter")] == [("sp.linear.fwd", act)] * 2
    assert fwd.count("all_reduce") == 0
    sizes = [r for r in fwd.records if r.tag == "sizes"]  # one int per rank: SP linears (+ dropouts)
    assert len(sizes) == (4 if p > 0 else 2) and all(r.nbytes == world * 8 for r in sizes)
    assert [(r.tag, r.nbytes) for r in data(bwd, "reduce_scatter")] == [("sp.linear.bwd", act)] * 2
    assert [(r.tag, r.nbytes) for r in data(bwd, "all_gather")] == [("sp.linear.bwd", act)] * 2
    # replicated norm parameters: their gradients summed over the group (weight + bias in one)
    assert [r.tag for r in bwd.records if r.kind == "all_reduce"] == ["copy_many.bwd"] * 2


@pytest.mark.parametrize("world,seqs,rms", [(2, (7, 4), False), (3, (8, 10), True)])
def test_gpt2_block_sequence_parallel_with_dropout_matches_serial(world, seqs, rms):
    heads = 6  # whole heads per rank at tp = 2 and 3
    assert all(run_ranks(_block_parity, world, args=(seqs, heads, rms, 0.2), timeout=90))


def test_gpt2_block_sequence_parallel_without_dropout_matches_serial():
    assert all(run_ranks(_block_parity, 2, args=((5, 6), 2, False, 0.0), timeout=60))


def _functions_and_errors(rank, world):
    mesh = tplayers.default_mesh()
    group = mesh.get_group(0)
    torch.manual_seed(0)
    # the plain named Functions: gather (fwd AG / bwd RS) and reduce-scatter (fwd RS / bwd AG)
    full = torch.randn(3, 5, 4, dtype=torch.float64)
    local = _seq_slice(full, world, rank).clone().requires_grad_(True)
    g = tplayers.comm.gather_from_sequence_region(local, 1, group)
    torch.testing.assert_close(g, full, rtol=0, atol=0)
    (g * (rank + 1)).sum().backward()  # the gradient is summed over ranks, then this rank's slice kept
    torch.testing.assert_close(local.grad, torch.full_like(local, world * (world + 1) / 2))
    part = (full * (rank + 1)).requires_grad_(True)
    r = tplayers.comm.reduce_scatter_to_sequence_region(part, 1, group)
    torch.testing.assert_close(r, _seq_slice(full * world * (world + 1) / 2, world, rank))
    r.sum().backward()
    torch.testing.assert_close(part.grad, torch.ones_like(full))
    # errors, on every rank, before any data moves
    col = tplayers.ColumnParallelLinear(4, 6, mesh=mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_dim=2 must name a dim of the input other than the last"):
        tplayers.ColumnParallelLinear(4, 6, mesh=mesh, sequence_parallel=True, sequence_dim=2)(local.detach().float())
    bad = torch.randn(3, 2 if rank == 0 else 4, 4)  # not the balanced layout: [2, 4]
    with pytest.raises(
        ValueError, match=r"sequence must be sharded as shard_sizes\(6, 2\) = \[3, 3\], got local lengths \[2, 4\]"
    ):
        col(bad)
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        tplayers.RowParallelLinear(4, 6, mesh=mesh, sequence_parallel=True, input_is_parallel=False)
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        tplayers.ColumnParallelLinear(4, 6, mesh=mesh, sequence_parallel=1)
    with pytest.raises(ValueError, match="SequenceParallel expects LayerNorm or RMSNorm or Dropout"):
        tplayers.parallelize_module(nn.Sequential(nn.Linear(2, 2)), {"0": tplayers.SequenceParallel()}, mesh=mesh)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return True


def test_sequence_functions_and_errors_on_every_rank():
    assert all(run_ranks(_functions_and_errors, 2, timeout=30))


class _SerialMLPBlock(nn.Module):
    def __init__(self, d, hidden, p):
        super().__init__()
        self.norm = nn.LayerNorm(d, dtype=torch.float64)
        self.fc1 = nn.Linear(d, hidden, dtype=torch.float64)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, d, dtype=torch.float64)
        self.out_drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.out_drop(self.fc2(self.drop(torch.relu(self.fc1(self.norm(x))))))


class _HandWrittenSPBlock(nn.Module):
    """The same block written Megatron style with sequence parallelism, built under the same seed."""

    def __init__(self, d, hidden, p, mesh):
        super().__init__()
        self.norm = tplayers.DomainReplicated(nn.LayerNorm(d, dtype=torch.float64), mesh)  # grads summed
        self.fc1 = tplayers.ColumnParallelLinear(d, hidden, mesh=mesh, sequence_parallel=True, dtype=torch.float64)
        self.drop = tplayers.ParallelDropout(p, dim=-1, full_size=hidden, mesh=mesh)
        self.fc2 = tplayers.RowParallelLinear(hidden, d, mesh=mesh, sequence_parallel=True, dtype=torch.float64)
        self.out_drop = tplayers.ParallelDropout(p, dim=1, mesh=mesh)

    def forward(self, x):  # (B, S_local, d)
        return x + self.out_drop(self.fc2(self.drop(torch.relu(self.fc1(self.norm(x))))))


def _hand_written_block(rank, world):
    mesh = tplayers.default_mesh()
    d, hidden, p = 5, 2 * world + 1, 0.3
    torch.manual_seed(21)
    serial = _SerialMLPBlock(d, hidden, p)
    torch.manual_seed(21)  # built directly under the same seed: the serial block's slices
    par = _HandWrittenSPBlock(d, hidden, p, mesh)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(par.parameters(), lr=0.1)
    for step, s in enumerate((2 * world + 1, world + 2)):
        x = torch.randn(3, s, d, dtype=torch.float64)
        xs, xp = x.clone().requires_grad_(True), _seq_slice(x, world, rank).clone().requires_grad_(True)
        torch.manual_seed(step)
        ys = serial(xs)
        torch.manual_seed(step)
        yp = par(xp)
        torch.testing.assert_close(yp, _seq_slice(ys, world, rank), **TIGHT)
        ys.square().sum().backward(), yp.square().sum().backward()
        torch.testing.assert_close(xp.grad, _seq_slice(xs.grad, world, rank), **TIGHT)
        assert_params_match(par, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(par, serial, grads=False, **TIGHT)
    return True


def test_hand_written_sequence_parallel_block_built_under_one_seed_is_the_serial_block():
    assert all(run_ranks(_hand_written_block, 3, timeout=60))
