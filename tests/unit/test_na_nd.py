"""tplayers.na1d / na2d / na3d (issue 22): NATTEN 0.21's semantics bit for bit against the
brute-force oracle (tests/na_oracle.py ``brute_na``: NATTEN's mask predicate evaluated pair by
pair) on random configurations (sizes, kernels, stride, dilation, causal per dim, GQA/MQA, the
bias table), on both CPU kernels, fp64: outputs and the gradients of q, k, v and the table; the
tile kernel's odd tiles and chunks; and every ValueError the front doors promise."""

import random

import pytest
import torch
from na_oracle import assert_out_and_grads, brute_na, brute_na2d, natten_mask_1d

import tplayers
from tplayers.ops.na_engine import neighborhood_attention
from tplayers.ops.na_layout import key_span, window_starts

TIGHT = dict(rtol=1e-10, atol=1e-12)
FUNCS = {1: tplayers.na1d, 2: tplayers.na2d, 3: tplayers.na3d}


def test_mask_oracle_matches_the_group_list_oracle():
    """The pair-predicate oracle equals the older group-list oracle (stride 1, with the bias)."""
    rng = random.Random(7)
    for _ in range(6):
        kernel = (rng.randint(1, 5), rng.randint(2, 5))
        dil = (rng.choice([1, 2]), rng.choice([1, 2, 3]))
        causal = (rng.random() < 0.4, rng.random() < 0.4)
        size = tuple(kk * d + rng.randint(0, 4) for kk, d in zip(kernel, dil))
        gen = torch.Generator().manual_seed(rng.randrange(1 << 20))
        q, k, v = (torch.randn(2, *size, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
        rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(
            brute_na(q, k, v, kernel, None, dil, causal, rpb=rpb),
            brute_na2d(q, k, v, kernel, dil, causal, rpb=rpb),
            **TIGHT,
        )


def test_window_starts_equal_the_mask_per_axis():
    """tplayers' window arithmetic (first, count) per axis equals NATTEN's predicate, for every
    length, kernel, stride <= kernel, dilation and causal flag up to small sizes."""
    for length in range(1, 13):
        for kernel in range(1, length + 1):
            for dil in range(1, length // kernel + 1):
                for stride in range(1, kernel + 1):
                    for causal in (False, True):
                        pos = torch.arange(length)
                        first, count = window_starts(pos, length, kernel, dil, causal, stride)
                        got = torch.zeros(length, length, dtype=torch.bool)
                        for x in range(length):
                            members = (x % dil) + dil * (first[x] + torch.arange(int(count[x])))
                            got[x, members] = True
                        expect = natten_mask_1d(length, kernel, stride, dil, causal)
                        assert torch.equal(got, expect), (length, kernel, stride, dil, causal)
                        lo, hi = key_span(
                            0, length, length=length, kernel=kernel, dilation=dil, causal=causal, stride=stride
                        )
                        cols = expect.any(0).nonzero()
                        assert (lo, hi) == (int(cols.min()), int(cols.max()) + 1)


def _random_case(rng, rank, gqa=True, bias=True):
    kernel = tuple(rng.randint(1, 5) if rank == 3 else rng.randint(2, 7) for _ in range(rank))
    stride = tuple(rng.choice([1, 1, kk, max(1, kk // 2), rng.randint(1, kk)]) for kk in kernel)
    dil = tuple(rng.choice([1, 1, 2]) if kk <= 4 else 1 for kk in kernel)
    causal = tuple(rng.random() < 0.35 for _ in range(rank))
    size = tuple(kk * d + rng.choice([0, 1, 3, 6] if rank == 3 else [0, 2, 5, 11, 19]) for kk, d in zip(kernel, dil))
    heads = rng.choice([1, 2, 4])
    kv_heads = rng.choice([h for h in (1, 2, 4) if heads % h == 0]) if gqa else heads
    with_bias = bias and all(s == 1 for s in stride) and rng.random() < 0.5
    return kernel, stride, dil, causal, size, heads, kv_heads, with_bias


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("seed", range(2))
def test_random_configurations_fp64(rank, seed, na_kernel):
    """Random sizes, kernels (even and odd), stride <= kernel, dilation, causal per dim, GQA/MQA,
    head_dim != value dim, the bias table at stride 1: output and every gradient equal the oracle's."""
    rng = random.Random(2200 + 10 * rank + seed)
    for case in range(3 if rank == 3 else 4):
        kernel, stride, dil, causal, size, heads, kv_heads, with_bias = _random_case(rng, rank)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        batch, dim, dim_v = rng.randint(1, 2), rng.randint(1, 6), rng.randint(1, 6)
        q = torch.randn(batch, *size, heads, dim, generator=gen, dtype=torch.float64)
        k = torch.randn(batch, *size, kv_heads, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(batch, *size, kv_heads, dim_v, generator=gen, dtype=torch.float64)
        tensors = [q, k, v]
        if with_bias:
            tensors.append(torch.randn(heads, *(2 * kk - 1 for kk in kernel), generator=gen, dtype=torch.float64))
        ins = [t.clone().requires_grad_() for t in tensors]
        ref_ins = [t.clone().requires_grad_() for t in tensors]
        scale = rng.choice([None, 0.37])
        out = FUNCS[rank](
            *ins[:3], kernel, dil, causal, scale, stride=stride, rel_pos_bias=ins[3] if with_bias else None
        )
        ref = brute_na(*ref_ins[:3], kernel, stride, dil, causal, scale, rpb=ref_ins[3] if with_bias else None)
        where = (
            f"rank {rank} kernel {kernel} stride {stride} dilation {dil} causal {causal} size {size} "
            f"heads {heads}/{kv_heads} bias {with_bias}"
        )
        assert_out_and_grads(out, ref, ins, ref_ins, gen, where, **TIGHT)


@pytest.mark.parametrize("rank", [2, 3])
def test_tile_kernel_any_tiles_and_chunks_with_stride(rank, monkeypatch):
    """The tile kernel with odd tile shapes and tiny chunks (tiles whose strided windows span more
    than t + k - 1 keys, many chunks, padding slots) equals the oracle."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")
    rng = random.Random(31 + rank)
    for _ in range(3):
        kernel, stride, dil, causal, size, heads, kv_heads, _ = _random_case(rng, rank, bias=False)
        tile = tuple(rng.randint(1, 5) for _ in range(rank))
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q = torch.randn(1, *size, heads, 3, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(1, *size, kv_heads, 3, generator=gen, dtype=torch.float64) for _ in range(2))
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = neighborhood_attention(
            *ins, kernel, dil, causal, stride=stride, global_size=size, tile=tile, chunk_scores=rng.choice([1, 50, 700])
        )
        ref = brute_na(*ref_ins, kernel, stride, dil, causal)
        assert_out_and_grads(
            out, ref, ins, ref_ins, gen, f"{kernel} {stride} {dil} {causal} {size} tile {tile}", **TIGHT
        )


def test_fp32_three_d_matches_fp64_oracle(na_kernel):
    """fp32 3-D (k 3x5x5, GQA 4/2) against the fp64 oracle, loosely: the C kernel's own exp."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 5, 7, 9, 4, 16, generator=gen)
    k, v = (torch.randn(1, 5, 7, 9, 2, 16, generator=gen) for _ in range(2))
    out = tplayers.na3d(q, k, v, (3, 5, 5), (1, 1, 1), (False, True, False), stride=(1, 2, 1))
    ref = brute_na(q.double(), k.double(), v.double(), (3, 5, 5), (1, 2, 1), None, (False, True, False))
    torch.testing.assert_close(out, ref.float(), rtol=2e-4, atol=2e-5)


def test_front_door_errors():
    q4, q5, q6 = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 8, 2, 4), torch.randn(1, 6, 6, 6, 2, 4)
    with pytest.raises(ValueError, match=r"na1d: q must be \(B, L, heads, head_dim\), got shape \(1, 8, 8, 2, 4\)"):
        tplayers.na1d(q5, q5, q5, 3)
    with pytest.raises(ValueError, match=r"na3d: q must be \(B, D, H, W, heads, head_dim\)"):
        tplayers.na3d(q5, q5, q5, 3)
    with pytest.raises(TypeError, match="na1d: k must be a torch.Tensor, got list"):
        tplayers.na1d(q4, [1], q4, 3)
    with pytest.raises(ValueError, match="kernel_size must be a positive int or a sequence of 3 of them, got"):
        tplayers.na3d(q6, q6, q6, (3, 3))
    with pytest.raises(
        ValueError, match="stride must be <= kernel_size along every dim: got stride 4 > kernel_size 3 along H"
    ):
        tplayers.na3d(q6, q6, q6, 3, stride=(1, 4, 1))
    with pytest.raises(ValueError, match="stride must be a positive int"):
        tplayers.na1d(q4, q4, q4, 3, stride=0)
    with pytest.raises(ValueError, match="is_causal must be a bool or a sequence of 3 of them"):
        tplayers.na3d(q6, q6, q6, 3, is_causal=(True, False))
    with pytest.raises(
        ValueError,
        match="na3d: kernel_size \\* dilation must be <= the input size along D: got "
        "kernel_size 3 \\* dilation 3 > D=6",
    ):
        tplayers.na3d(q6, q6, q6, 3, dilation=(3, 1, 1))
    kv3 = torch.randn(1, 8, 3, 4)
    with pytest.raises(
        ValueError,
        match="na1d: the key/value heads must divide the query heads \\(GQA/MQA\\), got 3 "
        "key/value heads for 2 query heads",
    ):
        tplayers.na1d(q4, kv3, kv3, 3)
    with pytest.raises(ValueError, match="na1d: k and v must agree"):
        tplayers.na1d(q4, q4, torch.randn(1, 8, 1, 4), 3)
    with pytest.raises(ValueError, match="na2d: q and k must have the same spatial size"):
        tplayers.na2d(q5, q5[:, :7], q5[:, :7], 3)
    with pytest.raises(
        ValueError,
        match=r"na2d: rel_pos_bias must have shape \(2, 5, 5\) \(heads, 2\*kernel_size - 1 "
        r"per dim\), got \(2, 5, 3\)",
    ):
        tplayers.na2d(q5, q5, q5, 3, rel_pos_bias=torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match=r"na2d: rel_pos_bias needs stride 1 along every dim, got stride \(2, 1\)"):
        tplayers.na2d(q5, q5, q5, 3, stride=(2, 1), rel_pos_bias=torch.randn(2, 5, 5))
    with pytest.raises(TypeError, match="na2d: rel_pos_bias must be a torch.Tensor or None, got list"):
        tplayers.na2d(q5, q5, q5, 3, rel_pos_bias=[1.0])
    with pytest.raises(ValueError, match="na3d: backend must be 'torch' or 'natten', got 'cuda'"):
        tplayers.na3d(q6, q6, q6, 3, backend="cuda")


def test_tile_span_windows_equal_the_global_ones():
    """Every query range's tile, seen as a whole image by NATTEN's predicate, gives those queries
    exactly their global windows (an independent check of tile_span with the oracle's mask)."""
    from tplayers.ops.na_layout import tile_span

    rng = random.Random(99)
    for _ in range(300):
        kernel = rng.randint(2, 6)
        dil, stride = rng.choice([1, 1, 2, 3]), rng.randint(1, kernel)
        length = kernel * dil + rng.randint(0, 20)
        causal = rng.random() < 0.4
        q0 = rng.randrange(length)
        q1 = rng.randint(q0 + 1, length)
        a, b = tile_span(q0, q1, length=length, kernel=kernel, dilation=dil, causal=causal, stride=stride)
        assert 0 <= a <= q0 and q1 <= b <= length and b - a >= kernel * dil
        full = natten_mask_1d(length, kernel, stride, dil, causal)[q0:q1]
        tile = natten_mask_1d(b - a, kernel, stride, dil, causal)[q0 - a : q1 - a]
        assert not full[:, :a].any() and not full[:, b:].any()
        assert torch.equal(full[:, a:b], tile), (length, kernel, stride, dil, causal, q0, q1, a, b)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_single_device_tile_path_equals_the_key_path(rank):
    """local_backend="tile" (the natten code path, tplayers kernel standing in) on one device."""
    cls = {1: tplayers.NeighborhoodAttention1d, 2: tplayers.NeighborhoodAttention, 3: tplayers.NeighborhoodAttention3d}[
        rank
    ]
    torch.manual_seed(rank)
    a = cls(8, 2, 3, 2, True, stride=2, dtype=torch.float64)
    b = cls(8, 2, 3, 2, True, stride=2, local_backend="tile", dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, *(7,) * rank, 8, dtype=torch.float64)
    torch.testing.assert_close(b(x), a(x), **TIGHT)


def test_module_argument_errors():
    with pytest.raises(ValueError, match="local_backend must be 'auto', 'natten', 'tplayers' or 'tile', got 'cuda'"):
        tplayers.NeighborhoodAttention1d(4, 2, 3, local_backend="cuda")
    with pytest.raises(ValueError, match="need no rel_pos_bias and kernel_size >= 2 .* rel_pos_bias=True"):
        tplayers.NeighborhoodAttention3d(4, 2, 3, rel_pos_bias=True, local_backend="natten")
    with pytest.raises(ValueError, match=r"kernel_size=\(1, 3\)"):
        tplayers.NeighborhoodAttention(4, 2, (1, 3), local_backend="tile")
    with pytest.raises(ValueError, match=r"rel_pos_bias needs stride 1 along every dim, got stride \(1, 2, 1\)"):
        tplayers.NeighborhoodAttention3d(4, 2, 3, rel_pos_bias=True, stride=(1, 2, 1))
    with pytest.raises(ValueError, match=r"shard_dims must be None or one of \[\(1,\)\] .*got \(2,\)"):
        tplayers.NeighborhoodAttention1d(4, 2, 3, shard_dims=(2,))
    with pytest.raises(
        TypeError,
        match="NeighborhoodAttention3d.from_module expects a NeighborhoodAttention3d, got NeighborhoodAttention",
    ):
        tplayers.NeighborhoodAttention3d.from_module(tplayers.NeighborhoodAttention(4, 2, 3))
    with pytest.raises(ValueError, match=r"input must be \(B, D, H, W, 4\)"):
        tplayers.NeighborhoodAttention3d(4, 2, 3)(torch.randn(1, 5, 5, 4))


def test_tile_attention_backend_errors():
    from tplayers.ops.na_tile import natten_applies, natten_module, tile_attention

    q = torch.randn(1, 8, 2, 4)
    assert "CUDA tensors" in natten_applies(q.device, (3,), False, True)  # the device first: no lookup
    assert "kernel_size >= 2" in natten_applies(torch.device("cuda"), (1, 3), False, True)
    assert "rel" in natten_applies(torch.device("cuda"), (3,), True, True)
    assert "pip install natten" in natten_applies(torch.device("cuda"), (3,), False, False)
    expect = ImportError if natten_module() is None else ValueError
    with pytest.raises(expect, match="pip install natten" if expect is ImportError else "CUDA"):
        tile_attention(q, q, q, (3,), (1,), (1,), (False,), None, backend="natten")
    with pytest.raises(ValueError, match="backend must be 'natten' or 'tplayers', got 'c'"):
        tile_attention(q, q, q, (3,), (1,), (1,), (False,), None, backend="c")


def test_auto_takes_natten_only_with_its_fused_kernels(monkeypatch):
    """A Python-only natten (no compiled library: its Flex backend, uncompiled) is not natten's fused
    kernels: "auto" leaves it for the tplayers engine; natten before 0.20 (no flag) had the library."""
    from types import SimpleNamespace

    from tplayers.ops import na_tile

    for fake, fused in (
        (None, False),
        (SimpleNamespace(HAS_LIBNATTEN=False), False),
        (SimpleNamespace(HAS_LIBNATTEN=True), True),
        (SimpleNamespace(), True),
    ):
        monkeypatch.setattr(na_tile, "natten_module", lambda fake=fake: fake)
        assert na_tile.natten_fused() is fused
        why = na_tile.natten_applies(torch.device("cuda"), (3, 3), False)
        assert (why is None) if fused else "fused CUDA kernels is not installed" in why
