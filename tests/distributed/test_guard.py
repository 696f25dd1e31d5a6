"""The region guard (issue 23): custom forwards on domain-sharded data are exact or a clear error.

Every model here runs under ``{"": DomainParallel(shard_dims=...)}`` and is compared with the serial
model in fp64: outputs, the input gradient, every parameter gradient, buffers, after an optimizer
step, then a second input (eval mode where the model has running statistics).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-9, atol=1e-11)


_local = local_slice


class Functional(nn.Module):
    """Interpolations, functional pools and pads, spatial statistics and a head, all in a custom forward."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.conv1(x))
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        h = h - h.mean(dim=(2, 3), keepdim=True)  # spatial mean
        h = h / (h.var(dim=(2, 3), keepdim=True) + 1.0).sqrt()  # spatial variance
        h = F.max_pool2d(h, 2)
        h = F.pad(h, (1, 0, 2, 1), value=0.25)  # constant pad along H and W
        h = self.conv2(h) * self.scale[:, None, None]
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = F.avg_pool2d(h, 2)
        peak = h.amax(dim=(2, 3))  # spatial max
        pooled = F.adaptive_avg_pool2d(h, 1).flatten(1)  # global pool, then the head
        return self.head(torch.cat([pooled, peak], dim=1))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            None
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity  # in place, on a twin's output
        return self.relu(out)


class MyGroupNorm(nn.GroupNorm):
    """A subclass (as timm's): never matched as the nn type, its F.group_norm is routed."""


class MyBatchNorm(nn.BatchNorm2d):
    def forward(self, x):
        return torch.relu(super().forward(x))


class ResNetish(nn.Module):
    """ResNet-18-style: stem, max pool, basic blocks (one strided), norm subclasses, global pool, head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(2, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
        self.layer1 = BasicBlock(4, 4, 1)
        self.layer2 = BasicBlock(4, 6, 2)
        self.gn, self.bn = MyGroupNorm(2, 6), MyBatchNorm(6)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = self.bn(self.gn(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(torch.flatten(self.pool(h), 1))


def _parity(rank, world, kind, mesh_shape, layouts, other):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(3)
    serial = {"functional": Functional, "resnet": ResNetish}[kind]().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    assert list(parallel.state_dict()) == list(serial.state_dict())
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    for mode in ["train", "train", "eval"]:
        serial.train(mode == "train"), parallel.train(mode == "train")
        shape = [3, 2] + [sum(layouts[i]) if i < len(dims) else other for i in range(2)]
        x = torch.randn(shape, dtype=torch.float64)
        xs = x.clone().requires_grad_(True)
        xl = _local(x, dims, layouts, coords).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, ys, **TIGHT)  # replicated output
        labels = torch.randint(0, 3, (3,))
        backward_step_match(
            F.cross_entropy(ys, labels),
            F.cross_entropy(yl, labels),
            xs,
            xl,
            lambda t: _local(t, dims, layouts, coords),
            serial,
            parallel,
            opt_s,
            opt_p,
            **TIGHT,
        )
    return True


def test_functional_ops_in_a_custom_forward_are_routed_exactly():
    run_ranks(_parity, 2, args=("functional", (2,), [[5, 4]], 6), timeout=120)
    run_ranks(_parity, 4, args=("functional", (2, 2), [[5, 4], [4, 3]], None), timeout=120)


def test_resnet_with_inplace_relu_residual_add_and_norm_subclasses():
    run_ranks(_parity, 2, args=("resnet", (2,), [[8, 6]], 9), timeout=120)
    run_ranks(_parity, 4, args=("resnet", (2, 2), [[6, 6], [5, 6]], None), timeout=120)


# ------------------------------------------------------------------ refused ops
class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.conv(x))


REFUSED = {
    "fft_hfft": lambda h: torch.fft.hfft(h, dim=2),  # the other torch.fft calls are routed (test_fft_region)
    "roll": lambda h: torch.roll(h, 5, dims=2),  # more rows than rank 1 holds (a smaller roll is routed)
    r"indexing \(a slice, step": lambda h: h[:, :, torch.tensor([0, 2])],  # slices, integers: test_global_slices
    "unfold": lambda h: F.unfold(h, 3),
    "cumsum": lambda h: torch.cumsum(h, 2),
}


def _refused(rank, world):
    import time

    for what, fn in REFUSED.items():
        model = tplayers.parallelize_module(Op(fn).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
        x = tplayers.shard(torch.randn(2, 2, 9, 5, dtype=torch.float64), 2)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=what) as err:
            model(x)
        assert time.monotonic() - t0 < 5
        assert "domain region guard" in str(err.value) and "in module '<root>'" in str(err.value)
    return True


def test_ops_that_cannot_be_exact_raise_on_every_rank():
    run_ranks(_refused, 2, timeout=60)


def _partition_change(rank, world):
    torch.manual_seed(0)
    serial = Functional().double()
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    for h in (9, 10, 9):  # 5+4 -> 5+5 -> 5+4: rank 0 keeps 5 rows, rank 1 changes
        x = torch.randn(2, 2, h, 6, dtype=torch.float64)
        torch.testing.assert_close(parallel(tplayers.shard(x, 2)), serial(x), **TIGHT)
    return True


def test_partition_change_on_one_rank_is_replanned_on_every_rank():
    run_ranks(_partition_change, 2, timeout=60)


def _no_extra_collectives(rank, world):
    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Conv2d(4, 2, 3, padding=1),
    ).double()
    guarded = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    bare = copy.deepcopy(guarded)
    for m in bare.modules():  # the same twins without the region's hooks
        m.__dict__.pop("_tp_region_entry", None)  # nor the entry a twin opens its region by
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            hooks.clear()
    x = tplayers.shard(torch.randn(2, 2, 10, 6, dtype=torch.float64), 2)
    logs = []
    for model in (guarded, bare, guarded, bare):
        with tplayers.count_collectives() as log:
            model(x).square().sum().backward()
        logs.append(log)
    grads = ("region.param_grads", "conv.param_grads")
    # bare twins (no region) agree on their partition every call, one small all-gather each (the
    # convolutions, the pool, the upsample; GroupNorm exchanges its statistics anyway): the region's one
    # entry agreement stands for all of them
    assert [r.tag for r in logs[3].records].count("domain.layout") == 4, logs[3].summary()
    assert [r.tag for r in logs[2].records].count("domain.layout") == 0, logs[2].summary()
    guarded_rest = [r for r in logs[2].records if r.tag not in grads]
    bare_rest = [r for r in logs[3].records if r.tag not in grads + ("domain.layout",)]
    extra = [r for r in guarded_rest if r not in bare_rest]
    assert [r.tag for r in extra] == ["domain.region"], extra  # the entry agreement only
    assert len(guarded_rest) == len(bare_rest) + 1
    # the two convolutions' parameter-gradient sums: one per layer bare, one bucket in the region
    assert [r.tag for r in logs[3].records if r.tag in grads] == ["conv.param_grads"] * 2
    assert [r.tag for r in logs[2].records if r.tag in grads] == ["region.param_grads"]
    return True


def test_guard_adds_only_the_entry_agreement_and_buckets_the_parameter_grads():
    run_ranks(_no_extra_collectives, 2, timeout=60)


class CheckpointInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _checkpoint_inside(rank, world):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inside = CheckpointInside().double()
    model = tplayers.parallelize_module(copy.deepcopy(inside), {"": tplayers.DomainParallel(shard_dims=(2,))})
    xs = torch.randn(2, 2, 9, 5, dtype=torch.float64, requires_grad=True)
    x = tplayers.shard(xs.detach(), 2).requires_grad_(True)
    # a block checkpointed inside the region: its recomputation re-enters the guard (tplayers.region.recompute)
    tplayers.domain_sum(model(x).square()).backward()
    inside(xs).square().sum().backward()
    torch.testing.assert_close(x.grad, tplayers.shard(xs.grad, 2), **TIGHT)
    for p, q in zip(model.parameters(), inside.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TIGHT)
    # checkpointing the region's root re-enters the guard: exact
    serial = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 2, 1)).double()
    whole = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    xs = torch.randn(2, 2, 9, 5, dtype=torch.float64, requires_grad=True)
    xl = tplayers.shard(xs.detach(), 2).requires_grad_(True)
    checkpoint(whole, xl, use_reentrant=False).square().sum().backward()
    serial(xs).square().sum().backward()
    torch.testing.assert_close(xl.grad, tplayers.shard(xs.grad, 2), **TIGHT)
    return True


def test_activation_checkpoint_inside_a_region_and_of_the_region_is_exact():
    run_ranks(_checkpoint_inside, 2, timeout=60)


# ------------------------------------------------------------------ size-1 dims through views
class TokenResidual(nn.Module):
    """diffusers' attention processor without diffusers: (N, C, H, W) -> (N, H*W, C) -> per-token Linear
    -> heads view and back -> (N, C, H, W), added to the residual."""

    def __init__(self, c):
        super().__init__()
        self.inp, self.out = nn.Conv2d(2, c, 3, padding=1), nn.Conv2d(c, 2, 1)
        self.lin = nn.Linear(c, c)
        self.heads = 2 if c % 2 == 0 else 1

    def forward(self, x):
        h = self.inp(x)
        n, c, hh, ww = h.shape
        t = self.lin(h.view(n, c, hh * ww).transpose(1, 2))  # (N, H*W, C)
        t = t.view(n, -1, self.heads, c // self.heads).transpose(1, 2)  # (N, heads, H*W, C/heads)
        t = t.transpose(1, 2).reshape(n, -1, c)
        return self.out(h + t.transpose(-1, -2).reshape(n, c, hh, ww))


def _size_one_views(rank, world, batch, channels):
    torch.manual_seed(4)
    mesh = tplayers.default_mesh()
    serial = TokenResidual(channels).double()
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: _local(t, (2,), [[5, 3]], [rank])  # noqa: E731
    for _ in range(2):
        x = torch.randn(batch, 2, 8, 4, dtype=torch.float64)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        target = torch.randn_like(ys)
        backward_step_match(
            F.mse_loss(ys, target),
            tplayers.domain_mean(F.mse_loss(yl, local(target), reduction="none"), mesh),
            xs,
            xl,
            local,
            serial,
            parallel,
            opt_s,
            opt_p,
            **TIGHT,
        )
    # one row per rank: view(n, c, h * w) and view(n, c * h, w) make the same local call, so the guard
    # cannot tell which dim of the serial result is sharded: a clear error on every rank, not a guess
    with pytest.raises(ValueError, match="ambiguous: this rank holds a single row"):
        parallel(tplayers.shard(torch.randn(batch, 2, 2, 4, dtype=torch.float64), 2))
    return True


@pytest.mark.parametrize("batch,channels", [(1, 4), (1, 1), (2, 1)])
def test_views_with_size_one_batch_or_channels_are_exact(batch, channels):
    run_ranks(_size_one_views, 2, args=(batch, channels), timeout=60)
