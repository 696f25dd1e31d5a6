"""The flex_attention kernel (tplayers.ops.na_flex): its mask and block mask against NATTEN's rule
(tests/na_oracle.py), its results against the oracle (forward on the CPU, where flex runs eagerly
and has no backward; forward and backward compiled on CUDA), and when it is chosen."""

import random

import pytest
import torch
from na_oracle import brute_na, natten_mask_1d

import tplayers
from tplayers.ops import na_dispatch, na_flex
from tplayers.ops.na_engine import neighborhood_attention
from tplayers.ops.na_geometry import Axis


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "flex")


def _random_axis(rng):
    kernel = rng.randint(1, 5)
    dilation = rng.randint(1, 3)
    length = kernel * dilation + rng.randint(0, 9)
    stride = rng.randint(1, kernel)
    causal = rng.random() < 0.3
    q_off = rng.randint(0, length - 1)
    q_len = rng.randint(1, length - q_off)
    return length, kernel, dilation, causal, stride, q_off, q_len


def _dense(axes, rng):
    """The exact (Lq, Lk) mask of queries q_off + [0, q_len) over the keys a shard holds (the span
    its windows need, sometimes wider), and each axis' key range."""
    masks, spans = [], []
    for length, kernel, dilation, causal, stride, q_off, q_len in axes:
        m = natten_mask_1d(length, kernel, stride, dilation, causal)[q_off : q_off + q_len]
        cols = m.any(0).nonzero().flatten()
        lo, hi = int(cols.min()), int(cols.max()) + 1
        if rng.random() < 0.4:  # a halo wider than the windows need
            lo, hi = rng.randint(0, lo), rng.randint(hi, length)
        masks.append(m[:, lo:hi])
        spans.append((lo, hi))
    full = masks[0]
    for m in masks[1:]:
        full = (full[:, None, :, None] & m[None, :, None, :]).reshape(full.shape[0] * m.shape[0], -1)
    return full, spans


@pytest.mark.parametrize("seed", range(12))
def test_mask_and_block_table_match_natten(seed):
    """mask_mod is NATTEN's window exactly, on a shard's queries against the keys they need; every
    (query, key) pair of the window lies in a listed block (small blocks, many of them)."""
    rng = random.Random(seed)
    axes = [_random_axis(rng) for _ in range(rng.randint(1, 3))]
    exact, spans = _dense(axes, rng)
    windows = [
        na_flex.axis_windows(Axis(length, kernel, stride, dil, int(causal), q_off, q_len, lo, hi - lo))
        for (length, kernel, dil, causal, stride, q_off, q_len), (lo, hi) in zip(axes, spans)
    ]
    q_sizes = [a[-1] for a in axes]
    k_sizes = [hi - lo for lo, hi in spans]
    mask_mod = na_flex._mask_mod(windows, [a[2] for a in axes], q_sizes, k_sizes)
    qi = torch.arange(exact.shape[0])[:, None].expand(exact.shape)
    ki = torch.arange(exact.shape[1])[None, :].expand(exact.shape)
    assert torch.equal(mask_mod(0, 0, qi, ki), exact), axes
    block = rng.choice([1, 3, 8])
    table = na_flex.block_table(windows, q_sizes, k_sizes, block)
    covered = table.repeat_interleave(block, 0).repeat_interleave(block, 1)[: exact.shape[0], : exact.shape[1]]
    assert not (exact & ~covered).any(), axes
    if block == 1 and all(a[2] == 1 for a in axes):  # one token a block, no dilation gaps: exact
        assert torch.equal(table, exact), axes


@pytest.mark.parametrize("seed", range(8))
def test_forward_matches_oracle(forced, seed):
    """Forced on the CPU (eager flex, no backward): fp64 forward == the brute-force oracle over
    random ranks, uneven sizes, dilation, causal, stride, GQA and a value head dim of its own."""
    rng = random.Random(100 + seed)
    rank = 1 + seed % 3
    kernel = [rng.randint(2, 4) for _ in range(rank)]
    dilation = [rng.randint(1, 2) for _ in range(rank)]
    stride = [rng.randint(1, k) for k in kernel]
    causal = [rng.random() < 0.3 for _ in range(rank)]
    extra = {1: 250, 2: 12, 3: 2}[rank] if seed % 2 else 4  # odd seeds: several 128-token blocks
    size = [k * d + rng.randint(0, extra) for k, d in zip(kernel, dilation)]
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, *size, heads, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, *size, kv_heads, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, *size, kv_heads, 5, generator=gen, dtype=torch.float64)
    fn = getattr(tplayers, f"na{rank}d")
    out = fn(q, k, v, kernel, dilation, causal, stride=stride)
    ref = brute_na(q, k, v, kernel, stride, dilation, causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_shard_offsets_and_bf16(forced, monkeypatch):
    """A shard's queries (offsets along both axes) against its haloed keys: flex == the tile kernel;
    bf16 inputs run natively on flex (fp32 scores and sums, the probabilities rounded to bf16 before
    they meet the values) and stay within bf16's rounding of the fp32 result."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 15, 20, 2, 16, generator=gen)  # 300 queries: three 128-token blocks
    k, v = (torch.randn(1, 19, 25, 2, 16, generator=gen) for _ in range(2))
    args = dict(global_size=(34, 37), q_offset=(4, 6), k_offset=(2, 3), stride=(1, 2))
    window = ((5, 5), (1, 1), (False, True))
    flex = neighborhood_attention(q, k, v, *window, **args)
    flex16 = neighborhood_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *window, **args)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")
    torch.testing.assert_close(flex, neighborhood_attention(q, k, v, *window, **args), rtol=1e-5, atol=1e-6)
    ref16 = neighborhood_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), *window, **args)
    assert flex16.dtype == torch.bfloat16
    torch.testing.assert_close(flex16, ref16, rtol=0, atol=1e-2)
    # native, not an fp32 copy: flex's own bf16 arithmetic on the same inputs, bit for bit
    axes = [
        Axis(34, 5, 1, 1, 0, 4, 15, 2, 19),
        Axis(37, 5, 2, 1, 1, 6, 20, 3, 25),
    ]
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    assert torch.equal(flex16, na_flex.flex_attention_na(q16, k16, v16, axes, 16**-0.5, compiled=False))
    exact = neighborhood_attention(q16.double(), k16.double(), v16.double(), *window, **args)
    assert (flex16.double() - exact).abs().max() <= 2 * (ref16.double() - exact).abs().max() + 2**-9


def test_chosen_on_cuda_only_and_refusals(forced, monkeypatch):
    """Unforced, a CPU call never takes flex; forced, a bias is refused by name and a CPU backward
    by flex itself."""
    q = torch.randn(1, 6, 6, 2, 16)
    bias = torch.zeros(2, 9, 9)
    assert "cpu tensor" in na_flex.flex_applies(q, q, torch.float32, False)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "")
    assert na_dispatch.choose_kernel(q, (3, 3), False, q, None) != "flex"  # the CPU default stays
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "flex")
    with pytest.raises(RuntimeError, match="TPLAYERS_NA_KERNEL=flex: .* no relative-position bias"):
        tplayers.na2d(q, q, q, 5, rel_pos_bias=bias)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        tplayers.na2d(q.requires_grad_(), q, q, 3)


def test_flex_applies_reasons():
    """The CUDA default's conditions, each refusal named (no CUDA device needed: only the device
    type is read)."""

    class Fake:
        def __init__(self, dim, kind="cuda"):
            self.shape = (1, 4, 2, dim)
            self.device = torch.device(kind)

    assert na_flex.flex_applies(Fake(16), Fake(16), torch.float32, False) is None
    assert "takes fp32, bf16 or fp16" in na_flex.flex_applies(Fake(16), Fake(16), torch.float64, False)
    assert "one head dim in" in na_flex.flex_applies(Fake(16), Fake(8), torch.float32, False)
    assert "one head dim in" in na_flex.flex_applies(Fake(48), Fake(48), torch.float32, False)
    assert "one head dim in" in na_flex.flex_applies(Fake(32), Fake(64), torch.float32, False)
    assert "relative-position bias" in na_flex.flex_applies(Fake(32), Fake(32), torch.float32, True)
    assert "cpu tensor" in na_flex.flex_applies(Fake(32, "cpu"), Fake(32, "cpu"), torch.float32, False)
    big = Fake(32)
    big.shape = (1, 8192 * 128 + 1, 2, 32)  # one token past 2**26 block pairs
    assert "block pairs" in na_flex.flex_applies(big, big, torch.float32, False, window=49)
    big.shape = (1, 300_000, 1, 32)  # 2344^2 pairs: over the memory bound of a 3x3 window, not of 7x7
    assert "block pairs" in na_flex.flex_applies(big, big, torch.float32, False, window=9)
    assert na_flex.flex_applies(big, big, torch.float32, False, window=49) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention runs on CUDA (benchmarks/na_gpu.py)")
@pytest.mark.parametrize("case", range(4))
def test_cuda_compiled_forward_backward(case, monkeypatch):
    """The CUDA default (compiled flex), fp32, against the fp64 tile kernel on the GPU: output and
    the gradients of q, k and v, over GQA, dilation, causal and stride."""
    monkeypatch.delenv("TPLAYERS_NA_KERNEL", raising=False)
    rng = random.Random(case)
    rank = 1 + case % 3
    kernel = [rng.choice([3, 5, 7]) for _ in range(rank)]
    dilation = [rng.randint(1, 2) for _ in range(rank)]
    stride = [rng.randint(1, 2) for _ in range(rank)]
    causal = [case == 3 and i == 0 for i in range(rank)]
    size = [k * d + rng.randint(3, 40 // rank) for k, d in zip(kernel, dilation)]
    gen = torch.Generator(device="cuda").manual_seed(case)
    q = torch.randn(2, *size, 4, 32, device="cuda", generator=gen, requires_grad=True)
    k, v = (torch.randn(2, *size, 2, 32, device="cuda", generator=gen, requires_grad=True) for _ in range(2))
    assert na_dispatch.choose_kernel(q, kernel, True, v, None) == "flex"
    fn = getattr(tplayers, f"na{rank}d")
    out = fn(q, k, v, kernel, dilation, causal, stride=stride)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), cot)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = fn(*ref_in, kernel, dilation, causal, stride=stride)
    ref_grads = torch.autograd.grad(ref, ref_in, cot.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    "axes",
    [  # Axis(length, kernel, stride, dilation, causal, q_start, q_count, k_start, k_count)
        (Axis(1000, 7, 1, 1, 0, 0, 1000, 0, 1000),),
        (Axis(40, 5, 1, 2, 0, 0, 40, 0, 40), Axis(45, 3, 2, 1, 1, 0, 45, 0, 45)),
        (Axis(30, 3, 1, 1, 0, 8, 10, 6, 14), Axis(33, 5, 1, 1, 0, 0, 33, 0, 33), Axis(20, 3, 1, 1, 0, 0, 20, 0, 20)),
    ],
)
def test_block_mask_lists_the_table(axes):
    """The BlockMask handed to flex holds exactly block_table's blocks (kv_indices in order, its
    transposed q-side too), for 1-D, a 2-D causal/strided/dilated window and a 3-D shard."""
    mask = na_flex._block_mask(axes, torch.device("cpu"))
    windows = [na_flex.axis_windows(a) for a in axes]
    q_sizes, k_sizes = [a.q_count for a in axes], [a.k_count for a in axes]
    table = na_flex.block_table(windows, q_sizes, k_sizes)
    assert table.shape[0] > 1 and table.shape[1] > 1 and not table.all()  # a sparse table of many blocks
    assert torch.equal(mask.to_dense()[0, 0].bool(), table)
    q_side = torch.zeros_like(table)
    for kb in range(table.shape[1]):
        q_side[mask.q_indices[0, 0, kb, : mask.q_num_blocks[0, 0, kb]], kb] = True
    assert torch.equal(q_side, table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention runs on CUDA (benchmarks/na_gpu.py)")
@pytest.mark.parametrize("rank", [1, 2])
def test_cuda_compiled_shard_and_blocks(rank, monkeypatch):
    """Compiled flex on a shard (query and key offsets, a wider key halo) of several 128-token
    blocks: output and gradients against the fp64 tile kernel."""
    monkeypatch.delenv("TPLAYERS_NA_KERNEL", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    sq, sk = ((700,), (760,)) if rank == 1 else ((15, 20), (26, 26))
    glob, q_off, k_off = ((1000,), (200,), (170,)) if rank == 1 else ((34, 37), (4, 6), (0, 3))
    q = torch.randn(2, *sq, 4, 32, device="cuda", generator=gen, requires_grad=True)
    k, v = (torch.randn(2, *sk, 2, 32, device="cuda", generator=gen, requires_grad=True) for _ in range(2))
    window = ((7,) * rank, (2,) + (1,) * (rank - 1), (False,) * rank)
    args = dict(global_size=glob, q_offset=q_off, k_offset=k_off, stride=(2,) + (1,) * (rank - 1))
    out = neighborhood_attention(q, k, v, *window, **args)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), cot)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = neighborhood_attention(*ref_in, *window, **args)
    ref_grads = torch.autograd.grad(ref, ref_in, cot.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention runs on CUDA (benchmarks/na_gpu.py)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_compiled_low_precision_native(dtype, monkeypatch):
    """bf16 / fp16 on the CUDA default run natively (fp32 inside the kernel): output and the q, k, v
    gradients in the input dtype, within 4x the error of the same kernel on fp32 copies (rounded to
    the input dtype) plus one rounding, against the fp64 tile kernel on the same values (flash
    attention's rounding of the probabilities and dS before their matmuls)."""
    monkeypatch.delenv("TPLAYERS_NA_KERNEL", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 24, 29, 4, 64, device="cuda", generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 24, 29, 2, 64, device="cuda", generator=gen).to(dtype).requires_grad_() for _ in range(2))
    cot = torch.randn(2, 24, 29, 4, 64, device="cuda", generator=gen).to(dtype)
    args = ((7, 5), (1, 2), (False, False))
    assert na_dispatch.choose_kernel(q, args[0], True, v, None) == "flex"
    out = tplayers.na2d(q, k, v, *args)
    got = (out, *torch.autograd.grad(out, (q, k, v), cot))
    assert all(t.dtype == dtype for t in got)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out32 = tplayers.na2d(*leaves, *args)
    copies = [t.to(dtype) for t in (out32, *torch.autograd.grad(out32, leaves, cot.float()))]
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = tplayers.na2d(*ref_in, *args)
    exact = (ref, *torch.autograd.grad(ref, ref_in, cot.double()))
    ulp = torch.finfo(dtype).eps
    for name, g, c, e in zip(("out", "dq", "dk", "dv"), got, copies, exact):
        native_err = (g.double() - e).abs().max().item()
        copy_err = (c.double() - e).abs().max().item()
        assert native_err <= 4 * copy_err + ulp * e.abs().max().item(), (name, native_err, copy_err)
