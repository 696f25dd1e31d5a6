"""Halo exchange: forward against the global tensor, and the adjoint identity <Hx, y> == <x, H*y> (fp64)."""

import os
import random

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.comm import halo_exchange
from tplayers.sharding import offsets_from_sizes


def _random_sizes(rng, parts, minimum):
    return [rng.randint(minimum, minimum + 4) for _ in range(parts)]


def _random_widths(rng, sizes, periodic):
    """recv (lo, hi) per coordinate, each side suppliable by the single neighbour."""
    p = len(sizes)
    recv = []
    for c in range(p):
        lo_n = sizes[(c - 1) % p] if (periodic or c > 0) else 3
        hi_n = sizes[(c + 1) % p] if (periodic or c < p - 1) else 3
        recv.append((rng.randint(0, lo_n), rng.randint(0, hi_n)))
    send = [
        (recv[(c - 1) % p][1] if (periodic or c > 0) else 0, recv[(c + 1) % p][0] if (periodic or c < p - 1) else 0)
        for c in range(p)
    ]
    return recv, send


def _reference(full, dim, start, stop, lo, hi, periodic):
    n = full.size(dim)
    idx = torch.arange(start - lo, stop + hi)
    if periodic:
        return full.index_select(dim, idx % n)
    inside = (idx >= 0) & (idx < n)
    out = full.index_select(dim, idx.clamp(0, max(n - 1, 0)))
    shape = [1] * full.dim()
    shape[dim] = -1
    return out * inside.view(shape).to(full.dtype)


def _adjoint_cases(rank, world, mesh_shape, seed, count, backend="auto"):
    if backend == "triton":  # the Triton pack kernels inside a real exchange (interpreted on CPU)
        import triton  # noqa: F401 - the test extra installs it: a missing one fails, never skips

        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["TPLAYERS_HALO_BACKEND"] = "triton"
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    rng = random.Random(seed)
    for case in range(count):
        dims = (2,) if mesh.ndim == 1 else (2, 3)
        if mesh.ndim == 1 and rng.random() < 0.5:
            dims = (3,)
        periodic = [rng.random() < 0.5 for _ in dims]
        layout = []
        for i in range(mesh.ndim):
            sizes = _random_sizes(rng, mesh.size(i), 1)
            layout.append((sizes,) + _random_widths(rng, sizes, periodic[i]))
        shape = [rng.randint(1, 2), rng.randint(1, 3), 5, 4]
        for i, d in enumerate(dims):
            shape[d] = sum(layout[i][0])
        torch.manual_seed(seed * 1000 + case)
        full = torch.randn(shape, dtype=torch.float64)
        if rng.random() < 0.3:
            full = full.to(memory_format=torch.channels_last)
        local, ref = full, full
        recv, send = [], []
        for i, d in enumerate(dims):
            sizes, rw, sw = layout[i]
            start = offsets_from_sizes(sizes)[coords[i]]
            stop = start + sizes[coords[i]]
            local = local.narrow(d, start, stop - start)
            lo, hi = rw[coords[i]]
            ref = _reference(ref, d, start, stop, lo, hi, periodic[i])
            recv.append(rw[coords[i]])
            send.append(sw[coords[i]])
        x = local.detach().clone().requires_grad_(True)
        with tplayers.count_collectives() as log:
            y = halo_exchange(x, mesh, dims, recv, send, periodic)
        assert torch.equal(y, ref), (case, y.shape, ref.shape)
        # bytes sent equal exactly the rows this rank's neighbours asked for
        expect = 0
        for i, d in enumerate(dims):
            if mesh.size(i) == 1:
                continue
            row = local.numel() // local.size(d)
            if i == 1:  # the second exchange runs on the tensor already padded along dims[0]
                row = row // local.size(dims[0]) * y.size(dims[0])
            c, p = coords[i], mesh.size(i)
            lo_ok, hi_ok = periodic[i] or c > 0, periodic[i] or c < p - 1
            expect += row * (send[i][0] * lo_ok + send[i][1] * hi_ok) * 8
        assert log.bytes("send") == expect, (log.bytes("send"), expect)
        cot = torch.randn_like(y)
        y.backward(cot)
        lhs = torch.tensor([(y.detach() * cot).sum().item()], dtype=torch.float64)
        rhs = torch.tensor([(x.detach() * x.grad).sum().item()], dtype=torch.float64)
        dist.all_reduce(lhs)
        dist.all_reduce(rhs)
        torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)
    if backend == "triton":
        import tplayers.ops.halo as front

        assert front._TRITON not in (None, False)  # the kernels really ran
    return True


@pytest.mark.parametrize("world,mesh_shape", [(1, (1,)), (2, (2,)), (3, (3,)), (4, (2, 2))])
def test_halo_forward_and_adjoint(world, mesh_shape):
    run_ranks(_adjoint_cases, world, args=(mesh_shape, 11 + world, 12), timeout=60)


def test_halo_with_triton_pack_kernels():
    run_ranks(_adjoint_cases, 4, args=((2, 2), 5, 3, "triton"), timeout=90)


def _p2p_paths(rank, world):
    """exchange_p2p: the direct (gloo group) and the batched path move the same bytes, peers named
    by their rank in a subgroup; halo_route resolves the neighbours the exchange uses."""
    from tplayers.comm.collectives import exchange_p2p, posts_direct
    from tplayers.comm.halo import halo_pad, halo_state
    from tplayers.comm.halo_route import halo_route

    mesh = DeviceMesh("cpu", torch.arange(world).reshape(2, world // 2))
    group = mesh.get_group(1)  # ranks {0, 1} and {2, 3}: group ranks differ from global ranks
    me, size = dist.get_rank(group), dist.get_world_size(group)
    assert posts_direct(group)  # gloo
    for direct in (True, False):
        ran = []
        mine = torch.full((5,), float(10 * rank + direct), dtype=torch.float64)
        got = torch.empty(5, dtype=torch.float64)
        exchange_p2p(
            group, [(mine, (me + 1) % size, 7)], [(got, (me - 1) % size, 7)], direct, during=lambda: ran.append(True)
        )
        src = dist.get_global_rank(group, (me - 1) % size)
        assert ran == [True] and torch.equal(got, torch.full((5,), float(10 * src + direct), dtype=torch.float64))
    for periodic in (False, True):
        route = halo_route(group, periodic)
        if periodic:
            want = ((me - 1) % size, (me + 1) % size)
        else:
            want = (me - 1 if me > 0 else None, me + 1 if me < size - 1 else None)
        assert route.local == want and route.size == size and route.direct, (route, want)
        assert route.peers == tuple(None if w is None else dist.get_global_rank(group, w) for w in want)
        x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
        a, sa = halo_pad(x, 2, group, (1, 1), (1, 1), periodic)
        b, sb = halo_pad(x, 2, group, (1, 1), (1, 1), periodic, route=route)
        assert torch.equal(a, b) and sa == sb and sa.resolved() == route
        assert halo_state(x, 2, group, (1, 1), (1, 1), periodic) == sb


def test_exchange_p2p_direct_and_batched_paths():
    run_ranks(_p2p_paths, 4, timeout=60)
