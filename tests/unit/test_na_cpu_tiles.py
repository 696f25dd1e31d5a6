"""The C kernel's cache plan (tplayers/ops/na_cpu.c): rows whose keys do not fit the cache budget
run in column chunks (each chunk transposes its key span; the chunks' dK / dV overlap and add
up); blocks whose keys lie in one vector load it once per channel (Lanes.one), border blocks
permute within 16-byte groups (Lanes.mode 3); exact against
the brute-force oracle in fp64, forward and every gradient, with dilation, causal, bias and a
query sub-window, and each path is checked to be the one taken; the key planes are a ring of the
rows the tiles read (ring_rows); rows of whole KiB get a padded pitch."""

import random

import pytest
import torch
from na_cases import isas_this_host_runs, na_on_subwindow
from na_oracle import assert_out_and_grads, brute_na, brute_na2d

import tplayers
from tplayers.ops import na_cpu
from tplayers.ops.na_engine import neighborhood_attention
from tplayers.ops.na_geometry import Axis, geometry_args, kernel_dims, kernel_tables
from tplayers.ops.na_layout import key_span


def _plan_args(size, kernel, dilation, causal, dim=8, dim_v=8):
    """The C kernel's dims and window tables of one 2-head call, as pointers."""
    geo = geometry_args([Axis(n, k, 1, d, int(c)) for n, k, d, c in zip(size, kernel, dilation, causal)], 1, 1)
    tensors = (kernel_dims(geo, 1, 2, dim, dim_v), *kernel_tables(tuple(geo)))
    return tensors, [na_cpu._ptr(t) for t in tensors]  # the tensors keep the pointers valid


@pytest.fixture(autouse=True)
def _l2_of_512_kib(monkeypatch):
    """The plans of a 512 KiB L2 on every host (rows past a quarter of it in column chunks, whole
    rows up to half): the chunk counts these tests expect do not follow the host's cache."""
    monkeypatch.setenv("TPLAYERS_NA_L2", str(1 << 19))


def _chunks(size, kernel, dilation, causal, dim, dim_v, backward):
    _keep, args = _plan_args(size, kernel, dilation, causal, dim, dim_v)
    return na_cpu.load_library(torch.float64).na_chunks(*args, backward)


def _case(size, kernel, dilation, causal, dim, dim_v, box, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, *size, 2, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, *size, 2, dim_v, generator=gen, dtype=torch.float64)
    rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
    ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])
    ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
    out = na_on_subwindow(ins, size, kernel, dilation, causal, box)
    q0, q1, c0, c1 = box
    where = f"size {size} kernel {kernel} dilation {dilation} causal {causal} box {box}"
    assert_out_and_grads(out, ref[:, q0:q1, c0:c1], ins, ref_in, gen, where, rtol=1e-10, atol=1e-12)


def test_long_rows_run_in_chunks_and_match_the_oracle(monkeypatch):
    """1-D-like rows (one query row of 200 columns, head dims 128: 800 KiB of fp64 keys and
    queries, over the budget of any L2 below 3 MiB): several chunks forward and backward; a plain
    window, and dilation 3 with a causal window and a query sub-window."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    size, dim, dim_v = (1, 200), 128, 128
    for kernel, dilation, causal, box in (
        ((1, 7), (1, 1), (False, False), (0, 1, 0, 200)),
        ((1, 5), (1, 3), (False, True), (0, 1, 37, 171)),
    ):
        for backward in (0, 1):
            got = _chunks(size, kernel, dilation, causal, dim, dim_v, backward)
            assert got > 1, f"expected column chunks at {size} d{dim}, got {got}"
        for direct in ("0", ""):  # the planes' chunked forward, and the default (na_forward_1d where it applies)
            monkeypatch.setenv("TPLAYERS_NA_DIRECT", direct)
            _case(size, kernel, dilation, causal, dim, dim_v, box, seed=kernel[1])


def test_wide_2d_rows_run_in_chunks_and_match_the_oracle(monkeypatch):
    """2-D, a wide image (tiles of several rows, each chunk reading all key rows of its column
    span): dilation along the rows, causal columns, the bias and a row sub-window."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    size, kernel, dilation, causal, dim = (5, 60), (2, 5), (2, 1), (False, True), 128
    assert _chunks(size, kernel, dilation, causal, dim, dim, 1) > 1
    _case(size, kernel, dilation, causal, dim, dim, (1, 4, 0, 60), seed=5)


def test_rows_of_whole_kib_get_a_padded_pitch_and_match_the_oracle(monkeypatch):
    """Planes whose rows are a whole number of KiB (fp64: 128 columns) get one cache line more of
    pitch (their channel rows would share a few L1 sets); the others keep their width. Forward and
    every gradient exact on the padded planes: a plain window with head dims on and off the lanes,
    and dilation with a causal axis, the bias and a sub-window."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    monkeypatch.setenv("TPLAYERS_NA_L2", str(2 << 20))  # rows in one chunk (a 512 KiB L2 cuts them: other pitches)
    lib = na_cpu.load_library(torch.float64)
    line = 64 // torch.float64.itemsize
    for width, want in ((128, 128 + line), (120, 120)):
        _keep, args = _plan_args((3, width), (3, 7), (1, 1), (False, False))
        for backward in (0, 1):
            assert [lib.na_pitch(*args, backward, which) for which in (0, 1)] == [want, want], (width, backward)
    for kernel, dilation, causal, box, dims in (
        ((3, 7), (1, 1), (False, False), (0, 3, 0, 128), (8, na_cpu.lanes(torch.float64) + 3)),
        ((2, 5), (1, 3), (True, False), (1, 3, 9, 120), (8,)),
    ):
        for dim in dims:
            _case((3, 128), kernel, dilation, causal, dim, dim, box, seed=dim)


def test_wide_windows_on_long_rows_run_the_c_backward_and_match_the_oracle(monkeypatch):
    """Windows wider than two vectors ((kW - 1) * dW > lanes: not fused) on rows with an interior:
    with head dims off the lanes the C backward sums dK / dV key-centrically (its interior blocks)
    and per slot (its border blocks), with whole vectors it runs the 1-D line backward or the pixel
    route; every gradient exact against the oracle with dilation, causal, the bias and a query
    sub-window, and C_KERNELS pick the C backward there (backward_in_c says the GEMM kernel's on
    short rows; 1-D calls with whole-vector head dims run the C line backward even there:
    test_na_line_bwd)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    n = na_cpu.lanes(torch.float64)
    calls = []
    real = na_cpu.gemm_backward
    monkeypatch.setattr(na_cpu, "gemm_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    width = 6 * n + 40
    for size, kernel, dilation, causal, box in (
        ((1, width), (1, n + 9), (1, 1), (False, False), (0, 1, 0, width)),
        ((1, width), (1, n // 2 + 3), (1, 2), (False, True), (0, 1, 5, width - 3)),
        ((3, width), (3, n + 3), (1, 1), (False, False), (0, 3, 0, width)),
    ):
        geo = geometry_args([Axis(s, k, 1, d, int(c)) for s, k, d, c in zip(size, kernel, dilation, causal)], 1, 1)
        assert not na_cpu.backward_is_fused(geo, torch.float64) and na_cpu.backward_in_c(geo, torch.float64)
        for dim in (8, n + 3):  # whole vectors: the line backward / the pixel route; else the transposed sums
            _case(size, kernel, dilation, causal, dim, dim, box, seed=kernel[1])
    assert not calls, "the C backward applies on these rows"
    short = geometry_args([Axis(1, 1), Axis(2 * n, n + 9)], 1, 1)
    assert not na_cpu.backward_in_c(short, torch.float64)


def test_tiles_of_flattened_3d_rows_share_more_key_rows():
    """na3d's (depth, height) rows are flattened; a tile's rows are picked by the key rows they
    share (row_order), so the tiles' key rows (each loaded once per tile) number fewer than with
    consecutive rows (4 heights of one depth): 2125 instead of 2240 at 16^3 k5 with 4 rows per
    tile. Every row is in exactly one tile; 2-D rows keep their consecutive order."""
    lib = na_cpu.load_library(torch.float64)
    ptr = na_cpu._ptr

    def unions(size, kernel):
        geo = geometry_args([Axis(n, kernel, 1, 1, 0) for n in size], 1, 1)
        dims = kernel_dims(geo, 1, 2, 8, 8)
        rows, cols = kernel_tables(tuple(geo))
        got = torch.empty(int(dims[2]), dtype=torch.int32)
        mr = lib.na_row_order(ptr(dims), ptr(rows), ptr(cols), ptr(got))
        keys = rows[0].tolist()

        def total(order):
            return sum(len({r for i in order[t : t + mr] for r in keys[i]}) for t in range(0, len(order), mr))

        order = got.tolist()
        assert sorted(order) == list(range(len(order)))
        return order, total(order), total(list(range(len(order))))

    for size, kernel in (((16, 16, 16), 5), ((8, 8, 8), 3), ((12, 10, 6), 3)):
        _, greedy, consecutive = unions(size, kernel)
        assert greedy < consecutive, (size, kernel, greedy, consecutive)
    order, greedy, consecutive = unions((64, 64), 7)
    assert order == list(range(64)) and greedy == consecutive


def _fp32_case(size, kernel, dilation, dim, seed, where):
    """One 2-head fp32 call against the fp64 oracle: the output (tighter than the gradients), then
    every gradient."""
    gen = torch.Generator().manual_seed(seed)
    ref_in = [torch.randn(1, *size, 2, dim, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ins = [t.detach().float().requires_grad_() for t in ref_in]
    out, ref = tplayers.na2d(*ins, kernel, dilation=dilation), brute_na2d(*ref_in, kernel, dilation)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert_out_and_grads(out, ref, ins, ref_in, gen, where, rtol=1e-4, atol=1e-5)


def _block_kinds(size, kernel, dilation, causal, dtype=torch.float64, which=0, isa=None):
    """Blocks of a row whose keys lie in one vector (which 0) or that permute within groups (1)."""
    _keep, args = _plan_args(size, kernel, dilation, causal)
    return na_cpu.load_library(dtype, isa).na_block_kinds(*args, which)


def _one_blocks(size, kernel, dilation, causal, dtype=torch.float64):
    return _block_kinds(size, kernel, dilation, causal, dtype)


def test_rows_within_one_vector_load_it_once_and_match_the_oracle(monkeypatch):
    """Rows no wider than the vector (na3d's 16-wide rows with AVX-512): a block whose every slot
    reads keys within one vector loads it once per channel and shuffles each slot out of it
    (Lanes.one, on 32-register ISAs: AVX-512); the same keys as the shuffled loads, so exact in
    fp64: plain, dilated rows, causal with the bias; dilated columns (slots two columns apart) in
    fp64 where a row of its lanes holds the window and in fp32 against the fp64 oracle; a row 4
    vectors wide has no such block, nor has any row on a 16-register ISA (AVX2, where the shuffle
    masks spill)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    taken = na_cpu.lanes(torch.float32) >= 16  # 64-byte vectors: 32 registers

    def check(count, where):
        if taken:
            assert count >= 1, f"expected a one-vector block at {where}, got {count}"
        else:
            assert count == 0, f"expected no one-vector block with 16 registers at {where}, got {count}"

    lanes = na_cpu.lanes(torch.float64)
    width = max(lanes, 4)
    cases = [
        ((5, width), (3, 3), (1, 1), (False, False)),
        ((6, width), (3, 3), (2, 1), (False, True)),
        ((4, width), (3, 3), (1, 1), (True, False)),
    ]
    if width >= 6:  # dilated columns: kernel * dilation <= the row (fp64 has 4 lanes with AVX2)
        cases.append(((4, width), (3, 3), (1, 2), (False, False)))
    for size, kernel, dilation, causal in cases:
        check(_one_blocks(size, kernel, dilation, causal), f"{size} kernel {kernel} causal {causal}")
        _case(size, kernel, dilation, causal, 8, 8, (0, size[0], 0, size[1]), seed=size[0])
    assert _one_blocks((3, 4 * width), (3, 3), (1, 1), (False, False)) == 0
    size = (4, max(na_cpu.lanes(torch.float32), 6))
    check(_one_blocks(size, (3, 3), (1, 2), (False, False), torch.float32), f"fp32 {size}")
    _fp32_case(size, (3, 3), (1, 2), 8, 3, f"fp32 {size}")


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_border_blocks_permute_within_groups_and_match_the_oracle(isa, monkeypatch):
    """A window clamped at an image border repeats its neighbour's keys in a block's first or last
    lanes; with AVX2 the score and P.V kernels load such a block's keys from up to a group earlier
    and permute each lane's key within its 16-byte group (Lanes.mode 3; vpermps halved the score
    kernel's rate on Zen 3). Both ends of rows of whole blocks take it, fp32 with kernels 3-7 and
    fp64 with kernel 3 (not with AVX-512, nor fp64 kernel 5: its clamped lanes cross a group); exact
    in fp64 with the bias, causal and on a query sub-window, and fp32 against the fp64 oracle."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    avx2 = na_cpu.lanes(torch.float32, isa) == 8
    for dtype, kernel, want in (
        (torch.float32, 3, 2),
        (torch.float32, 7, 2),
        (torch.float64, 3, 2),
        (torch.float64, 5, 0),
    ):
        got = _block_kinds((5, 24), (3, kernel), (1, 1), (False, False), dtype, 1, isa)
        assert got == (want if avx2 else 0), f"{dtype} kernel {kernel} on {isa}: {got} in-group blocks"
    for size, kernel, causal, box in (
        ((6, 20), (3, 3), (False, False), (0, 6, 0, 20)),
        ((7, 19), (5, 7), (True, False), (1, 6, 0, 19)),
    ):
        _case(size, kernel, (1, 1), causal, 8, 16, box, seed=size[1])
    _fp32_case((9, 21), (3, 5), (1, 1), 16, 4, f"fp32 9x21 on {isa}")


def test_the_key_planes_are_a_ring_of_rows_and_match_the_oracle(monkeypatch):
    """Tall planes: forward and backward bring key rows in as their tiles reach them, into a ring
    of the rows one tile reads (fewer than the plane's; rows wrap around it several times per plane
    and head), and the backward writes a row's dK / dV out as it leaves; exact in fp64, output and
    every gradient: plain, dilated causal rows with the bias and a row sub-window (tiles that start
    mid-plane; key rows no tile reads get zero gradients), row dilation 3 (tiles of rows 3 apart,
    not in order) with causal columns, and column chunks; then gradients for q alone (the backward
    without dK / dV)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    lib = na_cpu.load_library(torch.float64)
    cases = (
        ((40, 12), (3, 3), (1, 1), (False, False), (0, 40, 0, 12), 8, 12),
        ((37, 9), (4, 3), (2, 1), (True, False), (5, 31, 0, 9), 8, 18),
        ((30, 11), (5, 2), (3, 2), (False, True), (0, 30, 2, 9), 8, 25),
        ((24, 60), (3, 5), (1, 1), (False, False), (0, 24, 0, 60), 128, 12),
    )
    for size, kernel, dilation, causal, box, dim, most in cases:
        _keep, args = _plan_args(size, kernel, dilation, causal, dim, dim)
        for backward in (0, 1, 2):
            ring = lib.na_ring_rows(*args, backward)
            assert ring <= most, f"expected a ring of at most {most} of {size[0]} key rows at {size}, got {ring}"
        if dim == 128:
            assert _chunks(size, kernel, dilation, causal, dim, dim, 0) > 1
            assert _chunks(size, kernel, dilation, causal, dim, dim, 1) > 1
        _case(size, kernel, dilation, causal, dim, dim, box, seed=size[0])
    size, kernel, dilation, causal = (37, 9), (4, 3), (2, 1), (True, False)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, *size, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    ref_q, got_q = q.clone().requires_grad_(), q.clone().requires_grad_()
    ref = brute_na2d(ref_q, k, v, kernel, dilation, causal)
    out = tplayers.na2d(got_q, k, v, kernel, dilation=dilation, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    cot = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * cot).sum().backward()
    (out * cot).sum().backward()
    torch.testing.assert_close(got_q.grad, ref_q.grad, rtol=1e-10, atol=1e-12)


def test_a_window_holding_one_key_row_at_two_slots_matches_the_oracle(monkeypatch):
    """Causal rows cut to a sub-window near the start (a domain-parallel shard's first rows): fewer
    key rows than the kernel, so a query row's masked slot is clamped onto a row another of its
    slots reads, and one key row serves two slots of one query row; plain and dilated, with the
    bias, fp64, output and every gradient (the tiles once grouped such rows wrongly); then random
    small sub-windows causal along either axis, and 3-D sub-windows (flattened rows)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    for size, kernel, dilation, box in (
        ((8, 12), (3, 3), (1, 1), (0, 2, 0, 12)),
        ((8, 12), (4, 3), (1, 1), (1, 3, 0, 12)),
        ((8, 12), (4, 3), (2, 1), (0, 6, 0, 12)),
        ((8, 20), (4, 9), (2, 1), (2, 5, 3, 17)),
    ):
        _case(size, kernel, dilation, (True, False), 8, 8, box, seed=box[1])
    rng = random.Random(35)
    for n in range(10):  # random small sub-windows, causal along either axis
        kernel, dilation = (rng.randint(2, 5), rng.randint(2, 5)), (rng.randint(1, 2), rng.randint(1, 2))
        size = tuple(k * d + rng.randint(0, 6) for k, d in zip(kernel, dilation))
        causal = (rng.random() < 0.7, rng.random() < 0.5)
        r0, r1 = sorted(rng.sample(range(size[0] + 1), 2))
        c0, c1 = sorted(rng.sample(range(size[1] + 1), 2))
        _case(size, kernel, dilation, causal, rng.choice([3, 8]), 8, (r0, r1, c0, c1), seed=n)
    for size, kernel, dilation, causal, box in (  # 3-D: the flattened rows hold the duplicates
        ((7, 7, 4), (3, 3, 3), (1, 1, 1), (True, False, False), ((0, 2), (4, 6), (1, 3))),
        ((7, 7, 5), (4, 2, 1), (1, 2, 1), (True, True, False), ((0, 3), (1, 5), (2, 3))),
    ):
        spans = [
            key_span(a, b, length=n, kernel=k, dilation=d, causal=c)
            for (a, b), n, k, d, c in zip(box, size, kernel, dilation, causal)
        ]
        gen = torch.Generator().manual_seed(size[2])
        q, k, v = (torch.randn(1, *size, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        qs = (slice(None),) + tuple(slice(a, b) for a, b in box)
        ks = (slice(None),) + tuple(slice(a, b) for a, b in spans)
        out = neighborhood_attention(
            ins[0][qs],
            ins[1][ks],
            ins[2][ks],
            kernel,
            dilation,
            causal,
            global_size=size,
            q_offset=tuple(a for a, _ in box),
            k_offset=tuple(a for a, _ in spans),
        )
        ref = brute_na(*ref_in, kernel, dilation=dilation, causal=causal)[qs]
        assert_out_and_grads(out, ref, ins, ref_in, gen, f"3-D {size} kernel {kernel} box {box}")


def test_the_planes_backward_never_reads_the_output(monkeypatch):
    """delta = rowsum(dO * O) of the backward comes from the window's P and dP = dO . V, which it
    computes anyway (softmax_delta in na_cpu_blocks.h), not from the forward's output: a NaN output
    passed to the C backward changes no gradient (bit for bit), fused 2-D blocks with a causal row
    and the bias, and a wide 1-D window, fp32 and fp64 (8 channels: the line backward where they are
    whole vectors, the planes backward's key-centric sums where not)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    n = na_cpu.lanes(torch.float64)
    for size, kernel, dilation, causal in (
        ((9, 21), (3, 5), (2, 1), (True, False)),
        ((1, 6 * n + 40), (1, n + 9), (1, 1), (False, False)),
    ):
        geo = geometry_args([Axis(s, k, 1, d, int(c)) for s, k, d, c in zip(size, kernel, dilation, causal)], 1, 1)
        for dtype in (torch.float64, torch.float32):
            assert na_cpu.backward_in_c(geo, dtype)
            gen = torch.Generator().manual_seed(3)
            q, k, v, dout = (torch.randn(2, size[0] * size[1], 2 * 8, generator=gen, dtype=dtype) for _ in range(4))
            table = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=dtype)
            out = na_cpu.c_forward(q, k, v, table, geo, 8**-0.5, 2)
            real = na_cpu.c_backward(dout, q, k, v, table, out, geo, 8**-0.5, 2)
            nan = na_cpu.c_backward(dout, q, k, v, table, torch.full_like(out, float("nan")), geo, 8**-0.5, 2)
            for name, a, b in zip(("dq", "dk", "dv", "dtable"), real, nan):
                assert torch.isfinite(a).all() and torch.equal(a, b), f"{name} {size} {kernel} {dtype}"


def test_a_large_output_is_streamed_past_the_caches_and_exact(monkeypatch):
    """An output of half the L2 or more (output_streamed in na_cpu_plan.h) is stored with streaming
    stores (AVX-512: a whole line each, no read of it first): the probe says the path is taken for
    an 8.6 MB output (any L2 up to 16 MiB) and not for a 4 KB one; the output equals the tile
    kernel's, fp64 to rounding and fp32 against it, with rows of 7.5 vectors (a last block of fewer
    queries) and borders."""
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    size, heads, dim = (140, 120), 4, 32
    for dtype in (torch.float64, torch.float32):
        lib = na_cpu.load_library(dtype)
        geo = geometry_args([Axis(n, 7, 1, 1, 0) for n in size], 1, 1)
        assert lib.na_output_streamed(na_cpu._ptr(kernel_dims(geo, 1, heads, dim, dim))) == 1, dtype
        tiny = geometry_args([Axis(8, 3, 1, 1, 0)] * 2, 1, 1)
        assert lib.na_output_streamed(na_cpu._ptr(kernel_dims(tiny, 1, 1, 16, 16))) == 0, dtype
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, *size, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")
    ref = tplayers.na2d(q, k, v, 7)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    torch.testing.assert_close(tplayers.na2d(q, k, v, 7), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tplayers.na2d(q.float(), k.float(), v.float(), 7).double(), ref, rtol=1e-5, atol=1e-5)
