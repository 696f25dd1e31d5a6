"""Partition functions under ``src_rank`` (issue 24): every rank's function gets rank src's serial
module and generator state, and what it builds is kept as built (never re-cut from the serial
tensors with the new layer's specs, which may describe a transformed copy)."""

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from oracle import assert_local_slices
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-10, atol=1e-12)


class FusedGate(nn.Module):
    """A fused q|k|v projection whose blocks are used elementwise, then a row-parallel output."""

    def __init__(self, d=8, d_in=6):
        super().__init__()
        self.qkv = nn.Linear(d_in, 3 * d)
        self.proj = nn.Linear(d, d_in)
        self.register_buffer("shift", torch.randn(d_in))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)  # (..., d) each serially; this rank's (..., d / tp) when regrouped
        return self.proj(q * torch.sigmoid(k) + v) + self.shift


def regrouped_rows(d: int, parts: int, rank: int) -> list:
    """Serial rows of a fused q|k|v weight that rank ``rank`` holds: its slice of each block."""
    a, b = tplayers.shard_range(d, parts, rank)
    return [blk * d + i for blk in range(3) for i in range(a, b)]


def regroup(name, module, mesh):
    """The pre-``sections`` recipe: reorder the rows so a balanced split gives each rank [q_r | k_r | v_r]."""
    parts, d = mesh.size(0), module.out_features // 3
    rows = [i for r in range(parts) for i in regrouped_rows(d, parts, r)]
    dense = nn.Linear(module.in_features, module.out_features, dtype=module.weight.dtype)
    with torch.no_grad():
        dense.weight.copy_(module.weight[rows])
        dense.bias.copy_(module.bias[rows])
    return tplayers.ColumnParallelLinear.from_module(dense, mesh=mesh)


def _everything(model):
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _regrouping(rank, world, src):
    mesh = tplayers.default_mesh()
    torch.manual_seed(100 + rank)  # a different model on every rank: the result must be rank src's
    model = FusedGate().double()
    serial = copy.deepcopy(model)
    for t in _everything(serial).values():
        dist.broadcast(t.data, src)
    kwargs = {} if src == 0 else {"src_rank": src}  # the default is src_rank=0
    with tplayers.count_collectives() as log:
        par = tplayers.parallelize_module(model, {"qkv": regroup, "proj": tplayers.RowParallel()}, mesh=mesh, **kwargs)
    assert [r.tag for r in log.records if r.kind == "all_gather"] == ["src_rank.partition", "src_rank.check"]
    rows = regrouped_rows(8, world, rank)
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        torch.testing.assert_close(par.qkv.weight, serial.qkv.weight[rows], **TIGHT)
        torch.testing.assert_close(par.qkv.bias, serial.qkv.bias[rows], **TIGHT)
        torch.testing.assert_close(par.shift, serial.shift, rtol=0, atol=0)
        x = torch.randn(5, 6, dtype=torch.float64, generator=gen)
        xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ys, yp = serial(xs), par(xp)
        torch.testing.assert_close(yp, ys, **TIGHT)
        cot = torch.randn(ys.shape, dtype=ys.dtype, generator=gen)
        (ys * cot).sum().backward()
        (yp * cot).sum().backward()
        torch.testing.assert_close(xp.grad, xs.grad, **TIGHT)
        torch.testing.assert_close(par.qkv.weight.grad, serial.qkv.weight.grad[rows], **TIGHT)
        torch.testing.assert_close(par.qkv.bias.grad, serial.qkv.bias.grad[rows], **TIGHT)
        assert_local_slices(par.proj, serial.proj, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(par.proj, serial.proj, grads=False, **TIGHT)
    return True


@pytest.mark.parametrize("world,src", [(2, 0), (4, 0), (2, 1)])
def test_regrouping_partition_function_is_exact_under_src_rank(world, src):
    assert all(run_ranks(_regrouping, world, args=(src,), timeout=60))


def _fresh_layer(rank, world):
    """A function that draws a new layer draws it with rank 0's generator: one global tensor."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(7 + rank)
    model = nn.Sequential(nn.Linear(5, 4)).double()
    state = torch.get_rng_state()
    src_state = state.clone()
    dist.broadcast(src_state, 0)
    wider = lambda name, m, mesh: tplayers.ColumnParallelLinear(m.in_features, 9, mesh=mesh, dtype=torch.float64)  # noqa: E731
    par = tplayers.parallelize_module(model, {"0": wider}, mesh=mesh)
    assert torch.equal(torch.get_rng_state(), state), "the caller's generator must be left as it was"
    torch.set_rng_state(src_state)
    ref = nn.Linear(5, 9, dtype=torch.float64)  # what rank 0 draws serially from that state
    a, b = tplayers.shard_range(9, world, rank)
    torch.testing.assert_close(par[0].weight, ref.weight[a:b], rtol=0, atol=0)
    torch.testing.assert_close(par[0].bias, ref.bias[a:b], rtol=0, atol=0)
    return True


def test_partition_function_drawing_a_new_layer_draws_rank_src_s():
    assert all(run_ranks(_fresh_layer, 2, timeout=60))
