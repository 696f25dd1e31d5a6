"""tplayers.shard / scatter / gather: values, uneven sizes, gradients, 1-D and 2-D meshes."""

import torch
from harness import raised, run_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
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
    rows = torch.arange(7.0, dtype=torch.float64)[offsets_from_sizes(sizes)[rank] :][: sizes[rank]]
    assert torch.equal(x.grad, rows.view(1, 1, -1, 1).expand_as(x))
    # scatter from another source rank
    got = tplayers.scatter(full.detach() if rank == 3 else None, 2, m1, src=3)
    a, b = shard_range(7, 4, rank)
    assert torch.equal(got, full.detach()[:, :, a:b])
    return True


def test_shard_scatter_gather():
    run_ranks(_helpers, 4, timeout=60)


def _disagreeing(rank, world):
    """Ranks that call gather/scatter differently: an error on EVERY rank, no abort, no hang."""
    m1 = DeviceMesh("cpu", torch.arange(world))
    m2 = DeviceMesh("cpu", torch.arange(world).reshape(2, 2))
    x = torch.zeros(2, 3, 4, 5)
    out = {}
    # gather: another dim on rank 1 (was a gloo EnforceNotMet abort)
    out["dim"] = raised(lambda: tplayers.gather(x, 3 if rank == 1 else 2, m1))
    # gather: another dtype on rank 2
    out["dtype"] = raised(lambda: tplayers.gather(x.double() if rank == 2 else x, 2, m1))
    # gather: other dims differ (channels 3 vs 4)
    out["shape"] = raised(lambda: tplayers.gather(torch.zeros(2, 4 if rank == 0 else 3, 4, 5), 2, m1))
    # gather: a bad argument on one rank only (a non-tensor) still reaches every rank
    out["type"] = raised(lambda: tplayers.gather("oops" if rank == 3 else x, 2, m1))
    # gather on a 2-D mesh whose shards are no grid (rows differ inside one mesh row)
    out["grid"] = raised(lambda: tplayers.gather(torch.zeros(1, 1, 2 + (rank == 1), 3), (2, 3), m2))
    full = torch.randn(2, 3, 7, 5)
    # scatter: a different dim per rank (was silently wrong shapes)
    out["sdim"] = raised(lambda: tplayers.scatter(full if rank == 0 else None, 3 if rank == 2 else 2, m1))
    # scatter: a different src per rank (was a hang)
    out["src"] = raised(lambda: tplayers.scatter(full if rank in (0, 1) else None, 2, m1, src=1 if rank == 3 else 0))
    # scatter: the source passes no tensor
    out["nosrc"] = raised(lambda: tplayers.scatter(None, 2, m1, src=0))
    # the group still works afterwards: nothing was left half-sent
    ok = tplayers.gather(tplayers.scatter(full if rank == 0 else None, 2, m1), 2, m1)
    assert torch.equal(ok, full)
    return out


def test_gather_scatter_disagreement_raises_on_every_rank():
    outs = run_ranks(_disagreeing, 4, timeout=30)
    for rank, out in enumerate(outs):
        assert "dim differs across ranks" in out["dim"][1] and "[1]" in out["dim"][1], out["dim"]
        assert "dtype differs" in out["dtype"][1], out["dtype"]
        assert "other dims differs" in out["shape"][1], out["shape"]
        assert out["type"][0] == ("TypeError" if rank == 3 else "ValueError"), out["type"]
        assert "rank(s) [3]" in out["type"][1] or rank == 3, out["type"]
        assert "grid" in out["grid"][1], out["grid"]
        assert "dim differs" in out["sdim"][1] and "[2]" in out["sdim"][1], out["sdim"]
        assert "src differs" in out["src"][1] and "[3]" in out["src"][1], out["src"]
        assert ("must pass a tensor" in out["nosrc"][1]) == (rank == 0), out["nosrc"]
