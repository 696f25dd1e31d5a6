"""Every spatial twin family against its serial nn module (fp64): seeded random arguments, balanced,
uneven and empty-edge partitions, 1-D and 2-D meshes, 2-4 ranks."""

import random
import zlib

import pytest
import torch
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from twin_check import check_twin, partition

import tplayers


def _conv(rng, n):
    k = [rng.randint(1, 4) for _ in range(n)]
    s = [rng.randint(1, 2) for _ in range(n)]
    d = [rng.randint(1, 2) for _ in range(n)]
    g = rng.choice([1, 2])
    pad = "same" if s == [1] * n and rng.random() < 0.3 else [rng.randint(0, 2) for _ in range(n)]
    mode = rng.choice(["zeros", "circular", "reflect", "replicate"])
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[n]
    return cls(g * rng.randint(1, 2), g * rng.randint(1, 2), k, s, pad, d, g, rng.random() < 0.8, mode), getattr(
        tplayers, f"DistributedConv{n}d"
    )


def _convt(rng, n):
    k = [rng.randint(1, 4) for _ in range(n)]
    s = [rng.randint(1, 3) for _ in range(n)]
    d = [rng.randint(1, 2) for _ in range(n)]
    op = [rng.randint(0, max(si, di) - 1) for si, di in zip(s, d)]
    p = [rng.randint(0, (di * (ki - 1)) // 2) for ki, di in zip(k, d)]
    g = rng.choice([1, 2])
    cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[n]
    return cls(g * rng.randint(1, 2), g * rng.randint(1, 2), k, s, p, op, g, rng.random() < 0.8, d), getattr(
        tplayers, f"DistributedConvTranspose{n}d"
    )


def _maxpool(rng, n):
    k = [rng.randint(1, 4) for _ in range(n)]
    d = [rng.randint(1, 2) for _ in range(n)]
    p = [rng.randint(0, ((ki - 1) * di + 1) // 2) for ki, di in zip(k, d)]
    s = [rng.randint(1, 3) for _ in range(n)]
    cls = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}[n]
    return cls(k, s, p, d, ceil_mode=rng.random() < 0.5), getattr(tplayers, f"DistributedMaxPool{n}d")


def _avgpool(rng, n):
    k = [rng.randint(1, 4) for _ in range(n)]
    p = [rng.randint(0, ki // 2) for ki in k]
    s = [rng.randint(1, 3) for _ in range(n)]
    cls = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}[n]
    extra = {} if n == 1 else {"divisor_override": rng.choice([None, None, 3])}
    return cls(k, s, p, rng.random() < 0.5, rng.random() < 0.5, **extra), getattr(tplayers, f"DistributedAvgPool{n}d")


def _upsample(rng, n):
    mode = rng.choice(
        ["nearest", "nearest-exact", {1: "linear", 2: "bilinear", 3: "trilinear"}[n]] + (["bicubic"] if n == 2 else [])
    )
    align = rng.choice([True, False]) if mode not in ("nearest", "nearest-exact") else None
    if rng.random() < 0.5:
        kw = {"scale_factor": rng.choice([2, 1.5, 3, 0.75])}
    else:
        kw = {"size": tuple(rng.randint(3, 20) for _ in range(n))}
    return nn.Upsample(mode=mode, align_corners=align, **kw), tplayers.DistributedUpsample


def _adaptive(rng, n):
    size = tuple(rng.choice([1, 1, 2, 3, 5]) for _ in range(n))
    cls = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}[n]
    return cls(size), getattr(tplayers, f"DistributedAdaptiveAvgPool{n}d")


def _adaptive_max(rng, n):
    size = tuple(rng.choice([1, 1, 2, 3, 5, None]) for _ in range(n))
    cls = {1: nn.AdaptiveMaxPool1d, 2: nn.AdaptiveMaxPool2d, 3: nn.AdaptiveMaxPool3d}[n]
    return cls(size), getattr(tplayers, f"DistributedAdaptiveMaxPool{n}d")


FAMILIES = {
    "conv": _conv,
    "convt": _convt,
    "maxpool": _maxpool,
    "avgpool": _avgpool,
    "upsample": _upsample,
    "adaptive": _adaptive,
    "adaptivemax": _adaptive_max,
}


def _family(rank, world, mesh_shape, shard_dims, family, n, seed, count):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape), mesh_dim_names=("a", "b")[: len(mesh_shape)])
    rng = random.Random(seed)
    done = tries = 0
    while done < count:
        tries += 1
        assert tries < 40 * count, f"only {done} of {count} configurations ran"
        torch.manual_seed(rng.randrange(1 << 30))
        serial, twin_cls = FAMILIES[family](rng, n)
        serial = serial.double()
        chans = getattr(serial, "in_channels", 2)
        lo = 4 if n == 3 else 6
        shape = [rng.randint(1, 2), chans] + [rng.randint(lo, lo + 8) for _ in range(n)]
        x = torch.randn(shape, dtype=torch.float64)
        try:
            ys = serial(x)
        except RuntimeError:
            continue  # the serial module rejects it too
        if 0 in ys.shape:
            continue
        layouts = {d: partition(rng, shape[d], mesh.size(i)) for i, d in enumerate(shard_dims)}
        twin = twin_cls.from_module(serial, mesh=mesh, shard_dims=shard_dims)
        gather_dims = tuple(d for d in shard_dims if not (family.startswith("adaptive") and ys.shape[d] == 1))
        if check_twin(serial, twin, x, layouts, mesh, shard_dims, gather_dims=gather_dims, what=repr(serial)):
            done += 1
    return done


CASES = [
    ("conv", 1, 2, (2,), (2,), 5),
    ("conv", 1, 3, (3,), (2,), 5),
    ("conv", 3, 2, (2,), (2,), 3),
    ("conv", 3, 2, (2,), (3,), 3),
    ("conv", 3, 4, (2, 2), (3, 4), 2),
    ("convt", 1, 3, (3,), (2,), 5),
    ("convt", 2, 2, (2,), (2,), 5),
    ("convt", 2, 4, (2, 2), (2, 3), 3),
    ("convt", 3, 2, (2,), (3,), 3),
    ("maxpool", 1, 3, (3,), (2,), 5),
    ("maxpool", 2, 2, (2,), (3,), 5),
    ("maxpool", 2, 4, (2, 2), (2, 3), 3),
    ("maxpool", 3, 2, (2,), (2,), 3),
    ("avgpool", 1, 2, (2,), (2,), 5),
    ("avgpool", 2, 3, (3,), (2,), 5),
    ("avgpool", 2, 4, (2, 2), (2, 3), 3),
    ("avgpool", 3, 2, (2,), (4,), 3),
    ("upsample", 1, 2, (2,), (2,), 5),
    ("upsample", 2, 3, (3,), (2,), 5),
    ("upsample", 2, 4, (2, 2), (2, 3), 3),
    ("upsample", 3, 2, (2,), (3,), 3),
    ("adaptivemax", 1, 3, (3,), (2,), 4),
    ("adaptivemax", 2, 2, (2,), (3,), 4),
    ("adaptivemax", 3, 2, (2,), (2,), 3),
    ("adaptivemax", 2, 4, (2, 2), (2, 3), 3),
    ("adaptive", 1, 2, (2,), (2,), 3),
    ("adaptive", 2, 3, (3,), (3,), 3),
    ("adaptive", 3, 2, (2,), (2,), 3),
]


@pytest.mark.parametrize(
    "family,n,world,mesh_shape,shard_dims,count", CASES, ids=[f"{c[0]}{c[1]}d-{c[2]}r-{c[4]}" for c in CASES]
)
def test_twin_parity(family, n, world, mesh_shape, shard_dims, count):
    seed = zlib.crc32(repr((family, n, world, shard_dims)).encode())
    run_ranks(_family, world, args=(mesh_shape, shard_dims, family, n, seed, count), timeout=240)


def _conv3d_reordered(rank, world):
    """fp32 on the CPU with a thin sharded D: the convolution runs on reordered spatial dims (oneDNN);
    same values and gradients as the serial layer (fp32 tolerance)."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = nn.Conv3d(16, 8, 3, stride=(1, 2, 1), padding=1)
    conv = tplayers.DistributedConv3d.from_module(serial, mesh=mesh)
    x = torch.randn(1, 16, 12, 40, 36)
    xp = tplayers.shard(x, 2, mesh).clone().requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    yg = tplayers.gather(conv(xp), 2, mesh)
    assert conv._layout(xp)[1].spatial_order == (1, 2, 0)
    torch.testing.assert_close(yg, serial(xs), rtol=1e-4, atol=1e-4)
    yg.square().sum().backward()
    serial(xs).square().sum().backward()
    torch.testing.assert_close(tplayers.gather(xp.grad, 2, mesh), xs.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(conv.weight.grad, serial.weight.grad, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(conv.bias.grad, serial.bias.grad, rtol=1e-4, atol=1e-2)
    return True


def test_conv3d_fp32_reordered_dims():
    run_ranks(_conv3d_reordered, 2, timeout=60)
