"""transformers' ``Conv1D`` (a linear stored ``(in, out)``) as a first-class input of the
tensor-parallel linears and styles: fused sections with whole heads, row-parallel, sequence
parallelism, ties, initialisation under a seed, and the errors. fp64 against the serial modules:
outputs, input and parameter gradients, after an SGD step; the twins keep the ``(in, out)`` storage.
"""

import copy

import pytest
import torch
from hf_util import require  # noqa: E402 - sets the offline environment first
from torch import nn

require("transformers")
from harness import run_ranks  # noqa: E402
from oracle import assert_local_slices  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import tplayers  # noqa: E402
from tplayers.layers._linear_base import transposed_linear_dims  # noqa: E402

TIGHT = dict(rtol=1e-12, atol=1e-13)


class Block(nn.Module):
    """GPT-2's attention projections and MLP, made of Conv1D (attention itself left out)."""

    def __init__(self, d, ffn):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.c_fc, self.c_out = Conv1D(ffn, d), Conv1D(d, ffn)

    def forward(self, x):  # (B, S, d), or (B, S_local, d) under sequence parallelism
        q, k, v = self.c_attn(x).chunk(3, -1)  # the local q, k, v heads (equal blocks)
        x = self.c_proj(q * k + v)
        return self.c_out(torch.tanh(self.c_fc(x)))


def _plan(d, hd, sp):
    return {
        "c_attn": tplayers.ColumnParallel(sections=(d, d, d), head_dim=hd, sequence_parallel=sp),
        "c_proj": tplayers.RowParallel(head_dim=hd),
        "c_fc": tplayers.ColumnParallel(),
        "c_out": tplayers.RowParallel(sequence_parallel=sp),
    }


def _block(rank, world, sp):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    d, hd, ffn = 6, 2, 7  # 3 heads (uneven at 2 ranks, an empty rank at 4), ffn 7 uneven
    serial = Block(d, ffn).double()
    with torch.no_grad():
        for m in serial.modules():
            if isinstance(m, Conv1D):
                m.bias.normal_()
    model = tplayers.parallelize_module(copy.deepcopy(serial), _plan(d, hd, sp), mesh=mesh)
    attn = model.c_attn
    assert attn.transposed and model.c_out.transposed
    assert tuple(attn.weight.shape) == (d, sum(attn.local_sections))  # (in, out_local), as Conv1D stores it
    assert list(model.state_dict()) == list(serial.state_dict())
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 5, d, dtype=torch.float64, generator=gen)  # S = 5: uneven sequence shards
        xs = x.clone().requires_grad_()
        xp = (tplayers.shard(x, 1) if sp else x).clone().requires_grad_()
        ys, yp = serial(xs), model(xp)
        torch.testing.assert_close(yp, tplayers.shard(ys, 1) if sp else ys, **TIGHT)
        ys.pow(2).sum().backward()
        yp.pow(2).sum().backward()  # this rank's terms of the serial sum (its sequence shard under SP)
        torch.testing.assert_close(xp.grad, tplayers.shard(xs.grad, 1) if sp else xs.grad, **TIGHT)
        assert_local_slices(model, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **TIGHT)
    full = tplayers.gather_state_dict(model, all_ranks=True)
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, **TIGHT, msg=lambda m: f"{k}: {m}")
    return attn.local_sections


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence_parallel"])
@pytest.mark.parametrize("world", [2, 4])
def test_conv1d_block_exact(world, sp):
    out = run_ranks(_block, world, args=(sp,), timeout=60)
    heads = tplayers.shard_sizes(3, world)
    assert [tuple(s) for s in out] == [(h * 2,) * 3 for h in heads]


def _init_and_ties(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(7)
    serial = Conv1D(10, 4)  # weight (4, 10) normal(0.02), bias zeros
    torch.manual_seed(7)
    col = tplayers.ColumnParallelLinear(4, 10, mesh=mesh, transposed=True)
    torch.manual_seed(7)
    row = tplayers.RowParallelLinear(4, 10, mesh=mesh, transposed=True)
    a, b = tplayers.shard_range(10, world, rank)
    c, e = tplayers.shard_range(4, world, rank)
    assert torch.equal(col.weight, serial.weight[:, a:b]) and torch.equal(col.bias, serial.bias[a:b])
    assert torch.equal(row.weight, serial.weight[c:e]) and torch.equal(row.bias, serial.bias)

    tied = nn.ModuleDict({"a": Conv1D(6, 4), "b": Conv1D(6, 4)})
    tied.b.weight = tied.a.weight
    same = tplayers.parallelize_module(copy.deepcopy(tied), {"a|b": tplayers.ColumnParallel()}, mesh=mesh)
    assert same.a.weight is same.b.weight
    errors = []
    for plan in ({"a": tplayers.ColumnParallel(), "b": tplayers.RowParallel()}, {"a": tplayers.ColumnParallel()}):
        with pytest.raises(ValueError, match="break tied parameters") as err:
            tplayers.parallelize_module(copy.deepcopy(tied), plan, mesh=mesh)
        errors.append(str(err.value))
    return errors


def test_conv1d_init_under_seed_and_ties():
    for errors in run_ranks(_init_and_ties, 2, timeout=60):
        assert all("a.weight" in e and "b.weight" in e for e in errors)


def _errors(rank, world):
    mesh = tplayers.default_mesh()
    conv = Conv1D(6, 4)
    with pytest.raises(TypeError, match=r"transposed follows the module \(Conv1D\), got transposed=False"):
        tplayers.ColumnParallelLinear.from_module(conv, mesh=mesh, transposed=False)
    with pytest.raises(TypeError, match=r"expects an nn.Linear or a Conv1D-like module .*got Conv1d"):
        tplayers.RowParallelLinear.from_module(nn.Conv1d(4, 6, 1), mesh=mesh)
    with pytest.raises(TypeError, match="transposed must be a bool, got int"):
        tplayers.ColumnParallelLinear(4, 6, mesh=mesh, transposed=1)
    with pytest.raises(ValueError, match=r"sections \[2, 2\] sum to 4, expected out_features=6"):
        tplayers.parallelize_module(nn.Sequential(conv), {"0": tplayers.ColumnParallel(sections=(2, 2))}, mesh=mesh)
    return True


def test_conv1d_errors_on_every_rank():
    assert run_ranks(_errors, 2, timeout=60) == [True, True]


def test_conv1d_recognised_by_structure_or_class_name():
    class Transposed(nn.Module):  # not named Conv1D: recognised by its nf attribute
        def __init__(self, nf, nx, bias=True):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.zeros(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf)) if bias else None

    assert transposed_linear_dims(Conv1D(6, 4)) == (4, 6)
    assert transposed_linear_dims(Transposed(6, 4, bias=False)) == (4, 6)
    wrong = Transposed(6, 4)
    wrong.nf = 4  # nf disagrees with the weight's shape
    assert transposed_linear_dims(wrong) is None
    assert transposed_linear_dims(nn.Linear(4, 6)) is None
    assert transposed_linear_dims(nn.Conv1d(4, 6, 1)) is None  # 3-D weight
    bad_bias = Transposed(6, 4)
    bad_bias.bias = nn.Parameter(torch.zeros(4))
    assert transposed_linear_dims(bad_bias) is None
