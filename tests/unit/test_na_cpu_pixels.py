"""The C kernel's pixel routes (tplayers/ops/na_cpu_pix.h): where the head dims are whole vectors
the backward adds dK / dV on the user's layout (per key pixel its channels summed over the (query,
slot) pairs that read it, into a ring of pixel-major key rows streamed out as they leave; in place
where rows run in column chunks), and where the values (the keys) are 128 bytes a pixel or more in
a 2-D window the forward sums P V (the backward dQ = dS K) on their layout. Exact against the brute-force oracle in fp64 (every ISA build this host runs, so 8, 4 and 2
lanes), forward and every gradient, over random kernels, dilation, causal, stride, a query
sub-window, the bias table, batches and heads, 2-D and 3-D; the probe says which route is taken
there, and that none is where it does not apply (a head dim of part of a vector, rows in column
chunks)."""

import random

import pytest
import torch
from na_cases import isas_this_host_runs, na_on_subwindow
from na_oracle import assert_out_and_grads, at_thread_counts, brute_na, brute_na2d

import tplayers
from tplayers.ops import na_cpu
from tplayers.ops.na_geometry import Axis, geometry_args, kernel_dims, kernel_tables

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _probe(name, isa, size, kernel, dilation, causal, dim, dim_v, *extra):
    """Probe ``name`` of the ISA's fp64 build on one 2-head call's dims and window tables (then the
    ints ``extra``)."""
    geo = geometry_args([Axis(n, k, 1, d, int(c)) for n, k, d, c in zip(size, kernel, dilation, causal)], 1, 1)
    keep = (kernel_dims(geo, 1, 2, dim, dim_v), *kernel_tables(tuple(geo)))
    return getattr(na_cpu.load_library(torch.float64, isa), name)(*[na_cpu._ptr(t) for t in keep], *extra)


def _pixel_route(*call):
    """The probe (na_pixel_route) of one 2-head fp64 call on the ISA's build: 1 the backward's route,
    + 2 the forward's."""
    return _probe("na_pixel_route", *call)


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_dk_dv_on_the_users_layout_match_the_oracle_on_random_configurations(isa, monkeypatch):
    """2-D: kernels 3..9, dilation, causal per dim, sizes from the window's span to past two blocks,
    batch 1-2, heads 1-3, head dims of 1-2 vectors or 16 (the backward's dQ route where the window
    has no more rows than columns) and value dims of one vector or 16 (the forward's route there:
    the first two cases), the bias, whole
    images and query sub-windows (tiles that start mid-plane; key rows no tile reads get zero
    gradients); fp64 against the oracle, and dQ / dK / dV the same bits at 1 and 3 threads."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    lanes = na_cpu.lanes(torch.float64, isa)
    rng = random.Random(7100 + len(isa))
    for case in range(5):
        kernel = (rng.randint(3, 9), rng.randint(3, 9))
        if case < 2:
            kernel = tuple(sorted(kernel))
        dilation = tuple(rng.choice([1, 1, 2]) if kk <= 5 else 1 for kk in kernel)
        causal = (rng.random() < 0.3, rng.random() < 0.3)
        size = tuple(kk * d + rng.choice([0, 2, 5, 19]) for kk, d in zip(kernel, dilation))
        dim, dim_v = 16 if case % 2 else lanes * rng.randint(1, 2), 16 if case < 2 else rng.choice([lanes, 16])
        batch, heads = rng.randint(1, 2), rng.randint(1, 3)
        where = f"{isa} kernel {kernel} dilation {dilation} causal {causal} size {size} d {dim}/{dim_v}"
        forward, dq = (d == 16 and kernel[0] <= kernel[1] for d in (dim_v, dim))  # 128 bytes a pixel (fp64)
        assert _pixel_route(isa, size, kernel, dilation, causal, dim, dim_v) == 1 + 2 * forward + 4 * dq, where
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q, k = (torch.randn(batch, *size, heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(batch, *size, heads, dim_v, generator=gen, dtype=torch.float64)
        rpb = torch.randn(heads, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])
        if case % 2:
            box = (0, size[0], 0, size[1])
        else:
            box = (*sorted(rng.sample(range(size[0] + 1), 2)), *sorted(rng.sample(range(size[1] + 1), 2)))
        q0, q1, c0, c1 = box
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = na_on_subwindow(ins, size, kernel, dilation, causal, box)
        assert_out_and_grads(out, ref[:, q0:q1, c0:c1], ins, ref_in, gen, f"{where} box {box}", **TIGHT)
        if case == 1:
            cot = torch.randn(out.shape, generator=gen, dtype=torch.float64)

            def run():
                got = [t.detach().clone().requires_grad_() for t in (q, k, v, rpb)]
                o = na_on_subwindow(got, size, kernel, dilation, causal, box)
                (o * cot).sum().backward()
                return [t.grad for t in got]

            one, three = at_thread_counts(run)
            for a, b in zip(one[:3], three[:3]):  # the bias: per-thread sums added (close, not equal)
                assert torch.equal(a, b), where
            torch.testing.assert_close(one[3], three[3], **TIGHT)


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_dk_dv_on_the_users_layout_in_3d_match_the_oracle(isa, monkeypatch):
    """3-D (its flattened rows: a key row read at many slots of a tile) with dilation and causal
    depth, fp64 against the oracle, every gradient."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    lanes = na_cpu.lanes(torch.float64, isa)
    size, kernel, dilation, causal = (6, 7, 9), (3, 3, 5), (2, 1, 1), (True, False, False)
    assert _pixel_route(isa, size, kernel, dilation, causal, 2 * lanes, lanes) == 1  # 9 rows of 5: no forward
    gen = torch.Generator().manual_seed(31)
    q, k = (torch.randn(2, *size, 2, 2 * lanes, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, *size, 2, lanes, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = brute_na(*ref_in, kernel, dilation=dilation, causal=causal)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = tplayers.na3d(*ins, kernel, dilation=dilation, is_causal=causal)
    assert_out_and_grads(out, ref, ins, ref_in, gen, f"{isa} 3-D", **TIGHT)


def test_the_route_is_not_taken_where_it_does_not_apply(monkeypatch):
    """A head dim of part of a vector, or a value dim of part of one, keep the transposed dK / dV (rows
    cut into column chunks take the route, in place), and values of under 128 bytes a pixel, a window
    of more rows than columns (except on AVX2, where 3-D's flattened rows measured faster on the
    route) or rows in column chunks the transposed forward (test_na_cpu and test_na_cpu_tiles check
    those against the oracle)."""
    monkeypatch.setenv("TPLAYERS_NA_L2", str(1 << 19))  # the chunks of a 512 KiB L2 on any host
    isa = na_cpu.target_isa()
    lanes = na_cpu.lanes(torch.float64, isa)
    plain = ((12, 20), (5, 5), (1, 1), (False, False))
    assert _pixel_route(isa, *plain, lanes, 16) == 3
    assert _pixel_route(isa, *plain, lanes, 8) == (1 if 8 % lanes == 0 else 0)
    assert _pixel_route(isa, (12, 20), (5, 3), (1, 1), (False, False), lanes, 16) == (3 if isa == "avx2" else 1)
    assert _pixel_route(isa, *plain, lanes + 1, 16) == 2
    assert _pixel_route(isa, *plain, lanes, lanes // 2) == 0
    long = ((3, 3000), (3, 33), (1, 1), (False, False))
    assert _chunks(isa, *long, lanes, 16) > 1
    assert _pixel_route(isa, *long, lanes, 16) == 1  # dK / dV in place; the forward keeps its planes
    assert _pixel_route(isa, *long, lanes, lanes // 2) == 0


def _chunks(*call):
    """Column chunks of the backward plan of one 2-head fp64 call (na_chunks)."""
    return _probe("na_chunks", *call, 1)


def _ring(*call):
    """Rows of the key planes' ring of the same plan (na_ring_rows): below the height, slots are not rows."""
    return _probe("na_ring_rows", *call, 1)


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_rows_in_column_chunks_add_dk_dv_in_place(isa, monkeypatch):
    """Rows cut into column chunks (keys past the cache budget) add dK / dV on the user's layout in
    place, each key column zeroed before the first chunk reaching it: 2-D with dilation, causal rows,
    the bias and a query sub-window (columns no query reads get zero gradients), and planes taller
    than the ring of key rows (a tile's key rows are ring slots; the in-place adds need the rows
    themselves: every gradient was wrong on a 512 KiB-L2 host, whose 2-D backward runs in chunks),
    fp64 against the oracle, every gradient, and dQ / dK / dV the same bits at 1 and 3 threads."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    monkeypatch.setenv("TPLAYERS_NA_L2", str(1 << 19))  # the chunks of a 512 KiB L2 on any host
    lanes = na_cpu.lanes(torch.float64, isa)
    for size, kernel, dilation, causal, box in (
        ((3, 400), (3, 33), (1, 1), (False, False), (0, 3, 0, 400)),
        ((4, 500), (3, 21), (1, 2), (True, False), (1, 4, 37, 451)),
        ((12, 120), (5, 9), (1, 1), (False, False), (1, 11, 5, 115)),
    ):
        where = f"{isa} size {size} kernel {kernel} dilation {dilation} causal {causal} box {box}"
        assert _chunks(isa, size, kernel, dilation, causal, lanes, 16) > 1, where
        if size[0] > 10:
            assert _ring(isa, size, kernel, dilation, causal, lanes, 16) < size[0], where
        assert _pixel_route(isa, size, kernel, dilation, causal, lanes, 16) & 1, where  # the backward's
        gen = torch.Generator().manual_seed(size[1])
        q, k = (torch.randn(2, *size, 2, lanes, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(2, *size, 2, 16, generator=gen, dtype=torch.float64)
        rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])
        q0, q1, c0, c1 = box
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = na_on_subwindow(ins, size, kernel, dilation, causal, box)
        assert_out_and_grads(out, ref[:, q0:q1, c0:c1], ins, ref_in, gen, where, **TIGHT)

        def run():
            got = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
            na_on_subwindow(got, size, kernel, dilation, causal, box).sum().backward()
            return [t.grad for t in got[:3]]  # the bias: per-thread sums added (close, not equal)

        one, three = at_thread_counts(run)
        assert all(torch.equal(a, b) for a, b in zip(one, three)), where


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_both_routes_with_stride_match_the_oracle(isa, monkeypatch):
    """NATTEN's stride (each query reads the window of the strided query at or before it) on both
    pixel routes: 2-D, stride up to the kernel per dim, with dilation and causal, fp64 against the
    oracle, every gradient."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    lanes = na_cpu.lanes(torch.float64, isa)
    rng = random.Random(7300 + len(isa))
    for _ in range(3):
        kernel = tuple(sorted((rng.randint(3, 7), rng.randint(3, 7))))
        stride = tuple(rng.randint(1, kk) for kk in kernel)
        dilation = tuple(rng.choice([1, 2]) for _ in kernel)
        causal = (rng.random() < 0.4, rng.random() < 0.4)
        size = tuple(kk * d + rng.choice([1, 4, 13]) for kk, d in zip(kernel, dilation))
        where = f"{isa} kernel {kernel} stride {stride} dilation {dilation} causal {causal} size {size}"
        assert _pixel_route(isa, size, kernel, dilation, causal, lanes, 16) == 3, where
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q, k = (torch.randn(2, *size, 2, lanes, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(2, *size, 2, 16, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = brute_na(*ref_in, kernel, stride=stride, dilation=dilation, causal=causal)
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = tplayers.na2d(*ins, kernel, stride=stride, dilation=dilation, is_causal=causal)
        assert_out_and_grads(out, ref, ins, ref_in, gen, where, **TIGHT)


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_affine_blocks_of_the_forward_route_match_the_oracle(isa, monkeypatch):
    """The forward's P V (and the backward's dQ) on the user's layout over blocks whose lanes are
    their own queries and whose slots are consecutive key columns (pxa_kern: several queries sharing
    each value load, the pairs from lane and slot; at the borders, groups of lanes sharing one window,
    and with AVX2 every full block, its border groups' windows starting one column apart or at one):
    kernels 3, 5 and 7 wide (each compiled apart), head dims of 2 and 4 vectors where the build has
    them, a causal row or column axis and the bias; the probe counts the blocks it takes; fp64
    against the oracle, forward and every gradient."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    lanes = na_cpu.lanes(torch.float64, isa)
    lib = na_cpu.load_library(torch.float64, isa)
    size = (9, 4 * lanes + 5)  # at least blocks 1..3 of each row interior for kernels up to 7
    for kernel, causal, dim in (
        ((3, 7), (False, False), 16),
        ((5, 5), (True, False), 32),
        ((3, 3), (False, False), 16),
        ((7, 7), (False, True), 16),
    ):
        geo = geometry_args([Axis(n, k, 1, 1, int(c)) for n, k, c in zip(size, kernel, causal)], 1, 1)
        keep = (kernel_dims(geo, 1, 2, dim, dim), *kernel_tables(tuple(geo)))
        blocks = lib.na_pixel_affine(*[na_cpu._ptr(t) for t in keep])
        taken = dim // lanes in (2, 4)  # the channel vectors pxa_kern is compiled for
        assert (blocks >= 3) if taken else (blocks == 0), f"{isa} kernel {kernel} d {dim}: {blocks} affine blocks"
        if taken and na_cpu.lanes(torch.float32, isa) == 8:  # AVX2: border groups too (every pattern)
            assert blocks == size[1] // lanes, f"{isa} kernel {kernel}: {blocks} of {size[1] // lanes} blocks"
        gen = torch.Generator().manual_seed(dim + kernel[1])
        q, k, v = (torch.randn(2, *size, 2, dim, generator=gen, dtype=torch.float64) for _ in range(3))
        rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = tplayers.na2d(*ins[:3], kernel, is_causal=causal, rel_pos_bias=ins[3])
        ref = brute_na2d(*ref_in[:3], kernel, (1, 1), causal, rpb=ref_in[3])
        assert_out_and_grads(out, ref, ins, ref_in, gen, f"{isa} kernel {kernel} d {dim}", **TIGHT)


def test_fp32_128_byte_pixels_take_every_route_and_match_the_oracle(monkeypatch):
    """fp32 head dims of 32 (128-byte pixels, the 2-D benchmark's): the backward's dK / dV and dQ and
    the forward's P V all on the user's layout (the probe on the fp32 build says so), with dilation,
    a causal axis and the bias, against the fp64 oracle; the same bits at 1 and 3 threads."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    monkeypatch.setenv("TPLAYERS_NA_L2", str(2 << 20))  # rows in one chunk (a 512 KiB L2 cuts the backward's)
    size, kernel, dilation, causal = (20, 37), (5, 7), (1, 2), (False, True)
    geo = geometry_args([Axis(n, k, 1, d, int(c)) for n, k, d, c in zip(size, kernel, dilation, causal)], 1, 1)
    keep = (kernel_dims(geo, 1, 2, 32, 32), *kernel_tables(tuple(geo)))
    lib = na_cpu.load_library(torch.float32)
    assert lib.na_pixel_route(*[na_cpu._ptr(t) for t in keep]) == 7  # 32 fp32: whole vectors on every ISA
    gen = torch.Generator().manual_seed(21)
    base = [torch.randn(2, *size, 2, 32, generator=gen, dtype=torch.float64) for _ in range(3)]
    rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
    cot = torch.randn(2, *size, 2, 32, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (*base, rpb)]
    brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3]).backward(cot)

    def run():
        ins = [t.float().requires_grad_() for t in (*base, rpb)]
        out = tplayers.na2d(*ins[:3], kernel, dilation=dilation, is_causal=causal, rel_pos_bias=ins[3])
        out.backward(cot.float())
        return [t.grad for t in ins]

    one, three = at_thread_counts(run)
    assert all(torch.equal(a, b) for a, b in zip(one[:3], three[:3]))
    for got, want in zip(one, ref_in):
        torch.testing.assert_close(got.double(), want.grad, rtol=1e-4, atol=1e-4)
