"""tplayers.functional.spectral_conv2d against the FNO paper's SpectralConv2d in fp64: outputs, input and weight
gradients, an optimizer step, a second input; H- and W-sharded, uneven partitions, overlapping mode blocks;
only the kept modes travel; inside a DomainParallel region (an FNO block with 1x1 convs and a skip); errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import raised, run_ranks
from oracle import local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
import tplayers.functional as TF
from tplayers.sharding import shard_sizes

TIGHT = dict(rtol=1e-9, atol=1e-11)


class SpectralConv2d(nn.Module):
    """The FNO paper's layer (Li et al., fourier_2d.py), in the weights' dtype."""

    def __init__(self, cin, cout, modes1, modes2, dtype=torch.complex128):
        super().__init__()
        self.modes1, self.modes2, self.cout = modes1, modes2, cout
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, dtype=dtype))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, dtype=dtype))

    def forward(self, x):
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(x.size(0), self.cout, x.size(-2), x.size(-1) // 2 + 1, dtype=x_ft.dtype)
        m1, m2 = self.modes1, self.modes2
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self.weights1)
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class Sharded(SpectralConv2d):
    """The same layer written for an H- or W-sharded input with tplayers.functional."""

    shard_dim = 2

    def forward(self, x):
        return TF.spectral_conv2d(x, self.weights1, self.weights2, self.modes1, self.modes2, shard_dims=self.shard_dim)


def _match(rank, world, shape, modes, sizes, dim):
    torch.manual_seed(0)
    serial = SpectralConv2d(shape[1], 4, *modes).double()
    par = Sharded(shape[1], 4, *modes)
    par.load_state_dict(serial.state_dict())
    par.shard_dim = dim
    local = lambda t: local_slice(t, (dim,), [sizes], [rank])  # noqa: E731
    opt_s, opt_p = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (serial, par))
    for step in range(2):
        x = torch.randn(shape, dtype=torch.float64)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys = serial(xs)
        with tplayers.count_collectives() as log:
            yl = par(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        if dim == 2 and world > 1:  # only the modes2 kept columns travel, once each way
            cols = shard_sizes(modes[1], world)
            out_bytes = shape[0] * shape[1] * sizes[rank] * (modes[1] - cols[rank]) * 16
            back = shape[0] * 4 * cols[rank] * (shape[2] - sizes[rank]) * 16
            assert [r.nbytes for r in log.records if r.kind == "all_to_all"] == [out_bytes, back]
        w = torch.randn(ys.shape, dtype=torch.float64)
        (ys * w).sum().backward()
        (yl * local(w)).sum().backward()
        torch.testing.assert_close(xl.grad, local(xs.grad), **TIGHT)
        for name in ("weights1", "weights2"):
            torch.testing.assert_close(getattr(par, name).grad, getattr(serial, name).grad, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        for name in ("weights1", "weights2"):
            torch.testing.assert_close(getattr(par, name), getattr(serial, name), **TIGHT)
    return True


@pytest.mark.parametrize(
    "world, shape, modes, sizes, dim",
    [
        (2, (2, 3, 12, 10), (4, 3), [7, 5], 2),
        (2, (2, 3, 9, 7), (5, 4), [4, 5], 2),  # 2 * modes1 > H: the second block overwrites, as serially
        (3, (1, 2, 10, 9), (3, 2), [5, 0, 5], 2),  # an empty shard; fewer columns than ranks
        (2, (2, 3, 8, 10), (3, 4), [6, 4], 3),  # W-sharded
        (3, (2, 2, 8, 11), (2, 5), [4, 4, 3], 3),
    ],
)
def test_spectral_conv2d_matches_the_fno_layer(world, shape, modes, sizes, dim):
    assert sum(sizes) == shape[dim]
    run_ranks(_match, world, args=(shape, modes, sizes, dim), timeout=120)


class FNOBlock(nn.Module):
    """Lifting 1x1 conv, a spectral convolution plus a 1x1 skip, GELU, projection: one FNO layer."""

    def __init__(self, spectral):
        super().__init__()
        self.lift = nn.Conv2d(3, 4, 1)
        self.spectral = spectral
        self.skip = nn.Conv2d(4, 4, 1)
        self.proj = nn.Conv2d(4, 1, 1)

    def forward(self, x):
        h = self.lift(x)
        return self.proj(F.gelu(self.spectral(h) + self.skip(h)))


def _region(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(world))
    torch.manual_seed(1)
    serial = FNOBlock(SpectralConv2d(4, 4, 3, 3)).double()
    spectral = Sharded(4, 4, 3, 3)
    spectral.load_state_dict(serial.spectral.state_dict())
    parallel = copy.deepcopy(serial)
    parallel.spectral = spectral
    parallel = tplayers.parallelize_module(parallel, {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    sizes = [6, 5]
    local = lambda t: local_slice(t, (2,), [sizes], [rank])  # noqa: E731
    opt_s, opt_p = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (serial, parallel))
    for _ in range(2):
        x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        w = torch.randn(ys.shape, dtype=torch.float64)
        (ys * w).sum().backward()
        tplayers.domain_sum(yl * local(w), mesh).backward()
        torch.testing.assert_close(xl.grad, local(xs.grad), **TIGHT)
        for (n, p), q in zip(parallel.named_parameters(), serial.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"{n}: {m}", **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
    return True


def test_an_fno_block_in_a_domain_parallel_region():
    run_ranks(_region, 2, timeout=120)


def _errors(rank, world):
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    w = torch.randn(3, 4, 2, 2, dtype=torch.complex128)
    wide = torch.randn(3, 4, 2, 9, dtype=torch.complex128)
    tall = torch.randn(3, 4, 13, 2, dtype=torch.complex128)
    return [
        raised(lambda: TF.spectral_conv2d(x, w, w, 2, 2, norm="ortho" if rank else None)),  # one rank differs
        raised(lambda: TF.spectral_conv2d(x, w.real, w, 2, 2)),
        raised(lambda: TF.spectral_conv2d(x, wide, wide, 2, 9)),
        raised(lambda: TF.spectral_conv2d(x if rank else x[:, :2], w, w, 2, 2)),  # one rank's bad input
        raised(lambda: TF.spectral_conv2d(x, tall, tall, 13, 2)),  # modes1 over the global H (12)
    ]


def test_spectral_conv2d_errors_on_every_rank():
    for rank, out in enumerate(run_ranks(_errors, 2, timeout=60)):
        assert out[0][0] == "ValueError" and "norm differs" in out[0][1]
        assert out[1][0] == "TypeError" and "weights1 must be a complex" in out[1][1]
        assert out[2][0] == "ValueError" and "modes2=9 exceeds W // 2 + 1 = 5" in out[2][1]
        if rank == 0:
            assert out[3][0] == "ValueError" and "weights1 must have shape (2, C_out" in out[3][1]
        else:
            assert out[3][0] == "ValueError" and "rank(s) [0] rejected" in out[3][1]
        assert out[4][0] == "ValueError" and "modes (13, 2) exceed the spectrum (12, 5)" in out[4][1]


def _serial_fno():
    torch.manual_seed(1)
    return FNOBlock(SpectralConv2d(4, 4, 3, 3)).double()


def _fno_model(world):
    serial = _serial_fno()
    spectral = Sharded(4, 4, 3, 3)
    spectral.load_state_dict(serial.spectral.state_dict())
    parallel = copy.deepcopy(serial)
    parallel.spectral = spectral
    mesh = DeviceMesh("cpu", torch.arange(world))
    return serial, tplayers.parallelize_module(parallel, {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)


def _step(model, x, sharded):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    y = model(tplayers.shard(x, 2) if sharded else x)
    (tplayers.domain_sum(y**2) if sharded else (y**2).sum()).backward()
    opt.step()
    return opt


def _input():
    return torch.randn(2, 3, 11, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def _train_and_save(rank, world, path):
    _, parallel = _fno_model(world)
    tplayers.save_checkpoint(parallel, path, optimizer=_step(parallel, _input(), True))
    return True


def _load_at(rank, world, path):
    trained, parallel = _fno_model(world)
    serial_opt = _step(trained, _input(), False)  # the serial model after the same step
    opt = torch.optim.AdamW(parallel.parameters(), lr=0.05)
    tplayers.load_checkpoint(parallel, path, optimizer=opt)
    for (k, v), ref in zip(parallel.named_parameters(), trained.parameters()):
        assert v.dtype == ref.dtype, k
        torch.testing.assert_close(v, ref, **TIGHT)
        torch.testing.assert_close(opt.state[v]["exp_avg"], serial_opt.state[ref]["exp_avg"], **TIGHT)
    x = _input()
    torch.testing.assert_close(parallel(tplayers.shard(x, 2)), tplayers.shard(trained(x), 2), **TIGHT)
    return True


def test_an_fno_checkpoint_saved_at_2_ranks_loads_at_1_and_4(tmp_path):
    path = str(tmp_path / "fno")
    run_ranks(_train_and_save, 2, args=(path,), timeout=120)
    for world in (1, 4):
        run_ranks(_load_at, world, args=(path,), timeout=120)
    trained = _serial_fno()  # a plain serial model, no process group
    _step(trained, _input(), False)
    serial = _serial_fno()
    tplayers.load_checkpoint(serial, path)
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(v, trained.state_dict()[k], **TIGHT)


def _match_2d(rank, world, batch, layouts):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    coords = [mesh.get_local_rank(i) for i in range(2)]
    torch.manual_seed(0)
    serial = SpectralConv2d(3, 2, 3, 4).double()
    par = copy.deepcopy(serial)
    local = lambda t: local_slice(t, (2, 3), layouts, coords)  # noqa: E731
    x = torch.randn(batch, 3, sum(layouts[0]), sum(layouts[1]), dtype=torch.float64)
    xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
    ys = serial(xs)
    yl = TF.spectral_conv2d(xl, par.weights1, par.weights2, 3, 4, mesh=mesh, shard_dims=(2, 3))
    torch.testing.assert_close(yl, local(ys), **TIGHT)
    w = torch.randn(ys.shape, dtype=torch.float64)
    (ys * w).sum().backward()
    (yl * local(w)).sum().backward()
    torch.testing.assert_close(xl.grad, local(xs.grad), **TIGHT)
    for name in ("weights1", "weights2"):
        torch.testing.assert_close(getattr(par, name).grad, getattr(serial, name).grad, **TIGHT)
    return True


@pytest.mark.parametrize("batch, layouts", [(3, [[5, 4], [4, 6]]), (1, [[6, 6], [5, 5]])])
def test_spectral_conv2d_on_a_2x2_mesh(batch, layouts):
    run_ranks(_match_2d, 4, args=(batch, layouts), timeout=120)
