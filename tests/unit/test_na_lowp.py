"""bf16 / fp16 neighborhood attention (issue 35): tplayers.na1d / na2d / na3d take bf16 (and fp16)
q, k, v on every CPU kernel and compute them in fp32 (scores, softmax state, accumulation and the
gradient sums), returning the output and the input gradients in the input dtype.

Checked on random configurations of every option (stride, dilation, causal per dim, GQA/MQA,
head_dim != value dim, the bias table, an fp32 table as under autocast): (1) bit for bit the fp32
computation on the same (exactly representable) inputs, rounded once to bf16; (2) within bf16's
rounding of the fp64 oracle (tests/na_oracle.py) on those inputs; plus the dtypes refused
(TypeError naming the argument), the default kernel for bf16 and what is saved for backward."""

import random

import pytest
import torch
from na_oracle import brute_na

import tplayers
from tplayers.ops import na_dispatch

FUNCS = {1: tplayers.na1d, 2: tplayers.na2d, 3: tplayers.na3d}
#: a bf16 result is the fp32 one rounded once (half an ulp: 2^-9 relative) plus fp32 round-off
BF16 = dict(rtol=2**-8, atol=1e-4)
FP16 = dict(rtol=2**-10, atol=1e-5)


def _case(rng, rank):
    kernel = tuple(rng.randint(1, 4) if rank == 3 else rng.randint(2, 6) for _ in range(rank))
    stride = tuple(rng.choice([1, 1, kk, rng.randint(1, kk)]) for kk in kernel)
    dil = tuple(rng.choice([1, 2]) if kk <= 4 else 1 for kk in kernel)
    causal = tuple(rng.random() < 0.35 for _ in range(rank))
    size = tuple(kk * d + rng.choice([0, 1, 3] if rank == 3 else [0, 2, 5, 9]) for kk, d in zip(kernel, dil))
    heads = rng.choice([1, 2, 4])
    kv_heads = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    bias = all(s == 1 for s in stride) and rng.random() < 0.6
    return kernel, stride, dil, causal, size, heads, kv_heads, bias


def _grads(fn, tensors, cot):
    ins = [t.clone().requires_grad_() for t in tensors]
    out = fn(*ins)
    (out.to(cot.dtype) * cot).sum().backward()
    return out, [t.grad for t in ins]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_low_precision_equals_fp32_rounded_and_the_oracle(rank, dtype, na_kernel):
    rng = random.Random(3500 + 10 * rank + (dtype == torch.float16))
    for _ in range(3):
        kernel, stride, dil, causal, size, heads, kv_heads, bias = _case(rng, rank)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        batch, dim, dim_v = rng.randint(1, 2), rng.randint(1, 5), rng.randint(1, 5)
        q = torch.randn(batch, *size, heads, dim, generator=gen).to(dtype)
        k = torch.randn(batch, *size, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(batch, *size, kv_heads, dim_v, generator=gen).to(dtype)
        # the table: the inputs' dtype, or fp32 as a layer's parameter under autocast
        table_dtype = rng.choice([dtype, torch.float32])
        table = torch.randn(heads, *(2 * kk - 1 for kk in kernel), generator=gen).to(table_dtype) if bias else None
        cot = torch.randn(batch, *size, heads, dim_v, generator=gen).to(dtype)
        where = f"{dtype} rank {rank} kernel {kernel} stride {stride} dil {dil} causal {causal} size {size} {heads}/{kv_heads} bias {bias}"
        tensors = [q, k, v] + ([table] if bias else [])
        scale = rng.choice([None, 0.4])

        def call(*ins, cast=None):
            ins = [t if cast is None else t.to(cast) for t in ins]
            tab = ins[3] if bias else None
            return FUNCS[rank](*ins[:3], kernel, dil, causal, scale, stride=stride, rel_pos_bias=tab)

        out, grads = _grads(call, tensors, cot)
        assert out.dtype == dtype, where
        assert [g.dtype for g in grads] == [t.dtype for t in tensors], where
        # (1) the fp32 computation on the same inputs, rounded once: bit for bit
        out32, grads32 = _grads(lambda *t: call(*t, cast=torch.float32), tensors, cot.float())
        assert torch.equal(out, out32.to(dtype)), where
        for name, g, g32 in zip("qkvb", grads, grads32):
            assert torch.equal(g, g32.to(g.dtype)), f"d{name} {where}"
        # (2) the fp64 oracle on those inputs, to bf16 / fp16 rounding
        ref, ref_grads = _grads(
            lambda *t: brute_na(*t[:3], kernel, stride, dil, causal, scale, rpb=t[3] if bias else None),
            [t.double() for t in tensors],
            cot.double(),
        )
        tol = BF16 if dtype == torch.bfloat16 else FP16
        torch.testing.assert_close(out.double(), ref, **tol, msg=lambda m: f"out {where}: {m}")
        for name, g, gr in zip("qkvb", grads, ref_grads):
            # gradients sum many terms: tolerance relative to their largest entry as well
            torch.testing.assert_close(
                g.double(),
                gr,
                rtol=tol["rtol"],
                atol=tol["atol"] + tol["rtol"] * float(gr.abs().max()),
                msg=lambda m: f"d{name} {where}: {m}",
            )


def test_bf16_default_is_the_c_kernel_and_saves_bf16_inputs(monkeypatch):
    """Unforced, a bf16 CPU call runs the C kernel (where it builds) in fp32; what autograd keeps
    for backward is the bf16 inputs and the fp32 output, no fp32 copy of q, k, v."""
    monkeypatch.delenv("TPLAYERS_NA_KERNEL", raising=False)
    q = torch.randn(1, 12, 12, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    if not tplayers.ops.na_cpu.use_c_kernel(q, (5, 5), torch.float32):
        pytest.skip("the C kernel does not build here")
    assert na_dispatch.choose_kernel(q, (5, 5)) == "c"
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        tplayers.na2d(q, q, q, 5).sum().backward()
    kinds = sorted(saved, key=str)
    assert (torch.float32, q.numel()) in kinds, kinds  # the fp32 output
    assert sum(n for d, n in kinds if d == torch.float32) == q.numel(), kinds  # and nothing else in fp32
    assert q.grad.dtype == torch.bfloat16


def test_dtypes_refused_name_the_argument():
    q = torch.randn(1, 8, 8, 2, 4)
    for bad in (torch.int32, torch.complex64):
        x = torch.zeros(1, 8, 8, 2, 4, dtype=bad)
        with pytest.raises(TypeError, match=rf"na2d: q must be float32, float64, bfloat16 or float16 .*got {bad}"):
            tplayers.na2d(x, x, x, 3)
    with pytest.raises(TypeError, match=r"na2d: rel_pos_bias must be float32, float64, bfloat16 or float16"):
        tplayers.na2d(q, q, q, 3, rel_pos_bias=torch.zeros(2, 5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="na1d: q, k, v must share dtype"):
        x = torch.randn(1, 8, 2, 4)
        tplayers.na1d(x.bfloat16(), x, x, 3)
    with pytest.raises(TypeError, match="neighborhood_attention: q must be float32"):
        x = torch.zeros(1, 6, 6, 1, 2, dtype=torch.int64)
        tplayers.ops.na_engine.neighborhood_attention(x, x, x, (3, 3), (1, 1), (False, False), global_size=(6, 6))


def test_table_of_another_dtype_is_used_in_the_compute_dtype(na_kernel):
    """An fp64 table with fp32 inputs (the C kernel read its memory as fp32) equals the fp32 table;
    its gradient comes back fp64."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 9, 9, 2, 4, generator=gen)
    table = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    table32 = table.detach().float().requires_grad_()
    a, b = tplayers.na2d(q, q, q, 3, rel_pos_bias=table), tplayers.na2d(q, q, q, 3, rel_pos_bias=table32)
    assert torch.equal(a, b)
    a.sum().backward(), b.sum().backward()
    assert table.grad.dtype == torch.float64 and torch.equal(table.grad, table32.grad.double())


@pytest.mark.parametrize("case", ["1d", "1d_wide", "2d", "2d_d32", "3d"])
def test_bf16_whole_vectors_equal_fp32_rounded(case, na_kernel):
    """Head dims of whole vectors (16, 32: the C kernel widens bf16 as it loads and transposes them,
    no fp32 copy of q, k, v), a long row, GQA: bit for bit the fp32 result, rounded. On the C kernel
    "1d_wide" runs the 1-D line backward and "2d_d32" the pixel routes of 128-byte pixels (P V, dQ)."""
    gen = torch.Generator().manual_seed(11)
    fn, shape, kv, kernel = {
        "1d": (tplayers.na1d, (1, 700, 4, 32), 2, 9),
        "1d_wide": (tplayers.na1d, (1, 700, 4, 32), 2, 33),
        "2d": (tplayers.na2d, (1, 20, 33, 2, 16), 1, 5),
        "2d_d32": (tplayers.na2d, (1, 20, 33, 2, 32), 1, 5),
        "3d": (tplayers.na3d, (1, 5, 6, 19, 2, 32), 2, 3),
    }[case]
    q = torch.randn(*shape, generator=gen).bfloat16()
    k, v = (torch.randn(*shape[:-2], kv, shape[-1], generator=gen).bfloat16() for _ in range(2))
    cot = torch.randn(*shape, generator=gen).bfloat16()
    out, grads = _grads(lambda *t: fn(*t, kernel, is_causal=case == "1d"), [q, k, v], cot)
    out32, grads32 = _grads(
        lambda *t: fn(*(x.float() for x in t), kernel, is_causal=case == "1d"), [q, k, v], cot.float()
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, out32.to(torch.bfloat16))
    for name, g, g32 in zip("qkv", grads, grads32):
        assert g.dtype == torch.bfloat16 and torch.equal(g, g32.to(torch.bfloat16)), name
