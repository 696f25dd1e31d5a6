"""Plan matching, errors and explain (world of one, in a forked rank)."""

import copy
import re

import pytest
import torch
from harness import run_ranks
from torch import nn

import tplayers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc2(self.act(self.fc1(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


PLAN = {r"blocks\.\d+\.fc1": tplayers.ColumnParallel(), r"blocks\.\d+\.fc2": tplayers.RowParallel()}


def _plan_errors(rank, world):
    net = Net()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "plan key 'blocks\\.\\d+\\.fc3' matches no module; candidates: <root> (Net), blocks (ModuleList)"
        )
        + ".*blocks.0.fc1 \\(Linear\\)",
    ):
        tplayers.parallelize_module(net, {r"blocks\.\d+\.fc3": tplayers.ColumnParallel()})
    with pytest.raises(ValueError, match=r"module 'head' \(Linear\) is matched by two plan keys: 'head' and Linear"):
        tplayers.parallelize_module(net, {"head": tplayers.ColumnParallel(), nn.Linear: tplayers.RowParallel()})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "plan key 'blocks\\.0\\.norm': ColumnParallel expects Linear or Embedding (or a Conv1D-like linear: weight (in, out) and nf), but module 'blocks.0.norm' is LayerNorm"
        ),
    ):
        tplayers.parallelize_module(net, {r"blocks\.0\.norm": tplayers.ColumnParallel()})
    with pytest.raises(ValueError, match="not a valid regex"):
        tplayers.parallelize_module(net, {"blocks[": tplayers.ColumnParallel()})
    with pytest.raises(ValueError, match="nested"):
        tplayers.parallelize_module(
            net, {r"blocks\.0": lambda n, m, mesh: m, r"blocks\.0\.fc1": tplayers.ColumnParallel()}
        )
    with pytest.raises(TypeError, match="value must be a ParallelStyle"):
        tplayers.parallelize_module(net, {"head": 3})
    with pytest.raises(TypeError, match="plan key must be"):
        tplayers.parallelize_module(net, {42: tplayers.ColumnParallel()})
    with pytest.raises(TypeError, match="returned int"):
        tplayers.parallelize_module(net, {"head": lambda n, m, mesh: 1})
    # Nothing was swapped by any failed call: validation precedes mutation.
    assert all(type(m) in (nn.Linear, nn.ReLU, nn.LayerNorm, Block, Net, nn.ModuleList) for m in net.modules())


def test_plan_errors_name_key_and_module():
    run_ranks(_plan_errors, 1, timeout=30)


def _regex_type_and_function_keys(rank, world):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 4)
    ref = net(x)
    calls = []

    def head_fn(name, module, mesh):
        calls.append(name)
        return tplayers.ColumnParallelLinear.from_module(module, mesh=mesh, gather_output=True)

    swapped = tplayers.parallelize_module(copy.deepcopy(net), {**PLAN, "head": head_fn})
    assert calls == ["head"]
    assert isinstance(swapped.blocks[1].fc1, tplayers.ColumnParallelLinear)
    assert isinstance(swapped.blocks[1].fc2, tplayers.RowParallelLinear)
    torch.testing.assert_close(swapped(x), ref)
    by_type = tplayers.parallelize_module(copy.deepcopy(net), {nn.Linear: tplayers.ColumnParallel(gather_output=True)})
    assert sum(isinstance(m, tplayers.ColumnParallelLinear) for m in by_type.modules()) == 5
    torch.testing.assert_close(by_type(x), ref)
    root = tplayers.parallelize_module(nn.Linear(4, 2), {"": tplayers.RowParallel(input_is_parallel=False)})
    assert isinstance(root, tplayers.RowParallelLinear)


def test_regex_type_and_function_keys():
    run_ranks(_regex_type_and_function_keys, 1, timeout=30)


def _warns_when_grads_exist(rank, world):
    net = Net()
    net(torch.randn(2, 4)).sum().backward()
    with pytest.warns(UserWarning, match="Build the optimizer after"):
        tplayers.parallelize_module(net, PLAN)


def test_warns_about_optimizer_built_too_early():
    run_ranks(_warns_when_grads_exist, 1, timeout=30)


def _explain(rank, world):
    net = Net()
    before = copy.deepcopy(net.state_dict())
    table = tplayers.explain(net, PLAN, print_table=False)
    for k, v in net.state_dict().items():  # explain changes nothing
        assert torch.equal(v, before[k])
    assert all(type(m) is not tplayers.ColumnParallelLinear for m in net.modules())
    return str(table), table.total_before, table.total_after, [r[4:] for r in table.rows]


def test_explain_table_on_two_ranks():
    out = run_ranks(_explain, 2, timeout=30)
    text, before, after, rows = out[0]
    fc1 = (4 * 8 + 8) * 4
    fc2 = (8 * 4 + 4) * 4
    assert rows[0] == (fc1, fc1 // 2, "fwd: -; bwd: all_reduce")
    assert rows[2] == (fc2, (4 * 4 + 4) * 4, "fwd: all_reduce; bwd: -")
    total = sum(p.numel() * 4 for p in Net().parameters())
    assert before == total and after == total - 2 * (fc1 + fc2) + 2 * (fc1 // 2 + 80)
    assert "plan on a mesh of 2 ranks" in text and "blocks.1.fc2" in text and "RowParallelLinear" in text


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1))
        self.head = nn.Linear(3, 2)


def _structure(model):
    """Every (name, module object, parameter objects) of the tree: identity, not values."""
    return [(n, id(m), tuple(id(p) for p in m.parameters(recurse=False))) for n, m in model.named_modules()]


def _fails_partway(rank, world):
    # A partition function that raises after other keys were built: nothing is swapped.
    net = Net()
    before = _structure(net)
    built = []

    def broken(name, module, mesh):
        built.append(name)
        raise RuntimeError("the user's partition function failed")

    with pytest.raises(RuntimeError, match="partition function failed"):
        tplayers.parallelize_module(net, {**PLAN, "head": broken})
    assert built == ["head"] and _structure(net) == before
    # DomainParallel rewires its subtree while building: a later failure undoes that too.
    conv = ConvNet()
    before = _structure(conv)
    with pytest.raises(RuntimeError, match="partition function failed"):
        tplayers.parallelize_module(conv, {"trunk": tplayers.DomainParallel(shard_dims=(2,)), "head": broken})
    assert _structure(conv) == before
    assert all(type(m) in (nn.Conv2d, nn.ReLU, nn.Sequential, nn.Linear, ConvNet) for m in conv.modules())
    # ... and the same model then parallelizes fine.
    ok = tplayers.parallelize_module(conv, {"trunk": tplayers.DomainParallel(shard_dims=(2,))})
    assert isinstance(ok.trunk[0], tplayers.DistributedConv2d)
    return True


def test_failed_plan_leaves_model_unchanged():
    run_ranks(_fails_partway, 1, timeout=30)
