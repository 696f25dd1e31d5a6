"""Whole models under DomainParallel equal the serial model in fp64: outputs, input gradients, every
parameter gradient, one optimizer step and a second input (the issue's "Must show")."""

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import assert_params_match, edge_convs
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
import tplayers.layers.conv as conv_module

TIGHT = dict(rtol=1e-9, atol=1e-10)


class Conv1dStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv1d(2, 4, 5, padding=2, padding_mode="reflect")
        self.b = nn.Conv1d(4, 4, 3, stride=2, padding=1)
        self.c = nn.Conv1d(4, 4, 3, padding="same", dilation=2, padding_mode="circular")
        self.d = nn.Conv1d(4, 3, 4, padding=1, padding_mode="replicate")

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


class CNN3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(1, 4, 3, padding=1)
        self.down = nn.Conv3d(4, 4, 3, stride=2, padding=1)
        self.pool = nn.MaxPool3d(2, ceil_mode=True)
        self.up = nn.ConvTranspose3d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.head = nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x):
        h = F.gelu(self.stem(x))
        h = F.gelu(self.down(h))
        h = self.pool(h)
        return self.head(F.gelu(self.up(h)))


def _block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.Tanh(), nn.Conv2d(cout, cout, 3, padding=1), nn.Tanh())


class UNet(nn.Module):
    """A 2-D U-Net without norms: MaxPool2d, AvgPool2d, ConvTranspose2d, bilinear Upsample, skips."""

    def __init__(self):
        super().__init__()
        self.enc1, self.pool1 = _block(2, 4), nn.MaxPool2d(2)
        self.enc2, self.pool2 = _block(4, 6), nn.AvgPool2d(2)
        self.mid = _block(6, 6)
        self.up2, self.dec2 = nn.ConvTranspose2d(6, 6, 2, stride=2), _block(12, 6)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.red1, self.dec1 = nn.Conv2d(6, 4, 1), _block(8, 4)
        self.head = nn.Conv2d(4, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)  # (N, 4, H, W)
        e2 = self.enc2(self.pool1(e1))  # (N, 6, H/2, W/2)
        m = self.mid(self.pool2(e2))  # (N, 6, H/4, W/4)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.red1(self.up1(d2)), e1], 1))
        return self.head(d1)


MODELS = {"conv1d": Conv1dStack, "cnn3d": CNN3d, "unet": UNet}


def _model(rank, world, name, shape, mesh_shape, shard_dims, edges=False):
    if edges:  # every slab takes the convolutions' main-plus-strips strategy (tplayers.layers._conv_fn)
        conv_module.EDGE_MIN_ELEMENTS = 0
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    torch.manual_seed(0)
    serial = MODELS[name]().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=shard_dims)}, mesh=mesh
    )
    swapped = [type(m).__name__ for m in parallel.modules() if type(m).__name__.startswith("Distributed")]
    assert len(swapped) == sum(
        isinstance(
            m, (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.Upsample)
        )
        for m in serial.modules()
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        xs = x.clone().requires_grad_(True)
        xp = tplayers.shard(x, shard_dims if len(shard_dims) > 1 else shard_dims[0], mesh).clone().requires_grad_(True)
        ys = serial(xs)
        yp = parallel(xp)
        yg = tplayers.gather(yp, shard_dims, mesh)
        torch.testing.assert_close(yg, ys, **TIGHT, msg=lambda m: f"{name} step {step}: {m}")
        cot = torch.randn(ys.shape, dtype=ys.dtype, generator=gen)
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(xp.grad, shard_dims, mesh), xs.grad, **TIGHT)
        assert_params_match(parallel, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(parallel, serial, grads=False, **TIGHT)
    assert (edge_convs(parallel) > 0) == edges, edge_convs(parallel)
    return True


@pytest.mark.parametrize(
    "name,shape,world,mesh_shape,shard_dims",
    [
        ("conv1d", (2, 2, 37), 3, (3,), (2,)),
        ("conv1d", (2, 2, 20), 2, (2,), (2,)),
        ("cnn3d", (1, 1, 14, 10, 6), 2, (2,), (2,)),  # sharded along D
        ("cnn3d", (1, 1, 6, 13, 8), 2, (2,), (3,)),  # sharded along H
        ("cnn3d", (1, 1, 10, 12, 6), 4, (2, 2), (2, 3)),  # D and H on a 2-D mesh
        ("unet", (1, 2, 32, 8), 2, (2,), (2,)),
        ("unet", (1, 2, 36, 8), 3, (3,), (2,)),
        ("unet", (1, 2, 44, 8), 3, (3,), (2,)),
        ("unet", (1, 2, 44, 8), 2, (2,), (2,)),
        ("unet", (1, 2, 36, 12), 4, (2, 2), (2, 3)),
    ],
)
def test_whole_model_equals_serial(name, shape, world, mesh_shape, shard_dims):
    run_ranks(_model, world, args=(name, shape, mesh_shape, shard_dims), timeout=120)


@pytest.mark.parametrize(
    "name,shape,world,mesh_shape,shard_dims",
    [  # conv1d: none of its convolutions applies
        ("cnn3d", (1, 1, 10, 12, 6), 4, (2, 2), (2, 3)),
        ("unet", (1, 2, 44, 8), 3, (3,), (2,)),
        ("unet", (1, 2, 36, 12), 4, (2, 2), (2, 3)),
    ],
)
def test_whole_model_on_the_edge_path(name, shape, world, mesh_shape, shard_dims):
    """Every convolution slab on the main-plus-strips path (where the plans allow it), still exact."""
    run_ranks(_model, world, args=(name, shape, mesh_shape, shard_dims), kwargs=dict(edges=True), timeout=120)
