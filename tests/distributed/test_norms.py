"""Distributed Batch/Group/InstanceNorm vs the serial module (fp64): outputs, input and parameter
gradients, running stats and num_batches_tracked after optimizer steps, train and eval, uneven
partitions with an empty shard, 1-D and 2-D meshes; collectives counted; bf16 statistics accuracy."""

import copy
import random

import torch
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.sharding import offsets_from_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)


def _local(x, dims, layouts, coords):
    for i, d in enumerate(dims):
        x = x.narrow(d, offsets_from_sizes(layouts[i])[coords[i]], layouts[i][coords[i]])
    return x


def _configs(seed):
    rng = random.Random(seed)
    out = []
    for nd in (1, 2, 3):
        bn = getattr(nn, f"BatchNorm{nd}d")
        inn = getattr(nn, f"InstanceNorm{nd}d")
        c = rng.choice([2, 3, 4])
        out.append(
            (
                nd,
                lambda c=c, bn=bn: bn(
                    c, momentum=rng.choice([0.1, 0.3, None]), affine=rng.random() < 0.8, eps=rng.choice([1e-5, 1e-3])
                ),
            )
        )
        out.append((nd, lambda c=c, bn=bn: bn(c, track_running_stats=False)))
        out.append(
            (
                nd,
                lambda c=c, inn=inn: inn(
                    c, affine=rng.random() < 0.5, track_running_stats=True, momentum=rng.choice([0.2, None])
                ),
            )
        )
        out.append((nd, lambda c=c, inn=inn: inn(c, affine=True)))
        out.append((nd, lambda: nn.GroupNorm(rng.choice([1, 2, 3]) * 1, 6, affine=rng.random() < 0.8)))
    return out


def _randomize(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand_like(p) + 0.5)


def _norms(rank, world, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    for k, (nd, make) in enumerate(_configs(7)):
        if nd < len(dims):
            continue
        torch.manual_seed(100 + k)
        serial = make().double()
        _randomize(serial)
        twin = getattr(tplayers, "Distributed" + type(serial).__name__).from_module(
            copy.deepcopy(serial), mesh=mesh, shard_dims=dims
        )
        assert list(twin.state_dict()) == list(serial.state_dict())
        opt_s = torch.optim.SGD(serial.parameters(), lr=0.1) if list(serial.parameters()) else None
        opt_p = torch.optim.SGD(twin.parameters(), lr=0.1) if opt_s else None
        c = serial.num_channels if isinstance(serial, nn.GroupNorm) else serial.num_features
        for step, mode in enumerate(["train", "train", "eval"]):
            serial.train(mode == "train"), twin.train(mode == "train")
            shape = [3, c] + [sum(layouts[i]) if i < len(dims) else 4 for i in range(nd)]
            x = torch.randn(shape, dtype=torch.float64) * 3 + 5
            xs = x.clone().requires_grad_(True)
            xl = _local(x, dims, layouts, coords).clone().requires_grad_(True)
            ys = serial(xs)
            with tplayers.count_collectives() as log:
                yl = twin(xl)
            ag = log.count("all_gather")
            cot = torch.randn_like(ys)
            with tplayers.count_collectives() as log:
                (yl * _local(cot, dims, layouts, coords)).sum().backward()
            ar = log.count("all_reduce")
            (ys * cot).sum().backward()
            where = f"{serial} step {step} ({mode})"
            torch.testing.assert_close(yl, _local(ys, dims, layouts, coords), msg=lambda m: f"{where}: {m}", **TIGHT)
            torch.testing.assert_close(
                xl.grad, _local(xs.grad, dims, layouts, coords), msg=lambda m: f"{where} x.grad: {m}", **TIGHT
            )
            for (n, p), q in zip(twin.named_parameters(), serial.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{where} {n}.grad: {m}", **TIGHT)
            for (n, b), r in zip(twin.named_buffers(), serial.buffers()):
                torch.testing.assert_close(b, r, msg=lambda m: f"{where} {n}: {m}", **TIGHT)
            active = sum(1 for s in mesh_shape if s > 1)
            uses_stats = mode == "train" or getattr(serial, "running_mean", None) is None
            assert ag == (active if uses_stats else 0), (where, ag)
            assert ar == (active if uses_stats or list(serial.parameters()) else 0), (where, ar)
            if opt_s:
                opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
                for p, q in zip(twin.parameters(), serial.parameters()):
                    torch.testing.assert_close(p, q, **TIGHT)
    return True


def test_norms_match_serial_1d_mesh_uneven_with_empty_shard():
    run_ranks(_norms, 3, args=((3,), [[5, 0, 3]]), timeout=120)


def test_norms_match_serial_2_ranks():
    run_ranks(_norms, 2, args=((2,), [[2, 5]]), timeout=120)


def test_norms_match_serial_2d_mesh():
    run_ranks(_norms, 4, args=((2, 2), [[3, 4], [5, 1]]), timeout=120)


def _bf16(rank, world):
    """bf16 input with a large offset: our statistics vs an fp64 reference, at least as good as serial's."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(3)
    x = (torch.randn(2, 4, 64, 16, dtype=torch.float64) * 0.1 + 300).to(torch.bfloat16)
    ref = nn.GroupNorm(2, 4).double()(x.double())
    serial = nn.GroupNorm(2, 4).to(torch.bfloat16)(x).double()
    ours = tplayers.gather(
        tplayers.DistributedGroupNorm(2, 4, mesh=mesh, dtype=torch.bfloat16)(tplayers.shard(x, 2, mesh)), 2, mesh
    ).double()
    err_s, err_o = (serial - ref).abs().max().item(), (ours - ref).abs().max().item()
    assert err_o <= err_s + 1e-12, (err_o, err_s)
    bn_ref = nn.BatchNorm2d(4).double()
    bn_ref(x.double())
    bn = tplayers.DistributedBatchNorm2d(4, mesh=mesh, dtype=torch.bfloat16)
    bn(tplayers.shard(x, 2, mesh))
    bn_serial = nn.BatchNorm2d(4).to(torch.bfloat16)
    bn_serial(x)
    for name in ("running_mean", "running_var"):
        e_o = (getattr(bn, name).double() - getattr(bn_ref, name)).abs().max().item()
        e_s = (getattr(bn_serial, name).double() - getattr(bn_ref, name)).abs().max().item()
        assert e_o <= e_s + 1e-12, (name, e_o, e_s)
    return True


def test_bf16_statistics_at_least_as_accurate_as_serial():
    run_ranks(_bf16, 2, timeout=60)


def _errors(rank, world):
    import pytest

    mesh = tplayers.default_mesh()
    with pytest.raises(ValueError, match="shard_dims must be one or two distinct spatial dims"):
        tplayers.DistributedBatchNorm1d(3, mesh=mesh, shard_dims=(3,))
    with pytest.raises(ValueError, match="expected 3 channels"):
        tplayers.DistributedGroupNorm(1, 3, mesh=mesh)(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="expected a 4-D input"):
        tplayers.DistributedBatchNorm2d(3, mesh=mesh)(torch.randn(2, 3, 5))
    with pytest.raises(TypeError, match="expects an BatchNorm2d, got GroupNorm"):
        tplayers.DistributedBatchNorm2d.from_module(nn.GroupNorm(1, 3), mesh=mesh)
    return True


def test_norm_argument_errors_on_every_rank():
    run_ranks(_errors, 2, timeout=30)
