"""torch.fft inside a DomainParallel region: routed to tplayers.functional.fft, exact against the serial model
in fp64 (outputs, input gradient, every parameter gradient including a complex one, after an optimizer step);
signal sizes global or recognised as shares; what cannot be told apart is refused on every rank."""

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


class SpectralFilter(nn.Module):
    """A conv, a per-channel complex gain on the rfft2 spectrum (a complex parameter), irfft2 back,
    an N-D transform over channels and the sharded dims, and a skip."""

    def __init__(self, c, size=None, local_size=False):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.gain = nn.Parameter(torch.randn(c, 1, 1, dtype=torch.complex128))
        self.size, self.local_size = size, local_size

    def forward(self, x):
        h = self.conv(x)
        spec = torch.fft.rfft2(h, norm="ortho") * self.gain  # (N, C, H, W // 2 + 1)
        s = tuple(x.shape[-2:]) if self.local_size else self.size
        z = torch.fft.irfft2(spec, s=s, norm="ortho")
        mix = torch.fft.ifftn(torch.fft.fftn(z, dim=(1, 2, 3)) * self.gain.conj(), dim=(1, 2, 3)).real
        centred = torch.fft.fftshift(torch.fft.fft2(z), dim=(2, 3)).abs()  # shifted along the sharded dims
        z = z + torch.fft.ifftshift(centred, dim=2) * 1e-2
        w = torch.fft.rfft(z, dim=2).abs().mean(dim=2, keepdim=True)  # the H // 2 + 1 modes, sharded
        return F.gelu(mix) + x + w.sum(1, keepdim=True)


def _parity(rank, world, mesh_shape, layouts, other, local_size):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    shape = [2, 3] + [sum(layouts[i]) if i < len(dims) else other for i in range(2)]
    torch.manual_seed(3)
    serial = SpectralFilter(3, tuple(shape[2:]), local_size).double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    for _ in range(2):
        x = torch.randn(shape, dtype=torch.float64)
        xs = x.clone().requires_grad_(True)
        xl = local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        w = torch.randn(ys.shape, dtype=torch.float64)
        loss_p = tplayers.domain_sum(yl * local(w), mesh)
        backward_step_match((ys * w).sum(), loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT)
    return True


def test_spectral_filter_exact_at_2_ranks():
    run_ranks(_parity, 2, args=((2,), [[5, 4]], 6, False), timeout=120)
    run_ranks(_parity, 2, args=((2,), [[5, 4]], 7, True), timeout=120)  # s=x.shape[-2:]: uneven shares


def test_spectral_filter_exact_at_3_ranks():
    run_ranks(_parity, 3, args=((3,), [[4, 3, 3]], 5, False), timeout=120)


def test_spectral_filter_exact_on_a_2x2_mesh():
    run_ranks(_parity, 4, args=((2, 2), [[5, 4], [4, 3]], None, False), timeout=120)


def _refused(rank, world):
    out = []
    for fn in (
        lambda h: torch.fft.hfft(h, dim=2),
        # even shares read through int(), which drops the serial value (s=h.shape[-2:] is exact: test_global_slices)
        lambda h: torch.fft.irfft2(torch.fft.rfft2(h), s=[int(v) for v in h.shape[-2:]]),
    ):

        class Op(nn.Module):
            def forward(self, x):
                return fn(x * 2)

        model = tplayers.parallelize_module(Op(), {"": tplayers.DomainParallel(shard_dims=(2,))})
        with pytest.raises(ValueError) as err:
            model(tplayers.shard(torch.randn(2, 2, 8, 6, dtype=torch.float64), 2))
        out.append(str(err.value))
    return out


def test_unroutable_fft_calls_raise_on_every_rank():
    for out in run_ranks(_refused, 2, timeout=60):
        assert "fft_hfft" in out[0] and "domain region guard" in out[0]
        assert "cannot be told apart" in out[1] and "irfft2" in out[1]


class PartialMean(nn.Module):
    def forward(self, x):
        return x * x.abs().mean(dim=2, keepdim=True)  # replicated over mesh dim 0, sharded over mesh dim 1


def _partial(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    coords = [mesh.get_local_rank(i) for i in range(2)]
    layouts = [[5, 4], [4, 3]]
    local = lambda t: local_slice(t, (2, 3), layouts, coords)  # noqa: E731
    model = tplayers.parallelize_module(PartialMean(), {"": tplayers.DomainParallel(shard_dims=(2, 3))}, mesh=mesh)
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64)
    xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
    w = torch.randn(x.shape, dtype=torch.float64)
    (PartialMean()(xs) * w).sum().backward()
    tplayers.domain_sum(model(xl) * local(w), mesh).backward()
    torch.testing.assert_close(xl.grad, local(xs.grad), **TIGHT)
    return True


def test_a_reduction_over_one_mesh_dim_meets_the_shards_with_its_gradient_summed():
    """A result sharded over mesh dim 1 only (a mean over H on a 2x2 mesh) used with data sharded over both:
    its gradient is summed over mesh dim 0 (it was each rank's partial before)."""
    run_ranks(_partial, 4, timeout=60)


class Transposed(nn.Module):
    """Work along H with W sharded, then back: tplayers.repartition in a model's forward."""

    def __init__(self, parallel):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.parallel = parallel

    def forward(self, x):
        h = self.conv(x)
        w = tplayers.repartition(h, None, 2, 3) if self.parallel else h  # now sharded along W
        t = torch.fft.fft(w, dim=2).abs() + torch.cumsum(w, 2)  # along the whole H
        back = tplayers.repartition(t, None, 3, 2) if self.parallel else t
        return back * x.mean(dim=3, keepdim=True)


def _transposed(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(world))
    torch.manual_seed(2)
    serial = Transposed(False).double()
    par = copy.deepcopy(serial)
    par.parallel = True
    par = tplayers.parallelize_module(par, {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    x = torch.randn(2, 2, 10, 7, dtype=torch.float64)
    xs, xl = x.clone().requires_grad_(True), tplayers.shard(x, 2, mesh).detach().requires_grad_(True)
    ys, yl = serial(xs), par(xl)
    torch.testing.assert_close(yl, tplayers.shard(ys, 2, mesh), **TIGHT)
    w = torch.randn(ys.shape, dtype=torch.float64)
    (ys * w).sum().backward()
    tplayers.domain_sum(yl * tplayers.shard(w, 2, mesh), mesh).backward()
    torch.testing.assert_close(xl.grad, tplayers.shard(xs.grad, 2, mesh), **TIGHT)
    for (n, p), q in zip(par.named_parameters(), serial.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"{n}: {m}", **TIGHT)
    return True


def test_repartition_inside_a_region_is_followed_by_the_guard():
    """cumsum along H is refused on H-sharded data; after tplayers.repartition to W it runs locally, exact."""
    run_ranks(_transposed, 2, timeout=60)
