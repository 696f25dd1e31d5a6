"""parallelize_module(..., src_rank=r): the result is rank r's model, on every rank (gloo ranks)."""

import copy

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from oracle import assert_params_match
from torch import nn

import tplayers

TIGHT = dict(rtol=0, atol=0)
PLAN = {
    "fc1": tplayers.ColumnParallel(),
    "fc2": tplayers.RowParallel(),
    r"head\.\d": tplayers.ColumnParallel(gather_output=True),
}


class Net(nn.Module):
    def __init__(self, d=5, hidden=7, out=4, dtype=torch.float64):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, d, dtype=dtype)
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.bn = nn.BatchNorm1d(d, dtype=dtype)
        self.head = nn.Sequential(nn.Linear(d, out, bias=False, dtype=dtype), nn.Linear(out, out, dtype=torch.float32))
        self.scale = nn.Parameter(torch.randn(d, dtype=dtype))
        self.register_buffer("offset", torch.randn(d, dtype=dtype))
        self.register_buffer("mask", torch.rand(d) > 0.5, persistent=False)
        with torch.no_grad():  # non-default running stats, different on every rank
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.num_batches_tracked.fill_(int(torch.randint(0, 100, ())))
            self.norm.weight.normal_()

    def forward(self, x):
        h = self.fc2(torch.tanh(self.fc1(x))) * self.scale + self.offset * self.mask
        h = self.head[0](self.bn(self.norm(h)))
        return self.head[1](h.float())


def _everything(model):
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _from_rank(rank, world, src, sizes):
    mesh = tplayers.default_mesh()
    torch.manual_seed(1000 + 17 * rank)  # unseeded in effect: every rank builds a different model
    model = Net(*sizes)
    oracle = copy.deepcopy(model)
    for t in _everything(oracle).values():  # the test's own, plain transfer of rank src's model
        dist.broadcast(t.data, src)
    with tplayers.count_collectives() as log:
        par = tplayers.parallelize_module(model, PLAN, mesh=mesh, src_rank=src)
    # every parameter (gathered) and every buffer equals rank src's
    assert_params_match(par, oracle, grads=False, **TIGHT)
    ours, theirs = _everything(par), _everything(oracle)
    assert set(ours) == set(theirs)
    for name, b in par.named_buffers():
        assert torch.equal(b, theirs[name]), name
    # outputs and a training step too
    x = torch.randn(6, sizes[0], dtype=torch.float64)
    dist.broadcast(x, 0)
    for m in (par, oracle):
        m.train()
    torch.testing.assert_close(par(x), oracle(x), rtol=1e-6, atol=1e-6)
    for name, b in par.named_buffers():  # BatchNorm running stats updated alike (up to rounding)
        torch.testing.assert_close(b, theirs[name], rtol=1e-12, atol=1e-12, msg=name)
    # few collectives: one small agreement exchange, then one broadcast per dtype (fp64, bool, int64)
    # and one scatter per sharded dtype (fp64, fp32)
    summary = log.summary()
    assert summary["all_gather"][0] == 1 and summary["broadcast"][0] == 3 and summary["scatter"][0] == 2, summary
    return True


@pytest.mark.parametrize("src", [0, 2])
def test_unseeded_model_parallelized_on_3_ranks_equals_src_model(src):
    assert all(run_ranks(_from_rank, 3, args=(src, (5, 7, 4)), timeout=60))


def test_uneven_and_empty_shards_from_rank_1():
    assert all(run_ranks(_from_rank, 4, args=(1, (3, 2, 5)), timeout=60))  # hidden 2 < 4 ranks


def _own_copy(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(rank)
    model = Net()
    before = {k: v.detach().clone() for k, v in _everything(model).items()}
    with tplayers.count_collectives() as log:
        par = tplayers.parallelize_module(model, PLAN, mesh=mesh, src_rank=None)
    assert log.count() == 0
    for key, t in _everything(par).items():
        mod_name, _, pname = key.rpartition(".")
        mod = par.get_submodule(mod_name)
        spec = mod.shard_specs()[pname] if isinstance(mod, tplayers.layers.ShardedModule) else None
        expected = spec.take(before[key]) if spec is not None else before[key]
        assert torch.equal(t, expected), key
    return True


def test_src_rank_none_keeps_each_rank_copy_without_communication():
    assert all(run_ranks(_own_copy, 2, timeout=30))


class _Built(tplayers.ParallelStyle):
    """A custom style building whatever ``make(module, mesh)`` returns."""

    accepts = (nn.Linear,)

    def __init__(self, make):
        self.make = make

    def build(self, name, module, mesh):
        return self.make(module, mesh)


def _failures(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(rank)

    def unchanged(model, fn):
        names = {k: v for k, v in _everything(model).items()}
        values = {k: v.detach().clone() for k, v in names.items()}
        with tplayers.count_collectives() as log:
            fn()
        after = _everything(model)
        assert set(after) == set(names) and all(after[k] is names[k] for k in names)  # same objects
        assert all(torch.equal(after[k], values[k]) for k in names)  # same values
        assert isinstance(model.fc1, nn.Linear)
        return log

    model = Net()
    msgs = []
    for bad, err in ((3 * world, ValueError), (-1, ValueError), ("0", TypeError), (True, TypeError)):
        with pytest.raises(err, match="src_rank") as info:
            unchanged(model, lambda: tplayers.parallelize_module(model, PLAN, mesh=mesh, src_rank=bad))
        msgs.append(str(info.value))
    # ranks disagree on the model (rank 1's hidden size): ValueError on every rank, nothing moved
    odd = Net(hidden=8 if rank == 1 else 7)
    with pytest.raises(ValueError, match="model tensors differs across ranks"):
        unchanged(odd, lambda: tplayers.parallelize_module(odd, PLAN, mesh=mesh))
    # ranks disagree on src_rank
    with pytest.raises(ValueError, match="src_rank differs across ranks"):
        unchanged(model, lambda: tplayers.parallelize_module(model, PLAN, mesh=mesh, src_rank=rank))

    # a partition function failing on rank 1 only: every rank raises, no rank hangs
    def flaky(name, module, mesh):
        if dist.get_rank() == 1:
            raise RuntimeError("partition function failed on rank 1")
        return tplayers.ColumnParallelLinear.from_module(module, mesh=mesh)

    expected = RuntimeError if rank == 1 else ValueError
    with pytest.raises(expected, match="rank 1|rank\\(s\\) \\[1\\]"):
        unchanged(model, lambda: tplayers.parallelize_module(model, {"fc1": flaky}, mesh=mesh))
    # (a partition function's output is rank src's by construction and never re-cut, see
    # test_partition_src.py; a style's output is cut from the serial tensors, so these refuse:)
    # a shard that matches no serial tensor (a custom style changed its shape)
    wider = _Built(
        lambda module, mesh: tplayers.ColumnParallelLinear(module.in_features, 9, mesh=mesh, dtype=torch.float64)
    )
    with pytest.raises(ValueError, match=r"shard fc1.weight of global shape \(9, 5\) has no serial tensor"):
        unchanged(model, lambda: tplayers.parallelize_module(model, {"fc1": wider}, mesh=mesh))
    # a shard laid out over another mesh than parallelize_module's
    own = torch.distributed.device_mesh.DeviceMesh("cpu", [rank])
    elsewhere = _Built(lambda module, mesh: tplayers.ColumnParallelLinear.from_module(module, mesh=own))
    with pytest.raises(ValueError, match="fc1.weight is shard 0 of 1, but parallelize_module's mesh is"):
        unchanged(model, lambda: tplayers.parallelize_module(model, {"fc1": elsewhere}, mesh=mesh))
    # a meta model cannot send values: ValueError on every rank
    meta = Net().to("meta")
    with pytest.raises(ValueError, match="meta device"):
        tplayers.parallelize_module(meta, PLAN, mesh=mesh)
    assert isinstance(meta.fc1, nn.Linear)
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank still in step
    assert t.item() == world
    return msgs


def test_failures_raise_on_every_rank_and_leave_model_unchanged():
    for msgs in run_ranks(_failures, 2, timeout=30):
        assert "[0, 2)" in msgs[0] and "got 6" in msgs[0]
        assert "got str" in msgs[2]


def _two_d(rank, world, src):
    """A domain-parallel CNN over a 2-D mesh: broadcast along both mesh dims from rank src."""
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(50 + rank)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1)).double()
    model.register_buffer("stat", torch.randn(4, dtype=torch.float64))  # a buffer differing per rank too
    oracle = copy.deepcopy(model)
    for t in _everything(oracle).values():
        dist.broadcast(t.data, src)
    par = tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2, 3))}, mesh=mesh, src_rank=src)
    ours = _everything(par)
    for name, t in _everything(oracle).items():
        assert torch.equal(ours[name], t), name
    return True


def test_two_d_mesh_takes_every_tensor_from_src():
    assert all(run_ranks(_two_d, 4, args=(3,), timeout=60))


class _SwappedRows(tplayers.layers.ShardedModule):
    """A bias-free row shard in a layout ``for_index`` cannot rebuild: ranks 0 and 1 hold each
    other's balanced rows (uneven), the other ranks their own."""

    def __init__(self, dense, mesh):
        super().__init__()
        self._bind_mesh(mesh)
        rank, parts = mesh.get_local_rank(0), mesh.size(0)
        a, b = tplayers.shard_range(dense.out_features, parts, {0: 1, 1: 0}.get(rank, rank))
        self._spec = tplayers.ShardSpec(tuple(dense.weight.shape), 0, a, b, parts, rank)
        self.weight = nn.Parameter(self._spec.take(dense.weight.detach()).clone())

    def shard_specs(self):
        return {"weight": self._spec}

    def forward(self, x):
        return x @ self.weight.T


def _irregular(rank, world, src):
    mesh = tplayers.default_mesh()
    torch.manual_seed(300 + rank)
    model = nn.Sequential(nn.Linear(4, 7, bias=False), nn.Linear(7, 3)).double()
    oracle = copy.deepcopy(model)
    for t in _everything(oracle).values():
        dist.broadcast(t.data, src)
    plan = {"0": _Built(_SwappedRows), "1": tplayers.RowParallel()}  # a style: its output is cut from src's tensors
    with tplayers.count_collectives() as log:
        par = tplayers.parallelize_module(model, plan, mesh=mesh, src_rank=src)
    assert torch.equal(par[0].weight, par[0].shard_specs()["weight"].take(oracle[0].weight))
    assert_params_match(par[1:], oracle[1:], grads=False, **TIGHT)
    # agreement, then the per-shard layout flags; the irregular shard travels whole, the regular scattered
    assert [r.tag for r in log.records if r.kind == "all_gather"] == ["src_rank.check", "src_rank.layouts"]
    assert log.count("scatter") == 1 and log.count("broadcast") == 1
    # the same layer from a partition function: it gets rank src's module first, its output is kept
    model = nn.Sequential(nn.Linear(4, 7, bias=False), nn.Linear(7, 3)).double()  # drawn anew on every rank
    oracle = copy.deepcopy(model)
    for t in _everything(oracle).values():
        dist.broadcast(t.data, src)
    with tplayers.count_collectives() as log:
        par = tplayers.parallelize_module(
            model, {"0": lambda name, m, mesh: _SwappedRows(m, mesh)}, mesh=mesh, src_rank=src
        )
    assert torch.equal(par[0].weight, par[0].shard_specs()["weight"].take(oracle[0].weight))
    assert torch.equal(par[1].weight, oracle[1].weight)
    assert [r.tag for r in log.records if r.kind == "all_gather"] == ["src_rank.partition", "src_rank.check"]
    # src's module (fp64) and generator state (uint8), one broadcast per dtype; then the rest (fp64)
    assert log.count("scatter") == 0 and log.count("broadcast") == 3
    return True


def test_layout_not_rebuildable_on_some_ranks_is_broadcast_and_sliced_on_every_rank():
    assert all(run_ranks(_irregular, 3, args=(2,), timeout=60))
