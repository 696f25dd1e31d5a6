"""tplayers.shard / scatter / gather: values, uneven sizes, gradients, 1-D and 2-D meshes."""

import torch
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from harness import run_ranks
from tplayers.sharding import offsets_from_sizes, shard_range


def _helpers(rank, world):
    torch.manual_seed(0)  # same full tensor everywhere
    full = torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True)
    m1 = DeviceMesh("cpu", torch.arange(world))
    m2 = DeviceMesh("cpu", torch.arange(world).reshape(2, 2))
    for mesh, dim in [(m1, 2), (m1, 3), (m2, (2, 3))]:
        loc = tplayers.shard(full, dim, mesh)
        dims = (dim,) if isinstance(dim, int) else dim
        expect = full
        for i, d in enumerate(dims):
            a, b = shard_range(full.size(d), mesh.size(i), mesh.get_local_rank(i))
            expect = expect.narrow(d, a, b - a)
        assert torch.equal(loc, expect)
        assert torch.equal(tplayers.gather(loc * 2, dim, mesh), full * 2)
        (loc * 3).sum().backward()  # shard's backward all-gathers: the full gradient everywhere
        assert torch.equal(full.grad, torch.full_like(full, 3.0))
        full.grad = None
        sc = tplayers.scatter(full if rank == 0 else None, dim, mesh, src=0)
        assert torch.equal(sc, expect) and sc.requires_grad
        (sc * 5).sum().backward()  # scatter's backward gathers the gradient on the source
        if rank == 0:
            assert torch.equal(full.grad, torch.full_like(full, 5.0))
        full.grad = None
    # gather of an arbitrary uneven partition (sizes exchanged), with its backward slice
    sizes = [3, 0, 1, 3]
    x = full.detach().narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank]).clone().requires_grad_(True)
    g = tplayers.gather(x, 2, m1)
    assert torch.equal(g, full.detach())
    (g * torch.arange(7.0, dtype=torch.float64).view(1, 1, 7, 1)).sum().backward()
    rows = torch.arange(7.0, dtype=torch.float64)[offsets_from_sizes(sizes)[rank]:][: sizes[rank]]
    assert torch.equal(x.grad, rows.view(1, 1, -1, 1).expand_as(x))
    # scatter from another source rank
    got = tplayers.scatter(full.detach() if rank == 3 else None, 2, m1, src=3)
    a, b = shard_range(7, 4, rank)
    assert torch.equal(got, full.detach()[:, :, a:b])
    return True


def test_shard_scatter_gather():
    run_ranks(_helpers, 4, timeout=60)
