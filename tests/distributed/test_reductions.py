"""domain_sum / domain_mean and the boundary Functions: serial values and gradients (fp64),
uneven and empty shards, 1-D and 2-D meshes, masks, one fused all-reduce per mesh dim."""

import torch
import torch.nn.functional as F
from harness import run_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.sharding import offsets_from_sizes

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _local(x, dims, layouts, coords):
    for i, d in enumerate(dims):
        x = x.narrow(d, offsets_from_sizes(layouts[i])[coords[i]], layouts[i][coords[i]])
    return x


def _reductions(rank, world, mesh_shape, dims, layouts):
    import pytest

    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    torch.manual_seed(1)
    shape = [2, 3, 5, 4]
    for i, d in enumerate(dims):
        shape[d] = sum(layouts[i])
    y = torch.randn(shape, dtype=torch.float64)
    t = torch.randn(shape, dtype=torch.float64)
    labels = torch.randint(-1, 3, (shape[0],) + tuple(shape[2:]))
    logits = torch.randn(shape, dtype=torch.float64)

    # MSE mean, sum
    for red in ("mean", "sum"):
        ys = y.clone().requires_grad_(True)
        yl = _local(y, dims, layouts, coords).clone().requires_grad_(True)
        ref = F.mse_loss(ys, t, reduction=red)
        per = F.mse_loss(yl, _local(t, dims, layouts, coords), reduction="none")
        with tplayers.count_collectives() as log:
            got = tplayers.domain_mean(per, mesh) if red == "mean" else tplayers.domain_sum(per, mesh)
            got.backward()
        assert log.count() == sum(1 for s in mesh_shape if s > 1), log.records
        torch.testing.assert_close(got, ref, **TIGHT)
        ref.backward()
        torch.testing.assert_close(yl.grad, _local(ys.grad, dims, layouts, coords), **TIGHT)

    # cross-entropy with ignore_index == domain_mean with a mask (labels dims shifted by the class dim)
    ls = logits.clone().requires_grad_(True)
    ll = _local(logits, dims, layouts, coords).clone().requires_grad_(True)
    ref = F.cross_entropy(ls, labels, ignore_index=-1)
    lab_l = _local(labels.unsqueeze(1), dims, layouts, coords).squeeze(1)
    ce = F.cross_entropy(ll, lab_l.clamp(min=0), reduction="none")
    ce = torch.where(lab_l != -1, ce, torch.full_like(ce, float("nan")))  # ignored entries may hold anything
    got = tplayers.domain_mean(ce, mesh, mask=lab_l != -1)
    torch.testing.assert_close(got, ref, **TIGHT)
    got.backward(), ref.backward()
    torch.testing.assert_close(ll.grad, _local(ls.grad, dims, layouts, coords), **TIGHT)

    # same scalar, bitwise, on every rank; fp32 input returns fp32
    out = tplayers.domain_mean(_local(y.float(), dims, layouts, coords), mesh)
    assert out.dtype == torch.float32
    allv = [torch.empty_like(out) for _ in range(world)]
    torch.distributed.all_gather(allv, out.contiguous())
    assert all(torch.equal(v, allv[0]) for v in allv)

    with pytest.raises(ValueError, match="mask must have x_local's shape"):
        tplayers.domain_mean(y, mesh, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        tplayers.domain_mean(y, mesh, mask=torch.ones_like(y))
    with pytest.raises(TypeError, match="floating-point"):
        tplayers.domain_sum(torch.ones(3, dtype=torch.int64), mesh)
    return True


def test_domain_reductions_1d_uneven_and_empty():
    run_ranks(_reductions, 3, args=((3,), (2,), [[5, 0, 2]]), timeout=60)
    run_ranks(_reductions, 2, args=((2,), (3,), [[1, 6]]), timeout=60)


def test_domain_reductions_2d_mesh():
    run_ranks(_reductions, 4, args=((2, 2), (2, 3), [[4, 3], [0, 5]]), timeout=60)


def _boundary(rank, world, layout):
    """Squeeze-excitation by hand: pool (sharded -> replicated), MLP, gate back onto the shards."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(2)
    fc = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, sum(layout), 4, dtype=torch.float64)
    w = torch.randn(2, 3, sum(layout), 4, dtype=torch.float64)
    xs = x.clone().requires_grad_(True)
    xl = _local(x, (2,), [layout], [rank]).clone().requires_grad_(True)

    def se(h, pool, gate_in):
        g = torch.sigmoid(fc(pool(h)))
        return h * gate_in(g)[..., None, None]

    ys = se(xs, lambda h: h.mean((2, 3)), lambda g: g)
    (ys * w).sum().backward()
    ref_grads = [p.grad.clone() for p in fc.parameters()]
    fc.zero_grad()
    n = sum(layout) * 4
    yl = se(
        xl,
        lambda h: tplayers.sharded_to_replicated(h.sum((2, 3)), mesh) / n,
        lambda g: tplayers.replicated_to_sharded(g, mesh),
    )
    with tplayers.count_collectives() as log:
        (yl * _local(w, (2,), [layout], [rank])).sum().backward()
    assert log.count("all_reduce") == 1
    torch.testing.assert_close(yl, _local(ys, (2,), [layout], [rank]), **TIGHT)
    torch.testing.assert_close(xl.grad, _local(xs.grad, (2,), [layout], [rank]), **TIGHT)
    for p, r in zip(fc.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, r, **TIGHT)  # full gradient, no extra sum needed
    return True


def test_boundary_functions_squeeze_excitation_by_hand():
    run_ranks(_boundary, 2, args=([3, 6],), timeout=60)
    run_ranks(_boundary, 3, args=([4, 0, 3],), timeout=60)
