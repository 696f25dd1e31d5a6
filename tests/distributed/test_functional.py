"""``tplayers.functional`` and ``tplayers.domain_region`` for hand-written code: the serial result's slice,
values and gradients (fp64, uneven partitions, 1-D and 2-D meshes)."""

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
import tplayers.functional as TF

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _local(x, dims, layouts, coords):
    for d, sizes, c in zip(dims, layouts, coords):
        x = x.narrow(d, sum(sizes[:c]), sizes[c])
    return x


CASES = [
    ("sum", lambda f, x, **k: f.sum(x, dim=(2, 3), **k), lambda x: x.sum(dim=(2, 3))),
    ("mean keepdim", lambda f, x, **k: f.mean(x, (2, 3), True, **k), lambda x: x.mean((2, 3), True)),
    ("amax", lambda f, x, **k: f.amax(x, (2, 3), **k), lambda x: x.amax((2, 3))),
    ("amin all", lambda f, x, **k: f.amin(x, **k), lambda x: x.amin()),
    ("var", lambda f, x, **k: f.var(x, (2, 3), correction=0, **k), lambda x: x.var((2, 3), correction=0)),
    ("std", lambda f, x, **k: f.std(x, (1, 2, 3), **k), lambda x: x.std((1, 2, 3))),
    ("norm", lambda f, x, **k: f.norm(x, 2, (2, 3), **k), lambda x: torch.linalg.vector_norm(x, 2, (2, 3))),
    (
        "bilinear",
        lambda f, x, **k: f.interpolate(x, scale_factor=2, mode="bilinear", **k),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    ),
    ("max_pool", lambda f, x, **k: f.max_pool2d(x, 3, 2, 1, **k), lambda x: F.max_pool2d(x, 3, 2, 1)),
    ("avg_pool", lambda f, x, **k: f.avg_pool2d(x, 2, **k), lambda x: F.avg_pool2d(x, 2)),
    ("adaptive", lambda f, x, **k: f.adaptive_avg_pool2d(x, 1, **k), lambda x: F.adaptive_avg_pool2d(x, 1)),
    ("pad", lambda f, x, **k: f.pad(x, (1, 2, 3, 1), value=0.5, **k), lambda x: F.pad(x, (1, 2, 3, 1), value=0.5)),
]


def _cases(rank, world, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(1)
    shape = [2, 3] + [sum(layouts[i]) if i < len(dims) else 7 for i in range(2)]
    for name, ours, ref in CASES:
        x = torch.randn(shape, dtype=torch.float64)
        x[0, 0, 0, 0] = x[1, 1, -1, -1] = x.max() + 1  # ties across ranks for amax
        xs = x.clone().requires_grad_(True)
        xl = _local(x, dims, layouts, coords).clone().requires_grad_(True)
        ys, yl = ref(xs), ours(TF, xl, mesh=mesh, shard_dims=dims)
        replicated = ys.dim() < 4 or ys.shape[2] == 1
        want = (
            ys
            if replicated
            else _local(
                ys, dims, [_out(layouts[i], ys.shape[d], x.shape[d], name, i, mesh) for i, d in enumerate(dims)], coords
            )
        )
        torch.testing.assert_close(yl, want, **TIGHT, msg=lambda m: f"{name}: {m}")
        g = torch.randn(ys.shape, dtype=torch.float64)
        ys.backward(g)
        yl.backward(
            g
            if replicated
            else _local(
                g, dims, [_out(layouts[i], ys.shape[d], x.shape[d], name, i, mesh) for i, d in enumerate(dims)], coords
            )
        )
        torch.testing.assert_close(
            xl.grad, _local(xs.grad, dims, layouts, coords), **TIGHT, msg=lambda m: f"{name} grad: {m}"
        )
    return True


def _out(sizes, out_len, in_len, name, axis, mesh):
    """The output partition: the input's when the length is kept, else balanced; padding grows the edges."""
    if name == "pad":
        lo, hi = ((3, 1), (1, 2))[axis]
        return [s + (lo if i == 0 else 0) + (hi if i == len(sizes) - 1 else 0) for i, s in enumerate(sizes)]
    return list(sizes) if out_len == in_len else tplayers.shard_sizes(out_len, len(sizes))


@pytest.mark.parametrize(
    "world,mesh_shape,layouts", [(2, (2,), [[5, 4]]), (3, (3,), [[4, 4, 3]]), (4, (2, 2), [[5, 4], [4, 3]])]
)
def test_functional_twins_match_serial(world, mesh_shape, layouts):
    run_ranks(_cases, world, args=(mesh_shape, layouts), timeout=120)


def _region(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    ys = F.interpolate(x - x.mean(dim=(2, 3), keepdim=True), scale_factor=2, mode="bilinear") * w[:, None, None]
    loss_s = ys.square().mean()
    xl = tplayers.shard(x.detach(), 2, mesh).requires_grad_(True)
    wl = w.detach().clone().requires_grad_(True)
    with tplayers.domain_region(mesh, (2,), inputs=(xl,)):
        yl = F.interpolate(xl - xl.mean(dim=(2, 3), keepdim=True), scale_factor=2, mode="bilinear") * wl[:, None, None]
        loss_p = yl.square().mean()  # routed: the global mean
        with pytest.raises(ValueError, match="roll"):
            torch.roll(yl, 10, 2)  # more rows than a rank holds (a roll by at most a shard is routed)
    torch.testing.assert_close(loss_p, loss_s, **TIGHT)
    loss_s.backward(), loss_p.backward()
    torch.testing.assert_close(xl.grad, tplayers.shard(x.grad, 2, mesh), **TIGHT)
    torch.testing.assert_close(wl.grad, w.grad, **TIGHT)  # replicated weight: summed where it met the shards
    return True


def test_domain_region_context_for_hand_written_code():
    run_ranks(_region, 2, timeout=60)
