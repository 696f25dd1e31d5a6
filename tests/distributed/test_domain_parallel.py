"""parallelize_module with DomainParallel: every .grad equals the serial model's (fp64, uneven partitions)."""

import copy

import torch
from harness import run_ranks
from oracle import assert_params_match
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.sharding import offsets_from_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)


class ChannelNorm(nn.Module):
    """LayerNorm over channels of an NCHW tensor (per pixel, so exact under domain parallelism)."""

    def __init__(self, c):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.gain = nn.Parameter(torch.rand(c, 1, 1) + 0.5)  # a direct parameter next to a child

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) * self.gain


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(2, 6, 3, padding=1, padding_mode="circular")
        self.norm = ChannelNorm(6)
        self.down = nn.Conv2d(6, 6, 4, stride=2, padding=1)
        self.mix = nn.Linear(6, 6)
        self.dec = nn.Conv2d(6, 3, 3, padding="same", dilation=2)

    def forward(self, x):
        h = torch.tanh(self.norm(self.enc(x)))
        h = torch.tanh(self.down(h))
        h = self.mix(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # per-pixel linear
        return self.dec(h)


def _cases(rank, world, mesh_shape, shard_dims, layouts, plan_kind):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    torch.manual_seed(0)
    serial = Net().double()
    style = tplayers.DomainParallel(shard_dims=shard_dims)
    plan = {"": style} if plan_kind == "root" else {nn.Conv2d: style}
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    assert isinstance(parallel.enc, tplayers.DistributedConv2d)
    assert type(parallel.mix) is nn.Linear  # the region guard sums its gradients where it meets the shards
    assert list(parallel.state_dict()) == list(serial.state_dict())
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(2, 2, sum(layouts[0]), sum(layouts[-1]) if len(layouts) > 1 else 12, dtype=torch.float64)
        local = x
        for i, d in enumerate(shard_dims):
            local = local.narrow(d, offsets_from_sizes(layouts[i])[coords[i]], layouts[i][coords[i]])
        xs, xp = x.clone().requires_grad_(True), local.clone().requires_grad_(True)
        ys = serial(xs)
        yg = tplayers.gather(parallel(xp), shard_dims, mesh)
        torch.testing.assert_close(yg, ys, **TIGHT)
        cot = torch.randn_like(ys)
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(xp.grad, shard_dims, mesh), xs.grad, **TIGHT)
        assert_params_match(parallel, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(parallel, serial, grads=False, **TIGHT)
    return True


def test_domain_parallel_plans_match_serial_grads():
    run_ranks(_cases, 2, args=((2,), (2,), [[7, 9]], "root"), timeout=60)
    run_ranks(_cases, 3, args=((3,), (2,), [[6, 4, 8]], "type"), timeout=60)
    run_ranks(_cases, 4, args=((2, 2), (2, 3), [[9, 7], [5, 9]], "root"), timeout=60)


def _replicated_wrapper_edges(rank, world):
    import pytest

    mesh = tplayers.default_mesh()
    # A module whose children own the parameters is refused (they would be left unsummed).
    with pytest.raises(ValueError, match="child '0' \\(Linear\\) has parameters of its own"):
        tplayers.DomainReplicated(nn.Sequential(nn.Linear(3, 3)), mesh)
    # A module without parameters passes through unchanged.
    norm = tplayers.DomainReplicated(nn.BatchNorm1d(3, affine=False), mesh)
    x = torch.randn(4, 3)
    torch.testing.assert_close(norm(x), nn.BatchNorm1d(3, affine=False)(x))
    # A leaf with parameters: its gradient is summed over the domain (here: each rank's own input).
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    wrapped = tplayers.DomainReplicated(copy.deepcopy(lin), mesh)
    xs = torch.randn(world, 4, 3)
    wrapped(xs[rank]).sum().backward()
    lin(xs.reshape(-1, 3)).sum().backward()
    torch.testing.assert_close(wrapped.weight.grad, lin.weight.grad)
    assert list(wrapped.state_dict()) == ["weight", "bias"]


def test_replicated_wrapper_edge_cases():
    run_ranks(_replicated_wrapper_edges, 2, timeout=30)


def _raises_on_spatial_mixers_without_twin(rank, world):
    import pytest

    pools = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1), nn.MaxPool2d(2), nn.Upsample(scale_factor=2), nn.Conv2d(2, 2, 1)
    )
    swapped = tplayers.parallelize_module(copy.deepcopy(pools), {"": tplayers.DomainParallel(shard_dims=(2,))})
    assert [type(m).__name__ for m in swapped] == [
        "DistributedConv2d",
        "DistributedMaxPool2d",
        "DistributedUpsample",
        "DistributedConv2d",
    ]
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1),
        nn.FractionalMaxPool2d(2, output_ratio=0.5),
        nn.Sequential(nn.LPPool2d(2, 2), nn.LocalResponseNorm(2)),
        nn.Conv2d(2, 2, 1),
    )
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"1 \(FractionalMaxPool2d\), 2\.0 \(LPPool2d\), 2\.1 \(LocalResponseNorm\)"):
        tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2,))})
    assert [type(m) for m in model.modules()] == before  # nothing swapped
    return True


def test_domain_plan_raises_on_spatial_mixers_without_twin():
    run_ranks(_raises_on_spatial_mixers_without_twin, 2, timeout=30)
