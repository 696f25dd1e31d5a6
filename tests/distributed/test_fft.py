"""tplayers.functional.fft: every torch.fft transform over sharded dims against the serial torch.fft, in fp64:
outputs (this rank's exact slice), input gradients (complex autograd), norm modes, signal sizes, odd and
uneven partitions, the spectrum's sharding, 1-D meshes at 2 and 3 ranks and a 2x2 mesh; errors on every rank."""

import random

import pytest
import torch
from harness import raised, run_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.functional import fft as dfft
from tplayers.sharding import offsets_from_sizes, shard_sizes

ONE_D = ("fft", "ifft", "rfft", "irfft")
NAMES = ONE_D + ("fft2", "ifft2", "rfft2", "irfft2", "fftn", "ifftn", "rfftn", "irfftn")
TOL = dict(rtol=1e-10, atol=1e-11)


def _rand(shape, seed, complex_):
    g = torch.Generator().manual_seed(seed)
    re = torch.randn(shape, dtype=torch.float64, generator=g)
    return torch.complex(re, torch.randn(shape, dtype=torch.float64, generator=g)) if complex_ else re


def _slice(full, dims, sizes, coords):
    for d, sz, c in zip(dims, sizes, coords):
        full = full.narrow(d, offsets_from_sizes(sz)[c], sz[c])
    return full


def _case(name, full, mesh, src, src_sizes, dst, kwargs, seed):
    """Check one call against the serial transform: values, the output partition, the input gradient."""
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    serial_in = full.clone().requires_grad_(True)
    serial = getattr(torch.fft, name)(serial_in, **kwargs)
    x = _slice(full, src, src_sizes, coords).clone().requires_grad_(True)
    sd = src[0] if mesh.ndim == 1 else src
    out_arg = None if dst is None else (dst[0] if mesh.ndim == 1 else dst)
    y = getattr(dfft, name)(x, **kwargs, mesh=mesh, shard_dims=sd, out_shard_dims=out_arg)
    dst = src if dst is None else dst
    # the output partition: the input's where a dim keeps its sharding and length, else balanced
    out_sizes = [
        src_sizes[i] if d == src[i] and serial.size(d) == full.size(d) else shard_sizes(serial.size(d), mesh.size(i))
        for i, d in enumerate(dst)
    ]
    want = _slice(serial, dst, out_sizes, coords)
    assert y.shape == want.shape, (name, kwargs, src, dst, y.shape, want.shape)
    torch.testing.assert_close(y, want, **TOL)
    w = _rand(serial.shape, seed, serial.is_complex())
    (serial * w).real.sum().backward()
    (y * _slice(w, dst, out_sizes, coords)).real.sum().backward()
    torch.testing.assert_close(x.grad, _slice(serial_in.grad, src, src_sizes, coords), **TOL)


def _kwargs(rng, name, shape):
    """Random dims / sizes / norm for ``name`` on a tensor of ``shape``."""
    nd = len(shape)
    kw = {"norm": rng.choice([None, "backward", "ortho", "forward"])}
    if name in ONE_D:
        kw["dim"] = rng.randrange(nd) - nd * rng.randint(0, 1)
        if rng.random() < 0.3:
            kw["n"] = rng.randint(2, 9)
    else:
        k = 2 if name.endswith("2") else rng.randint(1, nd - 1)
        dims = rng.sample(range(nd), k) if rng.random() < 0.5 else list(range(nd - k, nd))
        if name.endswith("2") and rng.random() < 0.4:
            dims = [-2, -1]
        kw["dim"] = tuple(dims)
        if rng.random() < 0.3:
            kw["s"] = tuple(rng.randint(2, 9) for _ in dims)
    return kw


def _one_d(rank, world, seed):
    mesh = DeviceMesh("cpu", torch.arange(world))
    rng = random.Random(seed)
    for trial in range(40):
        name = NAMES[trial % len(NAMES)]
        nd = rng.choice([2, 3, 4])
        shape = [rng.randint(1, 8) for _ in range(nd)]
        kw = _kwargs(rng, name, shape)
        dims = [kw["dim"] % nd] if name in ONE_D else [d % nd for d in kw["dim"]]
        # the sharded dim: a transformed one most often; an arbitrary partition, empty shards included
        src = rng.choice(dims) if rng.random() < 0.8 else rng.randrange(nd)
        if len(dims) == nd and src in dims and nd == 1:
            continue
        sizes = [rng.randint(0, 4) for _ in range(world)]
        shape[src] = max(sum(sizes), 1)
        if sum(sizes) == 0:
            sizes[0] = 1
        if name.startswith("irfft") and kw.get("s") is None and kw.get("n") is None:
            shape[dims[-1]] = max(shape[dims[-1]], 2)  # irfft's default length 2 * (m - 1) needs m >= 2
            if dims[-1] == src:
                sizes = shard_sizes(shape[src], world)
        complex_ = name.startswith("irfft") or (not name.startswith("rfft") and rng.random() < 0.7)
        full = _rand(shape, seed + trial, complex_)
        dst = None if rng.random() < 0.6 else (rng.randrange(nd),)
        _case(name, full, mesh, (src,), [sizes], dst, kw, seed + 1000 + trial)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_fft_1d_mesh_random(world):
    run_ranks(_one_d, world, args=(11 * world,), timeout=120)


def _mesh_2x2(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    even = [shard_sizes(9, 2), shard_sizes(7, 2)]
    uneven = [[2, 7], [5, 2]]
    for name, complex_ in (("rfft2", False), ("irfft2", True), ("fft2", True), ("ifftn", True), ("fftn", False)):
        for sizes in (even, uneven):
            for norm in (None, "ortho", "forward"):
                full = _rand((2, 3, 9, 7), hash((name, norm)) % 1000, complex_)
                kw = {"norm": norm}
                if name == "fftn":
                    kw["dim"] = (1, 2, 3)
                _case(name, full, mesh, (2, 3), sizes, None, kw, 7)
    # the spectrum left where the transform put it, and back
    full = _rand((2, 3, 9, 7), 3, False)
    _case("rfft2", full, mesh, (2, 3), even, (3, 1), {"norm": "ortho"}, 5)
    _case("rfftn", _rand((2, 4, 6, 5), 4, False), mesh, (1, 2), [[2, 2], [3, 3]], None, {"dim": (1, 2, 3)}, 6)
    return True


def test_fft_2x2_mesh():
    run_ranks(_mesh_2x2, 4, timeout=120)


def _slab(rank, world):
    """An H-sharded image: the spectrum sharded along H by default (two all-to-alls), along the W modes with
    out_shard_dims (one), and irfft2 of that back to H-sharded (one); the bytes of one are the minimum."""
    mesh = DeviceMesh("cpu", torch.arange(world))
    full = _rand((2, 3, 10, 9), 1, False)
    x = tplayers.shard(full, 2, mesh).requires_grad_(True)
    with tplayers.count_collectives() as log:
        y = dfft.rfft2(x, mesh=mesh)
    assert log.count("all_to_all") == 2 and log.count() == 3  # the agreement, out and back
    torch.testing.assert_close(tplayers.gather(y, 2, mesh), torch.fft.rfft2(full), **TOL)
    with tplayers.count_collectives() as log:
        modes = dfft.rfft2(x, mesh=mesh, shard_dims=2, out_shard_dims=3)
    assert log.count("all_to_all") == 1
    rows = shard_sizes(10, world)[rank]
    # complex128 modes leaving this rank, once each: the minimum
    assert log.bytes("all_to_all") == 2 * 3 * rows * (5 - shard_sizes(5, world)[rank]) * 16
    torch.testing.assert_close(tplayers.gather(modes, 3, mesh), torch.fft.rfft2(full), **TOL)
    with tplayers.count_collectives() as log:
        back = dfft.irfft2(modes, s=(10, 9), mesh=mesh, shard_dims=3, out_shard_dims=2)
        back.sum().backward()
    assert log.count("all_to_all") == 3  # irfft2 forward; its backward, then rfft2's
    torch.testing.assert_close(back, x, **TOL)
    return True


def test_fft_slab_sharding_and_bytes():
    run_ranks(_slab, 2, timeout=60)


def _errors(rank, world):
    mesh = DeviceMesh("cpu", torch.arange(world))
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    out = [
        raised(lambda: dfft.rfft2(x, norm="ortho" if rank else "forward", mesh=mesh)),
        raised(lambda: dfft.rfft2(x.to(torch.complex128), mesh=mesh)),
        raised(lambda: dfft.fft(torch.randn(5 + rank), mesh=mesh, shard_dims=0)),
        raised(lambda: dfft.fft2(x, norm="bad", mesh=mesh)),
        raised(lambda: dfft.fftn(x, s=(3, 3), dim=(1, 2, 3), mesh=mesh)),
        raised(lambda: dfft.rfft2(x if rank else x[..., :5], mesh=mesh)),
    ]
    y = dfft.rfft2(x, mesh=mesh)  # the ranks still work together
    assert y.shape == (2, 3, 4, 4)
    return out


def test_fft_errors_on_every_rank():
    for rank, out in enumerate(run_ranks(_errors, 2, timeout=60)):
        assert out[0][0] == "ValueError" and "norm differs" in out[0][1]
        assert out[1][0] == "TypeError" and "real input" in out[1][1]
        assert out[2][0] == "ValueError" and "no dim to pass" in out[2][1]
        assert out[3][0] == "ValueError" and "norm must be one of" in out[3][1]
        assert out[4][0] == "ValueError" and "one size per transformed dim" in out[4][1]
        assert out[5][0] == "ValueError" and "other dims differs" in out[5][1]


def _docstrings(rank, world):
    import textwrap

    import tplayers.comm.all_to_all as rep
    import tplayers.domain.moves as moves
    import tplayers.functional.spectral as spectral

    count = 0
    for obj in (rep.repartition, rep, moves, dfft, spectral):
        doc = obj.__doc__
        start = doc.index("::\n", doc.index("Example")) + 3
        code = textwrap.dedent(doc[start:].split("\n\n\n")[0].split('"""')[0])
        exec(compile(code, f"<{getattr(obj, '__name__', obj)} example>", "exec"), {})
        count += 1
    return count


@pytest.mark.parametrize("world", [1, 2, 3])
def test_docstring_examples_run(world):
    assert run_ranks(_docstrings, world, timeout=60) == [5] * world


def _mesh_2x2_random(rank, world, seed):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    rng = random.Random(seed)
    for trial in range(16):
        name = NAMES[(trial + seed) % len(NAMES)]
        nd = rng.choice([3, 4])
        shape = [rng.randint(1, 6) for _ in range(nd)]
        kw = _kwargs(rng, name, shape)
        dims = [kw["dim"] % nd] if name in ONE_D else [d % nd for d in kw["dim"]]
        src = tuple(rng.sample(range(nd), 2))
        if set(range(nd)) <= set(dims) | set(src) and len(dims) == nd:
            continue  # every dim transformed and two of them sharded: may have nowhere to go (tested apart)
        sizes = [[rng.randint(0, 3) for _ in range(2)] for _ in range(2)]
        for i in range(2):
            if sum(sizes[i]) == 0:
                sizes[i][0] = 1
            shape[src[i]] = sum(sizes[i])
        if name.startswith("irfft") and kw.get("s") is None and kw.get("n") is None and shape[dims[-1]] < 2:
            shape[dims[-1]] = 2
            if dims[-1] in src:
                sizes[src.index(dims[-1])] = [1, 1]
        complex_ = name.startswith("irfft") or (not name.startswith("rfft") and rng.random() < 0.7)
        full = _rand(shape, seed + trial, complex_)
        dst = None if rng.random() < 0.6 else tuple(rng.sample(range(nd), 2))
        _case(name, full, mesh, src, sizes, dst, kw, seed + 500 + trial)
    return True


def test_fft_2x2_mesh_random():
    run_ranks(_mesh_2x2_random, 4, args=(3,), timeout=120)


def _shifts(rank, world, seed):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape((2, 2) if world == 4 else (world,)))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    rng = random.Random(seed)
    for trial in range(12):
        nd = rng.choice([3, 4])
        src = tuple(rng.sample(range(nd), mesh.ndim))
        sizes = [[rng.randint(0, 4) for _ in range(mesh.size(i))] for i in range(mesh.ndim)]
        shape = [rng.randint(1, 6) for _ in range(nd)]
        for i, d in enumerate(src):
            shape[d] = sum(sizes[i])
        dim = tuple(rng.sample(range(nd), rng.randint(1, nd - mesh.ndim)))
        name = rng.choice(["fftshift", "ifftshift"])
        full = _rand(shape, seed + trial, rng.random() < 0.5)
        xs = full.clone().requires_grad_(True)
        ref = getattr(torch.fft, name)(xs, dim=dim)
        x = _slice(full, src, sizes, coords).clone().requires_grad_(True)
        sd = src if mesh.ndim > 1 else src[0]
        y = getattr(dfft, name)(x, dim, mesh=mesh, shard_dims=sd)
        assert torch.equal(y, _slice(ref, src, sizes, coords)), (name, shape, src, dim)
        w = _rand(ref.shape, seed + 99, ref.is_complex())
        (ref * w).real.sum().backward()
        (y * _slice(w, src, sizes, coords)).real.sum().backward()
        assert torch.equal(x.grad, _slice(xs.grad, src, sizes, coords))
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fftshift_over_sharded_dims(world):
    run_ranks(_shifts, world, args=(world,), timeout=60)
