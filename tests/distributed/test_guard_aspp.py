"""DeepLabV3 / V3+ under ``{"": DomainParallel(...)}`` (issue 31): the ASPP pooling branch pools the
domain to 1 x 1, runs a 1x1 convolution, BatchNorm and ReLU on the replicated map, and broadcasts it
back with ``F.interpolate(size=x.shape[-2:])`` before a ``cat`` with the sharded branches.

segmentation_models_pytorch needs torchvision, whose wheels in reach here do not load on the CPU
build of torch, so the models are faithful copies of smp 0.6's ``DeepLabV3`` / ``DeepLabV3Plus``
decoders (``ASPP``, ``ASPPConv``, ``ASPPSeparableConv``, ``ASPPPooling``, ``SeparableConv2d``, the
segmentation head's ``UpsamplingBilinear2d``) on a small strided encoder, written here. Compared
with the serial model in fp64 at 2 ranks and on a 2x2 mesh: outputs, the input gradient, every
parameter gradient, BatchNorm running statistics, after an SGD step, train then eval mode.
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


def _cbr(cin, cout, k=3, stride=1, padding=1, dilation=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dilation=dilation, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class SeparableConv2d(nn.Sequential):
    def __init__(self, cin, cout, k, padding=0, dilation=1, bias=True):
        super().__init__(
            nn.Conv2d(cin, cin, k, padding=padding, dilation=dilation, groups=cin, bias=False),
            nn.Conv2d(cin, cout, 1, bias=bias),
        )


class ASPPPooling(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    def forward(self, x):
        size = x.shape[-2:]  # this rank's rows inside a region
        for mod in self:
            x = mod(x)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class ASPP(nn.Module):
    def __init__(self, cin, cout, rates, separable, dropout):
        super().__init__()
        branch = (
            (lambda r: nn.Sequential(SeparableConv2d(cin, cout, 3, r, r, bias=False), nn.BatchNorm2d(cout), nn.ReLU()))
            if separable
            else (lambda r: _cbr(cin, cout, 3, padding=r, dilation=r))
        )
        self.convs = nn.ModuleList([_cbr(cin, cout, 1, padding=0)] + [branch(r) for r in rates])
        self.convs.append(ASPPPooling(cin, cout))
        self.project = nn.Sequential(
            nn.Conv2d(5 * cout, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.Dropout(dropout)
        )

    def forward(self, x):
        return self.project(torch.cat([conv(x) for conv in self.convs], dim=1))


class DeepLab(nn.Module):
    """Encoder at strides 2, 4, 8; ``plus=False``: DeepLabV3 (ASPP, conv, BN, ReLU, head upsampled x8);
    ``plus=True``: DeepLabV3+ (ASPP + separable conv, x2 bilinear up, a 1x1 high-resolution branch from
    stride 4, cat, separable conv, head upsampled x4)."""

    def __init__(self, plus=False, dropout=0.0):
        super().__init__()
        self.stem, self.stage2, self.stage3 = _cbr(2, 8, stride=2), _cbr(8, 12, stride=2), _cbr(12, 16, stride=2)
        self.plus = plus
        if plus:
            self.aspp = nn.Sequential(
                ASPP(16, 8, (1, 2, 3), True, dropout),
                SeparableConv2d(8, 8, 3, padding=1, bias=False),
                nn.BatchNorm2d(8),
                nn.ReLU(),
            )
            self.up = nn.Upsample(mode="bilinear", scale_factor=2, align_corners=True)
            self.block1 = _cbr(12, 6, 1, padding=0)
            self.block2 = nn.Sequential(SeparableConv2d(14, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        else:
            self.aspp = ASPP(16, 8, (1, 2, 3), False, dropout)
            self.decoder = _cbr(8, 8)
        self.head = nn.Conv2d(8, 3, 3, padding=1)
        self.upsampling = nn.UpsamplingBilinear2d(scale_factor=4 if plus else 8)

    def forward(self, x):
        f2 = self.stage2(self.stem(x))
        f3 = self.stage3(f2)
        if self.plus:
            h = torch.cat([self.up(self.aspp(f3)), self.block1(f2)], dim=1)
            h = self.block2(h)
        else:
            h = self.decoder(self.aspp(f3))
        return self.upsampling(self.head(h))


def _parity(rank, world, plus, mesh_shape, layouts, width):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(3)
    # aspp_dropout=0 here (smp's default 0.5, an element-wise nn.Dropout, is exact too: the zoo runs smp's own)
    serial = DeepLab(plus=plus, dropout=0.0).double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for mode in ["train", "train", "eval"]:
        serial.train(mode == "train"), parallel.train(mode == "train")
        shape = [2, 2] + [sum(layouts[i]) if i < len(dims) else width for i in range(2)]
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        target = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
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
    return True


# 40 rows: 20 (10 + 10) at stride 2, 10 (5 + 5) at stride 4, 5 (3 + 2) at stride 8 where ASPP pools:
# the pooled map is interpolated back to 3 rows on one rank and 2 on the other (shares)
@pytest.mark.parametrize("plus", [False, True], ids=["v3", "v3plus"])
def test_deeplab_aspp_pooled_branch_is_exact_at_2_ranks(plus):
    run_ranks(_parity, 2, args=(plus, (2,), [[20, 20]], 16), timeout=180)


@pytest.mark.parametrize("plus", [False, True], ids=["v3", "v3plus"])
def test_deeplab_aspp_pooled_branch_is_exact_on_a_2x2_mesh(plus):
    # W: 24 -> 12 -> 6 -> 3 (2 + 1)
    run_ranks(_parity, 4, args=(plus, (2, 2), [[20, 20], [12, 12]], None), timeout=240)


# ------------------------------------------------------------------ equal shares, refused, left alone
@pytest.mark.parametrize("plus", [False, True], ids=["v3", "v3plus"])
def test_deeplab_with_equal_shares_at_the_pooled_resolution_is_exact(plus):
    # 32 rows: 16 + 16 at stride 2, 8 + 8 at 4, 2 + 2 where ASPP pools: the size is the same on every rank
    # and a local length the code read, so the interpolation alone cannot tell; the cat with the sharded
    # branches decides it is this rank's rows
    run_ranks(_parity, 2, args=(plus, (2,), [[16, 16]], 16), timeout=180)


class Undecided(nn.Module):
    """A pooled map interpolated to x.shape[-2:] (equal shares) and then used on its own (a sum over its
    rows, a window over them): the two readings give different values; refused. (``contiguous`` carries
    both readings along.)"""

    def __init__(self, use):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.use = use

    def forward(self, x):
        h = self.conv(x)
        up = F.interpolate(h.mean((2, 3), keepdim=True), size=h.shape[-2:], mode="bilinear")
        return self.use(h, up)


def _undecided(rank, world, use, what):
    model = tplayers.parallelize_module(Undecided(use).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 2, 8, 6, dtype=torch.float64)  # 4 + 4 rows
    with pytest.raises(ValueError, match="cannot tell") as err:
        model(x)
    assert what in str(err.value), str(err.value)
    return True


@pytest.mark.parametrize(
    "use,what",
    [
        (lambda h, up: h + up.sum(dim=(2, 3), keepdim=True), "(sum)"),
        (lambda h, up: h * F.avg_pool2d(up.contiguous(), 3, 1, 1), "(avg_pool2d)"),  # a window over its rows
    ],
    ids=["sum", "avg_pool"],
)
def test_an_undecided_broadcast_used_otherwise_raises_on_every_rank(use, what):
    run_ranks(_undecided, 2, args=(use, what), timeout=60)


class GlobalSize(nn.Module):
    """A pooled map interpolated to a global size by a module (nn.Upsample(size=)) and functionally
    to a literal size that is not a local length: both replicated (the serial model's maps)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.up = nn.Upsample(size=(5, 3), mode="bilinear")

    def forward(self, x):
        p = self.pool(self.conv(x))
        return self.up(p).sum(dim=(2, 3)) + F.interpolate(p, size=(7, 2), mode="nearest").mean(dim=(2, 3))


def _global(rank, world):
    torch.manual_seed(3)
    serial = GlobalSize().double()
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 2, 10, 6, dtype=torch.float64)
    xs, xl = x.clone().requires_grad_(True), tplayers.shard(x, 2).clone().requires_grad_(True)
    ys, yl = serial(xs), parallel(xl)
    torch.testing.assert_close(yl, ys, **TIGHT)
    ys.sum().backward(), yl.sum().backward()
    torch.testing.assert_close(xl.grad, tplayers.shard(xs.grad, 2), **TIGHT)
    return True


def test_a_pooled_map_interpolated_to_a_global_size_stays_replicated():
    run_ranks(_global, 2, timeout=120)
