"""torch.autocast(bf16): parallel layers compute in the autocast dtype like their nn twins.

Tolerance ("within bf16 rounding"): bf16 keeps 8 significant bits, unit roundoff
u = 2**-8. The serial model under autocast rounds each matmul/conv output once;
the parallel one additionally rounds each rank's partial product and each
addition of the all-reduce (row-parallel output, summed parameter gradients),
so it may differ by a few u of the magnitude involved. We assert, per tensor,
max|parallel - serial| <= C * u * max|serial| with C = 4 * world (the roundings
added by one reduction over `world` ranks, twice for safety through one more
layer), and that the parallel result is no further from the fp64 serial truth
than the serial autocast result is, plus the same bound. Gradients propagated
back through several bf16 layers carry the serial model's own autocast error
(up to ~10% here, measured against fp64), and a one-ulp difference upstream moves
them by as much, so for gradients the parallel-serial difference may also reach
the serial model's own error (never more), and its error against fp64 at most
1.25x the serial one plus C * u * scale. A layer that ignored autocast would fail the
dtype checks; a wrong halo or reduction would be off by O(1), not O(u).
"""

import copy

import pytest
import torch
from harness import run_ranks
from oracle import gather_tensor
from torch import nn

import tplayers
from tplayers.comm import count_collectives
from tplayers.layers import ShardedModule

U = 2.0**-8


def _full_grads(parallel):
    out = {}
    for mod_name, mod in parallel.named_modules():
        if isinstance(mod, ShardedModule):
            for pname in mod.shard_specs():
                p = mod.get_parameter(pname)
                out[f"{mod_name}.{pname}" if mod_name else pname] = gather_tensor(mod, pname, p.grad)
    for name, p in parallel.named_parameters():
        out.setdefault(name, p.grad)
    return out


def _close(got, ref, c, what):
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= c * U * scale, f"{what}: max error {err:.3g} > {c} u * {scale:.3g}"
    return err / max(scale, 1e-30) / U  # error in units of u, for reporting


def _compare(rank, world, serial, parallel, make_input, local_input, out_local):
    c = 4 * world
    truth = copy.deepcopy(serial).double()
    ratios = []
    for step in range(2):  # a second input after one optimizer step
        x = make_input(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = serial(x)
            yp = parallel(local_input(x))
        assert yp.dtype == ys.dtype == torch.bfloat16, (yp.dtype, ys.dtype)
        yt = truth(x.double())
        ratios.append(_close(yp.float(), out_local(ys.float()), c, f"output step {step}"))
        # no further from the fp64 truth than the serial autocast model is, up to the same bound
        serial_err = (out_local(ys.double()) - out_local(yt)).abs().max().item()
        par_err = (yp.double() - out_local(yt)).abs().max().item()
        assert par_err <= serial_err + c * U * yt.abs().max().item(), (par_err, serial_err)
        g = torch.randn(ys.shape, generator=torch.Generator().manual_seed(step))
        for m in (serial, parallel, truth):
            m.zero_grad(set_to_none=True)
        ys.float().backward(g)
        yp.float().backward(out_local(g))
        yt.backward(g.double())
        gp, gs = _full_grads(parallel), dict(serial.named_parameters())
        for name, p in gs.items():
            assert gp[name].dtype == p.dtype == torch.float32, name  # gradients in the parameters' dtype
            tg = dict(truth.named_parameters())[name].grad
            serial_err = (p.grad.double() - tg).abs().max().item()  # the serial model's own autocast error
            par_err = (gp[name].double() - tg).abs().max().item()
            bound = c * U * tg.abs().max().item()
            assert par_err <= 1.25 * serial_err + bound, (name, step, par_err, serial_err)
            diff = (gp[name] - p.grad).abs().max().item()
            assert diff <= max(bound, serial_err), (name, step, diff, bound, serial_err)
            ratios.append(diff / (U * tg.abs().max().item()))
        for opt_model in (serial, parallel, truth):
            with torch.no_grad():
                for p in opt_model.parameters():
                    p.sub_(0.01 * p.grad)
    return max(ratios)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(12, 21)
        self.down = nn.Linear(21, 10)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _tp_mlp(rank, world, reduce_dtype):
    torch.manual_seed(0)
    serial = MLP()
    opts = {} if reduce_dtype is None else {"reduce_dtype": reduce_dtype}
    parallel = copy.deepcopy(serial)
    parallel.up = tplayers.ColumnParallelLinear.from_module(serial.up, **opts)
    parallel.down = tplayers.RowParallelLinear.from_module(serial.down, **opts)
    with count_collectives() as log:
        worst = _compare(
            rank,
            world,
            serial,
            parallel,
            lambda s: torch.randn(5, 12, generator=torch.Generator().manual_seed(10 + s)),
            lambda x: x,
            lambda y: y,
        )
    per_elem = 4 if reduce_dtype == torch.float32 else 2  # the reductions carry this many bytes per value
    fwd = [r for r in log.records if r.tag == "linear.fwd"]
    assert fwd and all(r.nbytes == 5 * 10 * per_elem for r in fwd), [r.nbytes for r in fwd]
    return worst


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_autocast_tp_mlp(reduce_dtype):
    worst = run_ranks(_tp_mlp, 3, args=(reduce_dtype,), timeout=60)
    print(f"TP MLP bf16 autocast, reduce_dtype={reduce_dtype}: worst error {max(worst):.2f} u")


def _conv_stack(rank, world):
    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3, padding=1, padding_mode="circular"),
    )
    mesh = tplayers.default_mesh()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    h = 23  # uneven rows over 2-4 ranks

    def out_local(y):  # this rank's rows of a serial output (balanced partition of its height)
        return tplayers.shard(y, 2, mesh)

    return _compare(
        rank,
        world,
        serial,
        parallel,
        lambda s: torch.randn(2, 3, h, 9, generator=torch.Generator().manual_seed(20 + s)),
        lambda x: tplayers.shard(x, 2, mesh),
        out_local,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_autocast_conv_stack(world):
    worst = run_ranks(_conv_stack, world, timeout=60)
    print(f"DistributedConv2d stack bf16 autocast at {world} ranks: worst error {max(worst):.2f} u")


def _still_strict(rank, world):
    layer = tplayers.RowParallelLinear(6, 4)
    with pytest.raises(ValueError, match="dtype must match"):
        layer(torch.randn(2, 3, dtype=torch.bfloat16))  # no autocast: fp32 weights take fp32 input
    with pytest.raises(TypeError, match="reduce_dtype"):
        tplayers.ColumnParallelLinear(6, 4, reduce_dtype="float32")
    conv = tplayers.DistributedConv2d(2, 2, 3, padding=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(torch.randn(1, 2, 3, 4, dtype=torch.float16)).dtype == torch.bfloat16  # fp16 cast, as nn.Conv2d
        y64 = conv.double()(torch.randn(1, 2, 3, 4, dtype=torch.float64))  # fp64 is not autocast
    assert y64.dtype == torch.float64
    return True


def test_autocast_keeps_checks():
    run_ranks(_still_strict, 2, timeout=60)


def _na(rank, world):
    torch.manual_seed(0)
    single = tplayers.NeighborhoodAttention(8, 2, 3, rel_pos_bias=True)  # single-device NA: the oracle
    mesh = tplayers.default_mesh()
    par = tplayers.NeighborhoodAttention.from_module(single, mesh=mesh, shard_dims=(1,))
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):  # a bf16 input (from an earlier autocast layer) too
        x = torch.randn(2, 4 * world + 1, 6, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = single(x)
            yp = par(tplayers.shard(x, 1, mesh))
        assert ys.dtype == yp.dtype == torch.bfloat16
        worst = max(worst, _close(yp.float(), tplayers.shard(ys, 1, mesh).float(), 4 * world, f"NA {dtype}"))
    with pytest.raises(ValueError, match="dtype"):  # outside autocast the dtype check stays strict
        par(tplayers.shard(x, 1, mesh))
    return worst


def test_autocast_neighborhood_attention():
    run_ranks(_na, 2, timeout=60)


def _twins(rank, world):
    """Every other domain twin under autocast keeps the serial module's output dtype (fp32 for
    norms, pooling and interpolation, which autocast does not cast down; bf16 for the transposed
    convolution) and its values: fp32 round-off, or bf16 rounding where the serial one rounds."""
    torch.manual_seed(0)
    mesh = tplayers.default_mesh()
    mods = [
        nn.GroupNorm(2, 4),
        nn.BatchNorm2d(4),
        nn.InstanceNorm2d(4, affine=True),
        nn.MaxPool2d(2),
        nn.AvgPool2d(3, 1, 1),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.Upsample(size=(11, 5)),
        nn.AdaptiveAvgPool2d(1),
        nn.AdaptiveAvgPool2d((3, 3)),
        nn.AdaptiveMaxPool2d((3, 3)),
        nn.ConvTranspose2d(4, 4, 2, 2),
    ]
    seen = []
    for m in mods:
        par = tplayers.parallelize_module(copy.deepcopy(m), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
        x = torch.randn(2, 4, 4 * world + 1, 6, generator=torch.Generator().manual_seed(1))
        xs, xp = x.clone().requires_grad_(True), tplayers.shard(x, 2, mesh).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys, yp = m(xs), par(xp)
        name = type(m).__name__
        assert yp.dtype == ys.dtype, (name, yp.dtype, ys.dtype)
        ref = ys if ys.shape[2] == 1 else tplayers.shard(ys, 2, mesh)  # size 1: replicated
        tol = dict(rtol=1e-5, atol=1e-6) if ys.dtype == torch.float32 else dict(rtol=4 * world * U, atol=4 * world * U)
        torch.testing.assert_close(yp, ref.detach(), **tol, msg=lambda s: f"{name}: {s}")
        g = torch.randn(ys.shape, generator=torch.Generator().manual_seed(2))
        ys.float().backward(g)
        yp.float().backward(g if ys.shape[2] == 1 else tplayers.shard(g, 2, mesh))
        assert xp.grad.dtype == xs.grad.dtype == torch.float32, name
        torch.testing.assert_close(xp.grad, tplayers.shard(xs.grad, 2, mesh), **tol, msg=lambda s: f"{name} grad: {s}")
        seen.append((name, str(ys.dtype)))
    return seen


def test_autocast_domain_twins_keep_serial_dtypes():
    out = run_ranks(_twins, 2, timeout=60)
    assert ("Upsample", "torch.float32") in out[0] and ("ConvTranspose2d", "torch.bfloat16") in out[0]
