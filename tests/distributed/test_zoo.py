"""The model zoo (issue 31): every model in ``tests/zoo_models.py`` (timm, segmentation_models_pytorch,
diffusers, MONAI, transformers; tiny configs, random init, no downloads, the packages' code unchanged)
under ``{"": DomainParallel(shard_dims=...)}`` equals the serial model in fp64 at 2 ranks (H sharded)
and on a 2x2 mesh (H and W): the output, the input gradient, every parameter gradient (gathered with
``tplayers.gather_grads``), every parameter after an SGD step with momentum, every buffer (running
statistics), and the output again in eval mode after the step.

The models of one package run one after another in the same ranks (one process start per package and
mesh); a failure names the model. docs/domain-parallel.md's "Models tried" table lists them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks
from oracle import local_slice
from torch.distributed.device_mesh import DeviceMesh
from zoo_models import ZOO

import tplayers

TIGHT = dict(rtol=1e-8, atol=1e-10)


def _close(got, want, msg):
    """``got`` equals ``want`` to fp64 rounding: TIGHT, its absolute part scaled by ``want``'s largest
    magnitude where that exceeds 1 (a weight gradient of magnitude 400 summed over a sharded domain in
    another order differs by ~1e-10 where its terms nearly cancel: smp PAN on a 2x2 mesh, Intel host)."""
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=TIGHT["rtol"], atol=TIGHT["atol"] * scale, msg=msg)


def _local_out(y, layouts, coords, side, dims):
    """This rank's block of the serial per-pixel output ``y`` (its resolution may be a fraction of the
    input's: every share scales by it)."""
    scaled = [[s * y.shape[d] // side for s in sizes] for d, sizes in zip(dims, layouts)]
    return local_slice(y, dims, scaled, coords)


def check_model(name, mesh, layouts):
    """Serial vs parallel for one zoo model on this rank (raises AssertionError naming what differs)."""
    entry = ZOO[name]
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    serial = entry.build()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.01, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, entry.channels, entry.side, entry.side, dtype=torch.float64, generator=gen)
    xs = x.clone().requires_grad_(True)
    xl = local_slice(x, dims, layouts, coords).clone().requires_grad_(True)
    torch.manual_seed(2)  # dropout: every rank draws what the serial model draws
    ys = entry.call(serial, xs)
    torch.manual_seed(2)
    yp = entry.call(parallel, xl)
    cot = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
    if entry.out == "image":
        local = _local_out(ys, layouts, coords, entry.side, dims)
        _close(yp, local, msg=lambda m: f"{name} output: {m}")
        loss_s, loss_p = (
            (ys * cot).sum(),
            tplayers.domain_sum(yp * _local_out(cot, layouts, coords, entry.side, dims), mesh),
        )
    else:
        _close(yp, ys, msg=lambda m: f"{name} output: {m}")
        loss_s, loss_p = (ys * cot).sum(), (yp * cot).sum()
    loss_s.backward(), loss_p.backward()
    _close(xl.grad, local_slice(xs.grad, dims, layouts, coords), msg=lambda m: f"{name} input grad: {m}")
    grads = tplayers.gather_grads(parallel, all_ranks=True)
    want = {k: p.grad for k, p in serial.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(want), f"{name}: parameters with gradients differ: {sorted(set(grads) ^ set(want))}"
    for k, g in want.items():
        _close(grads[k], g, msg=lambda m: f"{name} grad {k}: {m}")
    opt_s.step(), opt_p.step()
    full = tplayers.gather_state_dict(parallel, all_ranks=True)
    for k, v in serial.state_dict().items():  # parameters after the step and buffers (running stats)
        if torch.is_floating_point(v):
            _close(full[k], v, msg=lambda m: f"{name} after the step, {k}: {m}")
        else:
            assert torch.equal(full[k], v), f"{name} after the step, {k}"
    serial.eval(), parallel.eval()
    with torch.no_grad():
        ys, yp = entry.call(serial, x), entry.call(parallel, xl.detach())
    want = _local_out(ys, layouts, coords, entry.side, dims) if entry.out == "image" else ys
    _close(yp, want, msg=lambda m: f"{name} eval output: {m}")


def _run(rank, world, names, mesh_shape, keep_going=False):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    failed = {}
    for name in names:
        side = ZOO[name].side
        layouts = [[side // n] * n for n in mesh_shape]
        try:
            check_model(name, mesh, layouts)
        except Exception as e:  # noqa: BLE001 - collected per model, raised below
            if not keep_going:
                raise AssertionError(f"{name} (mesh {mesh_shape}): {type(e).__name__}: {e}") from e
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return failed


PACKAGES = sorted({e.package for e in ZOO.values()})


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2 ranks", "2x2"])
def test_zoo_models_are_exact(package, mesh_shape):
    names = [n for n, e in ZOO.items() if e.package == package and tuple(mesh_shape) in e.meshes]
    world = 1
    for n in mesh_shape:
        world *= n
    run_ranks(_run, world, args=(names, mesh_shape), timeout=600)


def test_the_zoo_has_at_least_25_models():
    assert len(ZOO) >= 25, sorted(ZOO)
