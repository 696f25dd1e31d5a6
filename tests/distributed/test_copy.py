"""copy.deepcopy and pickle of parallel modules: the mesh and process groups travel as
references, the copy owns its tensors and computes exactly what the original computes."""

import copy
import pickle

import torch
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers


class Mixed(nn.Module):
    """One of every parallel layer: TP MLP, a domain CNN region (conv, per-pixel linear), NA."""

    def __init__(self, tp_mesh, dom_mesh, dom2d):
        super().__init__()
        self.col = tplayers.ColumnParallelLinear(6, 7, mesh=tp_mesh)
        self.row = tplayers.RowParallelLinear(7, 6, mesh=tp_mesh)
        self.conv = tplayers.DistributedConv2d(2, 3, 3, padding=1, mesh=dom_mesh, shard_dims=(2,))
        self.conv2d = tplayers.DistributedConv2d(
            3, 2, 3, padding=1, padding_mode="circular", mesh=dom2d, shard_dims=(2, 3)
        )
        self.mix = tplayers.DomainReplicated(nn.Linear(2, 2), dom_mesh)
        self.na = tplayers.NeighborhoodAttention(4, 2, 3, mesh=dom_mesh, shard_dims=(1,))

    def forward(self, t, img, seq):
        a = self.row(torch.tanh(self.col(t)))
        h = self.conv2d(torch.tanh(self.conv(img)))
        h = self.mix(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return a, h, self.na(seq)


def _meshes(world):
    tp = DeviceMesh("cpu", torch.arange(world))
    dom2d = (
        DeviceMesh("cpu", torch.arange(world).reshape(world // 2, 2))
        if world % 2 == 0
        else DeviceMesh("cpu", torch.arange(world).reshape(world, 1))
    )
    return tp, tp, dom2d


def _run(model, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(3, 6, dtype=torch.float64, generator=g)
    img = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g)  # local rows: any partition
    seq = torch.randn(1, 5, 6, 4, dtype=torch.float64, generator=g)
    model.zero_grad(set_to_none=True)
    outs = model(t, img, seq)
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()}


def _same(a, b):
    (oa, ga), (ob, gb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(oa, ob))
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga), "gradients differ"


def _copies(rank, world):
    torch.manual_seed(0)
    tp, dom, dom2d = _meshes(world)
    model = Mixed(tp, dom, dom2d).double()
    ref = _run(model, 1)
    twin = copy.deepcopy(model)
    # live connections shared, tensors owned
    assert twin.col.mesh is model.col.mesh and twin.col._group is model.col._group
    assert all(a is b for a, b in zip(twin.conv2d._groups, model.conv2d._groups))
    assert twin.mix._groups[0] is model.mix._groups[0] and twin.na.mesh is model.na.mesh
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p is not q and p.data_ptr() != q.data_ptr() and torch.equal(p, q), n
    # DomainReplicated's wrapped module shares the copy's parameters, not the original's
    assert twin.mix.module.weight is twin.mix.weight
    _same(_run(twin, 1), ref)
    # the copy trains on its own: a step on the copy leaves the original untouched
    before = {n: p.clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    _run(twin, 2)
    opt.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in twin.named_parameters())
    # pickle: groups stored as mesh-dim references and rebound on load
    blob = pickle.dumps(model)
    back = pickle.loads(blob)
    assert back.conv2d._groups[1] is model.conv2d._groups[1] and back.col._group is model.col._group
    _same(_run(back, 1), ref)
    # a whole parallelized model (plan swap) deep-copies too
    torch.manual_seed(1)
    serial = nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 4)).double()
    par = tplayers.parallelize_module(
        copy.deepcopy(serial), {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}, mesh=tp
    )
    par2 = copy.deepcopy(par)
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(par2(x), serial(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pickle.loads(pickle.dumps(par))(x), serial(x), rtol=1e-12, atol=1e-12)
    return True


def test_deepcopy_and_pickle_2_ranks():
    run_ranks(_copies, 2, timeout=60)


def test_deepcopy_and_pickle_4_ranks():
    run_ranks(_copies, 4, timeout=60)


def _twins(rank, world):
    """Every spatial twin kind, swapped by DomainParallel, deep-copies and pickles."""
    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.MaxPool2d(2),
        nn.ConvTranspose2d(4, 3, 2, stride=2),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.AvgPool2d(3, stride=2, padding=1),
        nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"),
        nn.AdaptiveAvgPool2d((3, 2)),
    ).double()
    mesh = tplayers.default_mesh()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    kinds = {type(m).__name__ for m in par.modules()}
    assert {
        "DistributedConv2d",
        "DistributedMaxPool2d",
        "DistributedConvTranspose2d",
        "DistributedUpsample",
        "DistributedAvgPool2d",
        "DistributedAdaptiveAvgPool2d",
    } <= kinds, kinds
    x = torch.randn(2, 2, 8 * world, 6, dtype=torch.float64)
    local = tplayers.shard(x, 2, mesh)
    ref = par(local)  # warm caches: the copies carry (deepcopy) or rebuild (pickle) them
    for twin in (copy.deepcopy(par), pickle.loads(pickle.dumps(par))):
        assert all(p is not q for p, q in zip(par.parameters(), twin.parameters()))
        xa, xb = local.clone().requires_grad_(True), local.clone().requires_grad_(True)
        ya, yb = par(xa), twin(xb)
        assert torch.equal(ya, yb) and torch.equal(ya, ref)
        (ya * ya).sum().backward()
        (yb * yb).sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(par.parameters(), twin.parameters()))
        par.zero_grad(set_to_none=True)
    return True


def test_deepcopy_and_pickle_spatial_twins():
    run_ranks(_twins, 3, timeout=90)
