"""One meaning for a size (issue 33): inside a ``DomainParallel`` region ``F.interpolate(size=)``,
``nn.Upsample(size=)`` and adaptive pools' ``output_size`` (module and functional forms) read a
constant as the serial model's global size, read sizes derived from a sharded tensor's local shape
(``size=skip.shape[2:]``) as the ranks' shares, and refuse, on every rank and within seconds, a
size that could be either. Every exact case is checked in fp64 against the serial model (output,
input gradient, every parameter gradient) on every rank, on uneven partitions.
"""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import assert_params_match
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
import tplayers.functional as TF

TIGHT = dict(rtol=1e-9, atol=1e-11)


class Resize(nn.Module):
    """conv -> a resize to ``size`` written as ``form`` -> conv. ``reads``: the forward reads the local
    shape first (``n, c, hh, ww = h.shape`` for a view), as most real forwards do."""

    def __init__(self, size, form, reads=False):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.size, self.form, self.reads = size, form, reads
        self.mesh = self.dims = None
        self.up = nn.Upsample(size=size, mode="bilinear") if form == "module" else None
        self.pool = nn.AdaptiveAvgPool2d(size) if form == "pool_module" else None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.reads:
            n, c, hh, ww = h.shape
            h = h.view(n, c, hh * ww).view(n, c, hh, ww)
        if self.form == "module":
            h = self.up(h)
        elif self.form == "functional":
            h = F.interpolate(h, size=self.size, mode="bilinear")
        elif self.form == "inline":  # an nn.Upsample built in forward: not swapped, its F.interpolate is routed
            h = nn.Upsample(size=self.size, mode="bilinear")(h)
        elif self.form == "tf":  # tplayers.functional's form where a mesh is set (the parallel copy): global size
            if self.mesh is None:
                h = F.interpolate(h, size=self.size, mode="bilinear")
            else:
                h = TF.interpolate(h, size=self.size, mode="bilinear", mesh=self.mesh, shard_dims=self.dims)
        elif self.form == "pool_module":
            h = self.pool(h)
        elif self.form == "pool_functional":
            h = F.adaptive_avg_pool2d(h, self.size)
        elif self.form == "max_functional":
            h = F.adaptive_max_pool2d(h, self.size)
        elif self.form == "squared":  # neither a global size nor the ranks' shares
            h = F.interpolate(h, size=(h.shape[2] ** 2, h.shape[3]))
        return self.b(h)


class Skip(nn.Module):
    """A U-Net level: the decoder resizes to the (sharded) skip's shape, or pools the skip to the
    coarse level's shape (``how``)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.enc, self.mid = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.dec = nn.Conv2d(6, 2, 3, padding=1)

    def forward(self, x):
        skip = torch.tanh(self.enc(x))
        h = torch.tanh(self.mid(self.pool(skip)))
        if self.how == "size":
            h = F.interpolate(h, size=skip.shape[2:], mode="bilinear", align_corners=False)
        elif self.how == "nearest":
            h = F.interpolate(h, size=tuple(skip.shape[2:]))
        elif self.how == "scale":
            h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        elif self.how == "pool":  # the skip pooled to the coarse level's (local) shape, then both upsampled
            low = F.adaptive_avg_pool2d(skip, h.shape[2:])
            return self.dec(F.interpolate(torch.cat([h, low], 1), size=skip.shape[2:], mode="nearest"))
        return self.dec(torch.cat([h, skip], 1))


def _make(kind, arg, form, reads=False):
    return Resize(arg, form, reads) if kind == "resize" else Skip(form)


def _setup(world, mesh_shape, kind, arg, form, reads, shape):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(0)
    serial = _make(kind, arg, form, reads).double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    if form == "tf":
        parallel.mesh, parallel.dims = mesh, dims
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xp = tplayers.shard(x, dims if len(dims) > 1 else dims[0], mesh).clone().requires_grad_(True)
    return mesh, dims, serial, parallel, x, xp


def _exact(rank, world, mesh_shape, kind, arg, forms, reads, shape):
    """Every form of the model equals the serial one (and so each other), values and gradients."""
    outs = {}
    for form in forms:
        mesh, dims, serial, parallel, x, xp = _setup(world, mesh_shape, kind, arg, form, reads, shape)
        xs = x.clone().requires_grad_(True)
        ys, yp = serial(xs), parallel(xp)
        replicated = ys.shape[2] == 1  # an adaptive pool to size 1 along the sharded dim: a global mean
        yg = yp if replicated else tplayers.gather(yp, dims, mesh)
        assert yg.shape == ys.shape, (form, tuple(yg.shape), tuple(ys.shape))
        torch.testing.assert_close(yg, ys, **TIGHT, msg=lambda m: f"{form}: {m}")
        cot = torch.randn(ys.shape, dtype=ys.dtype, generator=torch.Generator().manual_seed(2))
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(xp.grad, dims, mesh), xs.grad, **TIGHT)
        assert_params_match(parallel, serial, grads=True, **TIGHT)
        outs[form] = yg.detach()
    first = next(iter(outs.values()))
    for form, y in outs.items():  # the module and the functional forms: one meaning, one result
        torch.testing.assert_close(y, first, rtol=0, atol=1e-13, msg=lambda m: f"{form} vs {forms[0]}: {m}")
    return True


def _refused(rank, world, mesh_shape, kind, arg, form, reads, shape, match):
    mesh, dims, serial, parallel, x, xp = _setup(world, mesh_shape, kind, arg, form, reads, shape)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match) as err:
        parallel(xp)
    took = time.monotonic() - start
    assert took < 5.0, took
    return str(err.value)


FORMS = ("functional", "module", "inline", "tf")


@pytest.mark.parametrize(
    "world,mesh_shape,shape,size",
    [
        (2, (2,), (2, 2, 11, 5), (17, 5)),  # H 6 + 5, resized to 17 rows
        (3, (3,), (1, 2, 11, 5), (17, 4)),  # H 4 + 4 + 3; W (unsharded) resized too
        (2, (2,), (2, 2, 11, 5), (7, 5)),  # downsampling
        (4, (2, 2), (1, 2, 11, 9), (17, 13)),  # H and W both sharded
    ],
)
@pytest.mark.parametrize("reads", [False, True])
def test_a_constant_size_is_the_global_size_in_every_form(world, mesh_shape, shape, size, reads):
    """F.interpolate(size=C) gives the serial model's C rows (it used to give ranks x C), as
    nn.Upsample(size=C) and an nn.Upsample built in forward do, whatever shapes the forward read."""
    run_ranks(_exact, world, args=(mesh_shape, "resize", size, FORMS, reads, shape), timeout=120)


@pytest.mark.parametrize(
    "world,shape,size",
    [
        (2, (2, 2, 11, 5), (6, 5)),  # 6 is rank 0's local length (6 + 5), not rank 1's
        (3, (1, 2, 11, 5), (4, 5)),  # 4 is ranks 0 and 1's (4 + 4 + 3), not rank 2's
    ],
)
def test_a_constant_equal_to_the_local_length_on_some_ranks_only_is_global(world, shape, size):
    """The forward read the local shapes, and the constant equals one on some ranks: every rank still
    reads it as global (the ranks decide together from the same table)."""
    run_ranks(_exact, world, args=((world,), "resize", size, FORMS, True, shape), timeout=120)


@pytest.mark.parametrize("world,shape", [(2, (2, 2, 12, 5)), (3, (1, 2, 12, 5))])
def test_a_constant_equal_to_every_local_length_is_global_when_no_shape_was_read(world, shape):
    size = (12 // world, 5)
    run_ranks(_exact, world, args=((world,), "resize", size, FORMS, False, shape), timeout=120)


@pytest.mark.parametrize(
    "world,mesh_shape,shape",
    [
        (2, (2,), (2, 2, 13, 6)),  # skip rows 7 + 6, coarse rows 4 + 3
        (3, (3,), (1, 2, 13, 6)),  # skip rows 5 + 4 + 4, coarse rows 3 + 2 + 2
        (4, (2, 2), (1, 2, 13, 13)),  # skip 7 + 6 rows and columns; coarse 4 + 3 rows and columns
    ],
)
@pytest.mark.parametrize("how", ["size", "nearest", "pool"])
def test_sizes_derived_from_a_sharded_skip_are_local_shares(world, mesh_shape, shape, how):
    run_ranks(_exact, world, args=(mesh_shape, "skip", None, (how,), False, shape), timeout=120)


@pytest.mark.parametrize(
    "world,mesh_shape,shape,size",
    [
        (2, (2,), (2, 2, 11, 5), (4, 5)),
        (3, (3,), (1, 2, 11, 5), (5, 3)),
        (2, (2,), (2, 2, 11, 5), (1, 5)),  # size 1 along the sharded dim: a global mean, replicated
        (4, (2, 2), (1, 2, 11, 9), (4, 3)),
    ],
)
@pytest.mark.parametrize("reads", [False, True])
def test_adaptive_pools_read_output_size_as_global_in_both_forms(world, mesh_shape, shape, size, reads):
    run_ranks(
        _exact, world, args=(mesh_shape, "resize", size, ("pool_functional", "pool_module"), reads, shape), timeout=120
    )


def test_adaptive_max_pool_functional_form():
    run_ranks(_exact, 3, args=((3,), "resize", (4, 3), ("max_functional",), True, (1, 2, 11, 5)), timeout=120)


AMBIGUOUS = "cannot be told apart"


@pytest.mark.parametrize("world,shape", [(2, (2, 2, 12, 5)), (3, (1, 2, 12, 5))])
@pytest.mark.parametrize("form", ["functional", "inline", "pool_functional"])
def test_a_constant_equal_to_every_read_local_length_is_refused_on_every_rank(world, shape, form):
    size = (12 // world, 5)
    msgs = run_ranks(_refused, world, args=((world,), "resize", size, form, True, shape, AMBIGUOUS), timeout=60)
    op = "F.interpolate" if form != "pool_functional" else "F.adaptive_avg_pool2d"
    for m in msgs:
        assert op in m and f"is {12 // world} along sharded dim 2" in m and f"{12} rows in all" in m, m
        assert "nn.Upsample(size=...)" in m and "scale_factor=" in m, m
    fixes = ("module", "tf") if form != "pool_functional" else ("pool_module",)  # the fixes it names: exact
    run_ranks(_exact, world, args=((world,), "resize", size, fixes, True, shape), timeout=120)


@pytest.mark.parametrize("world,shape", [(2, (2, 2, 12, 6)), (4, (1, 2, 16, 6))])
def test_a_skip_size_on_an_even_partition_is_exact(world, shape):
    """size=skip.shape[2:] with the same share on every rank: the lengths read carry their serial value
    (tplayers.region.lengths), so it is the skip's serial size, as scale_factor=2 is (it used to be refused
    as ambiguous)."""
    for how in ("size", "nearest", "scale"):  # different models: each against its serial one
        run_ranks(_exact, world, args=((world,), "skip", None, (how,), False, shape), timeout=120)


def test_sizes_that_are_neither_global_nor_shares_are_refused_on_every_rank():
    msgs = run_ranks(
        _refused, 2, args=((2,), "resize", None, "squared", False, (1, 2, 11, 5), "neither a global size"), timeout=60
    )
    assert all("[36, 25]" in m for m in msgs), msgs
