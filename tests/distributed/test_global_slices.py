"""Sizes and indices read as the serial model reads them inside a DomainParallel region (tplayers.region.lengths,
tplayers.region.rules_slices): global slices and integer picks along sharded dims, assignment into them,
constants and grids of a serial shape, replicated operands of a sharded dim's full length. Whole models as their
authors wrote them: the FNO paper's SpectralConv2d and FNO2d, fp64, 2 ranks (uneven) and 2x2 (uneven), outputs,
input gradient, every parameter gradient, two optimizer steps; and what stays refused, on every rank."""

import copy
import time

import pytest
import torch
from fno_models import FNO2d, SpectralConv2d
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-9, atol=1e-11)


class Slices(nn.Module):
    """Slices, steps, negative bounds, an integer pick, bounds from the lengths read, assignment into a
    constant of the serial shape and a grid of serial coordinates, around two convs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.gain = nn.Parameter(torch.randn(3, 4, 1))  # per serial row of the kept band (4 rows)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        n, c, hh, ww = h.shape
        mid = hh // 2
        band = h[:, :, mid - 2 : mid + 2] * self.gain  # 4 serial rows around the middle (gathered: short)
        out = torch.zeros(n, c, hh, ww, dtype=h.dtype)
        out[:, :, mid - 2 : mid + 2] = band  # written back into the rank(s) holding them
        out[:, :, 0] = 1.0  # the serial first row
        tail = (h[:, :, 1:] ** 2).mean(dim=2, keepdim=True)  # a long slice stays sharded; its mean is global
        out = out + tail
        steps = h[:, :, ::2].mean(dim=2, keepdim=True)  # every other serial row
        first = h[:, :, 0].unsqueeze(2)  # the serial first row, on every rank
        grid = torch.linspace(0, 1, hh, dtype=h.dtype).reshape(1, 1, hh, 1)  # serial coordinates
        return self.b(out + steps + first + grid * h)


class Spectra(nn.Module):
    """Spectra left sharded where the FFT put them meet the grid again: a per-column statistic over the
    whole H (length 1 there: gathered) and an inverse transform's result (moved back), both added to the
    H-sharded data; the inverse of a shifted spectrum with the sizes read."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        spec = torch.fft.fft2(h)  # sharded along W on a 1-D mesh (one all-to-all, not two)
        col = spec.abs().mean(dim=2, keepdim=True)  # (N, C, 1, W): W-sharded, length 1 along H
        shifted = torch.fft.fftshift(torch.fft.rfft2(h, norm="ortho"), dim=2)
        back = torch.fft.irfft2(torch.fft.ifftshift(shifted, dim=2), s=h.shape[-2:], norm="ortho")
        return h * col + back + torch.fft.ifft2(spec).real


def _parity(rank, world, mesh_shape, layouts, make, shape, dims):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    torch.manual_seed(0)
    serial = make().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    for step in range(2):
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        w = torch.randn(ys.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + step))
        loss_p = tplayers.domain_sum(yl * local(w), mesh)
        backward_step_match((ys * w).sum(), loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT)
    return True


CASES = [
    (2, (2,), [[7, 6]], (2, 2, 13, 5), (2,)),
    (4, (2, 2), [[7, 5], [5, 4]], (1, 2, 12, 9), (2, 3)),
]


@pytest.mark.parametrize("world,mesh_shape,layouts,shape,dims", CASES)
def test_slices_picks_assignment_and_grids_are_the_serial_ones(world, mesh_shape, layouts, shape, dims):
    run_ranks(_parity, world, args=(mesh_shape, layouts, Slices, shape, dims), timeout=120)


@pytest.mark.parametrize("world,mesh_shape,layouts,shape,dims", CASES)
def test_spectra_sharded_elsewhere_meet_the_grid_again(world, mesh_shape, layouts, shape, dims):
    run_ranks(_parity, world, args=(mesh_shape, layouts, Spectra, shape, dims), timeout=120)


@pytest.mark.parametrize("world,mesh_shape,layouts,shape,dims", CASES)
def test_the_fno_papers_spectral_conv2d_as_written(world, mesh_shape, layouts, shape, dims):
    shape = (shape[0], 3) + shape[2:]
    run_ranks(_parity, world, args=(mesh_shape, layouts, lambda: SpectralConv2d(3, 4, 3, 2), shape, dims), timeout=120)


@pytest.mark.parametrize(
    "world,mesh_shape,layouts,shape,dims,padding",
    [
        (2, (2,), [[7, 6]], (2, 13, 10, 1), (1,), 3),
        # padded W is unbalanced (6 + 8): irfft2(s=x.size()...) returns it in x's partition, not the balanced one
        (4, (2, 2), [[7, 5], [6, 5]], (1, 12, 11, 1), (1, 2), 3),
    ],
)
def test_the_fno_papers_fno2d_channels_last_with_its_grid_and_padding(world, mesh_shape, layouts, shape, dims, padding):
    make = lambda: FNO2d(3, 3, 5, padding=padding)  # noqa: E731
    run_ranks(_parity, world, args=(mesh_shape, layouts, make, shape, dims), timeout=180)


class NumpyGrid(nn.Module):
    """A grid built in numpy from a local length: its values are local, so it is refused, not followed."""

    def forward(self, x):
        import numpy as np

        g = torch.tensor(np.linspace(0, 1, x.shape[2]), dtype=x.dtype).reshape(1, 1, -1, 1)
        return x + g


class Mixed(nn.Module):
    def forward(self, x):
        n, c, h, w = x.shape
        return x.flatten(2) + torch.zeros(h * w, dtype=x.dtype)  # a size mixing two sharded dims


class Shifted(nn.Module):
    """Two slices of one dim, each sharded with its own rows: pairing them would need the rows realigned."""

    def forward(self, x):
        return x[:, :, 1:] * x[:, :, :-1]


class InPlaceGrid(nn.Module):
    """Sharded values written in place into a whole grid of the serial length: the grid's other references
    would keep the rows the other ranks wrote, so it is refused (not cut to this rank's rows)."""

    def forward(self, x):
        grid = torch.linspace(0, 1, x.shape[2], dtype=x.dtype).reshape(1, 1, -1, 1).repeat(1, 2, 1, x.shape[3])
        alias = grid
        grid += x
        return alias + x


class IndexTensor(nn.Module):
    def forward(self, x):
        return x[:, :, torch.tensor([0, 2])]


def _refused(rank, world, make, mesh_shape, match):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    dims = tuple(range(2, 2 + mesh.ndim))
    model = tplayers.parallelize_module(make(), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh)
    x = tplayers.shard(torch.randn(1, 2, 9, 7, dtype=torch.float64), dims if len(dims) > 1 else dims[0], mesh)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        model(x)
    assert time.monotonic() - start < 5
    return True


@pytest.mark.parametrize(
    "make,world,mesh_shape,match",
    [
        (NumpyGrid, 2, (2,), "replicated operand"),
        (Mixed, 4, (2, 2), "mixes lengths of different sharded dims"),
        (IndexTensor, 2, (2,), "indexing"),
        (InPlaceGrid, 2, (2,), "replicated operand of shape"),
        (Shifted, 2, (2,), "must match"),  # a ValueError on every rank (the rows are not realigned yet)
    ],
)
def test_what_cannot_be_followed_is_refused_on_every_rank(make, world, mesh_shape, match):
    run_ranks(_refused, world, args=(make, mesh_shape, match), timeout=60)
