"""``tplayers.gather_grads``: every parameter's gradient in the serial layout (tensor-parallel shards
gathered, a tied parameter once, parameters without a gradient left out), and a ``ValueError`` on every rank
when a parameter has a gradient on some ranks only. The zoo (test_zoo.py) uses it on whole models."""

import copy

import pytest
import torch
from harness import run_ranks
from torch import nn

import tplayers


def _serial_layout(rank, world):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8), nn.Linear(8, 2)).double()
    serial[3].requires_grad_(False)  # no gradient anywhere: left out
    plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan)
    x = torch.randn(4, 8, dtype=torch.float64)
    serial(x).square().sum().backward()
    model(x).square().sum().backward()
    grads = tplayers.gather_grads(model, all_ranks=True)
    want = {k: p.grad for k, p in serial.named_parameters() if p.grad is not None}
    assert list(grads) == list(want)
    for k, g in want.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-13)
    on_rank0 = tplayers.gather_grads(model)
    assert (list(on_rank0) == list(want)) if rank == 0 else on_rank0 == {}
    return True


def test_gradients_come_back_in_the_serial_layout():
    assert run_ranks(_serial_layout, 2, timeout=60) == [True, True]


def _uneven(rank, world):
    model = nn.Linear(3, 2).double()
    if rank == 0:
        model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match=r"parameters without a gradient differ across ranks"):
        tplayers.gather_grads(model)
    return True


def test_a_gradient_on_some_ranks_only_raises_on_every_rank():
    assert run_ranks(_uneven, 2, timeout=60) == [True, True]


def _fsdp2(rank, world):
    """Tensor parallel over 'tp', FSDP2 over 'dp' (2 x 2): the gradients are DTensors sharded over dp
    (averaged over its ranks) holding tensor-parallel shards; gather_grads returns the serial gradient
    of the dp-averaged loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tplayers.mesh import is_dtensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).double()
    plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    xs = torch.randn(2, 5, 8, dtype=torch.float64)
    (serial(xs[0]).square().sum() + serial(xs[1]).square().sum()).div(2).backward()
    model(xs[mesh.get_local_rank(0)]).square().sum().backward()
    assert all(is_dtensor(p.grad) for p in model.parameters())
    grads = tplayers.gather_grads(model, all_ranks=True)
    want = {k: p.grad for k, p in serial.named_parameters()}
    assert list(grads) == list(want), (list(grads), list(want))
    for k, g in want.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-13, msg=lambda m: f"{k}: {m}")
    assert not is_dtensor(torch.ones(1))
    return True


def test_fsdp2_gradients_come_back_in_the_serial_layout():
    assert run_ranks(_fsdp2, 4, timeout=60) == [True] * 4
