"""The GEMM-tiled kernel of neighborhood attention (issue 35, ``tplayers.ops.na_gemm``): its blocks
(whole tile rows, and one tile row cut into column ranges when a row does not fit), odd tiles,
padding slots, stride, dilation, causal, GQA, the bias table and queries of a shard given only the
keys they read, against the fp64 oracle (output and every gradient); the C kernel's unfused
backward runs it; the kernel switch and the dispatch rule."""

import random

import pytest
import torch
import torch._dynamo as dynamo
from na_cases import na_on_subwindow
from na_oracle import assert_out_and_grads, brute_na

from tplayers.ops import na_cpu, na_dispatch, na_gemm
from tplayers.ops.na_engine import neighborhood_attention

TIGHT = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few score elements: many blocks per call, rows cut into column ranges."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "gemm")
    monkeypatch.setattr(na_gemm, "CHUNK_SCORES", 900)
    monkeypatch.setattr(na_gemm, "BACKWARD_CHUNK_SCORES", 300)
    na_gemm.gemm_plan.cache_clear()
    yield
    na_gemm.gemm_plan.cache_clear()


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_small_blocks_odd_tiles_every_option_fp64(rank, small_blocks, monkeypatch):
    cuts = []
    real = na_gemm._blocks
    monkeypatch.setattr(na_gemm, "_blocks", lambda nh, nw, *a: cuts.append((nw, real(nh, nw, *a))) or cuts[-1][1])
    rng = random.Random(350 + rank)
    for _ in range(3):
        kernel = tuple(rng.randint(2, 4 if rank == 3 else 6) for _ in range(rank))
        stride = tuple(rng.choice([1, 1, kk]) for kk in kernel)
        dil = tuple(rng.choice([1, 2]) for _ in kernel)
        causal = tuple(rng.random() < 0.4 for _ in kernel)
        size = tuple(kk * d + rng.randint(0, 5) for kk, d in zip(kernel, dil))
        tile = tuple(rng.randint(1, 5) for _ in kernel)
        bias = all(s == 1 for s in stride)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q = torch.randn(2, *size, 4, 3, generator=gen, dtype=torch.float64)
        k = torch.randn(2, *size, 2, 3, generator=gen, dtype=torch.float64)
        v = torch.randn(2, *size, 2, 5, generator=gen, dtype=torch.float64)
        tensors = [q, k, v] + ([torch.randn(4, *(2 * kk - 1 for kk in kernel), generator=gen).double()] if bias else [])
        ins = [t.clone().requires_grad_() for t in tensors]
        ref_ins = [t.clone().requires_grad_() for t in tensors]
        out = neighborhood_attention(
            *ins[:3],
            kernel,
            dil,
            causal,
            stride=stride,
            scale=0.3,
            global_size=size,
            rel_pos_bias=ins[3] if bias else None,
            tile=tile,
        )
        ref = brute_na(*ref_ins[:3], kernel, stride, dil, causal, 0.3, rpb=ref_ins[3] if bias else None)
        where = f"kernel {kernel} stride {stride} dilation {dil} causal {causal} size {size} tile {tile}"
        assert_out_and_grads(out, ref, ins, ref_ins, gen, where, **TIGHT)
    assert any(len(blocks) > 1 for _, blocks in cuts), "every call ran one block"
    assert any(b1 - b0 < nw for nw, blocks in cuts for _, _, b0, b1 in blocks), "no row was cut into column ranges"


def test_blocks_cover_every_tile_once():
    for nh, nw, per_tile, limit in ((5, 7, 10, 35), (3, 4, 10, 1000), (2, 9, 50, 20), (1, 1, 5, 1)):
        seen = []
        for a0, a1, b0, b1 in na_gemm._blocks(nh, nw, per_tile, limit):
            seen += [(a, b) for a in range(a0, a1) for b in range(b0, b1)]
            assert (a1 - a0) * (b1 - b0) * per_tile <= max(limit, per_tile)
        assert sorted(seen) == [(a, b) for a in range(nh) for b in range(nw)]


def test_shard_queries_with_their_key_span_only(small_blocks):
    """A domain-parallel shard's call: queries of a sub-window, keys cut to the span they read."""
    gen = torch.Generator().manual_seed(3)
    size, kernel, dil, causal = (11, 13), (3, 5), (2, 1), (False, True)
    tensors = [torch.randn(1, *size, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    tensors.append(torch.randn(2, 5, 9, generator=gen, dtype=torch.float64))
    ins = [t.clone().requires_grad_() for t in tensors]
    ref_ins = [t.clone().requires_grad_() for t in tensors]
    out = na_on_subwindow(ins, size, kernel, dil, causal, (3, 9, 2, 11))
    ref = brute_na(*ref_ins[:3], kernel, (1, 1), dil, causal, rpb=ref_ins[3])[:, 3:9, 2:11]
    assert_out_and_grads(out, ref, ins, ref_ins, gen, "sub-window", **TIGHT)


def test_c_kernel_unfused_backward_runs_the_gemm_kernel(monkeypatch):
    """Wide column windows ((19 - 1) > 8 fp64 lanes on any ISA): the C forward pairs with the GEMM
    backward (same values as the oracle)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "")
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 4, 24, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    kernel = (3, 19)
    if not na_cpu.use_c_kernel(q, kernel):
        pytest.skip("the C kernel does not build here")
    calls = []
    real = na_cpu.gemm_backward
    monkeypatch.setattr(na_cpu, "gemm_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = neighborhood_attention(*ins, kernel, (1, 1), (False, False), global_size=(4, 24))
    ref = brute_na(*ref_ins, kernel, (1, 1), (1, 1), (False, False))
    assert_out_and_grads(out, ref, ins, ref_ins, gen, "k 3x19", **TIGHT)
    assert calls, "the unfused C backward did not run the GEMM kernel"


def test_dispatch_rule(monkeypatch):
    q = torch.randn(1, 5, 5, 1, 2)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "gemm")
    assert na_dispatch.choose_kernel(q, (3, 3)) == "gemm"
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")
    assert na_dispatch.choose_kernel(q, (3, 3)) == "torch"
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "")
    assert na_dispatch.choose_kernel(q, (1, 300)) == "torch"  # off the C kernel (kernel > 255): the tile kernel
    assert na_dispatch.choose_kernel(q, (1, 300), grouped=True) == "gemm"  # ... but GQA: the GEMM kernel
    assert na_dispatch.choose_kernel(q, (3, 3), grouped=True) == na_dispatch.choose_kernel(q, (3, 3))  # C first
    assert na_dispatch.default_tile((1, 7)) == (8, 16) and na_dispatch.default_tile((33,)) == (32,)
    assert na_dispatch.default_tile((5, 7, 7)) == (1, 4, 4)


def test_bf16_runs_and_tracks_fp64(monkeypatch):
    """Any dtype (the C kernel is fp32/fp64 only): bf16 close to the fp64 oracle."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "gemm")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 9, 10, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = neighborhood_attention(
        *(t.bfloat16() for t in (q, k, v)), (3, 5), (1, 1), (False, False), global_size=(9, 10)
    )
    ref = brute_na(q, k, v, (3, 5), (1, 1), (1, 1), (False, False))
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)


def test_compiled_grouped_heads_equal_eager(na_kernel):
    """``torch.compile(fullgraph=True)`` with GQA (4 query heads over 2 key heads): the registered
    op gets the grouped key/value heads (the GEMM kernel reads them as they are, the others expand
    them and fold their gradients back); output and every gradient bitwise eager's."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 7, 9, 4, 3, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 7, 9, 2, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    table = torch.randn(4, 5, 5, generator=gen, dtype=torch.float64)

    def f(q, k, v, rpb):
        return neighborhood_attention(q, k, v, (3, 3), (1, 2), (False, True), global_size=(7, 9), rel_pos_bias=rpb)

    dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    cot = torch.randn(2, 7, 9, 4, 3, generator=gen, dtype=torch.float64)
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, table)]
        out = fn(*leaves)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves, cot)))
    for name, a, b in zip(("out", "dq", "dk", "dv", "drpb"), *results):
        assert torch.equal(a, b), name
    ref = brute_na(q, k, v, (3, 3), (1, 1), (1, 2), (False, True), rpb=table)
    torch.testing.assert_close(results[0][0], ref, **TIGHT)
