"""The chunked tile kernel behind tplayers.na2d: exactness on its default path (default tiles,
default chunk sizes, separate backward chunks) against the brute-force oracle in fp64, and its
peak memory against the issue-13 limit of 4x the B*heads*H*W*k^2 score bound."""

import random

import pytest
import torch
from memory_probe import peak_bytes
from na_oracle import assert_out_and_grads, brute_na2d

import tplayers
from tplayers.ops import na_kernel
from tplayers.ops.na_engine import neighborhood_attention

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _check_against_oracle(q, k, v, kernel, dilation, causal, scale=None, rpb=None, **engine):
    """Forward and every gradient (q, k, v and the bias table when given) against the oracle."""
    gen = torch.Generator().manual_seed(int(q.numel()))
    ins = [t.clone().requires_grad_() for t in (q, k, v) + ((rpb,) if rpb is not None else ())]
    ref_ins = [t.detach().clone().requires_grad_() for t in ins]
    size = (q.shape[1], q.shape[2])
    if engine or rpb is not None:
        out = neighborhood_attention(
            *ins[:3],
            kernel,
            dilation,
            causal,
            scale=scale,
            global_size=size,
            rel_pos_bias=ins[3] if rpb is not None else None,
            **engine,
        )
    else:
        out = tplayers.na2d(*ins, kernel, dilation, causal, scale)
    ref = brute_na2d(*ref_ins[:3], kernel, dilation, causal, scale, rpb=ref_ins[3] if rpb is not None else None)
    where = f"kernel {kernel} dilation {dilation} causal {causal} size {size} {engine}"
    assert_out_and_grads(out, ref, ins, ref_ins, gen, where, **TIGHT)


@pytest.mark.parametrize("seed", range(4))
def test_default_path_kernels_3_to_13_fp64(seed, na_kernel):
    """Random kernels 3..13 per dim (odd and even), dilation, causal, non-square sizes just above
    kernel * dilation, batch and heads > 1: the production path (default tiles and chunks)."""
    rng = random.Random(1300 + seed)
    for _ in range(4):
        kernel = (rng.randint(3, 13), rng.randint(3, 13))
        dilation = tuple(rng.choice([1, 1, 2]) if kk <= 7 else 1 for kk in kernel)
        causal = (rng.random() < 0.3, rng.random() < 0.3)
        h, w = (kk * d + rng.randint(0, 3) for kk, d in zip(kernel, dilation))
        batch, heads, dim = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 4)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q, k, v = (torch.randn(batch, h, w, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
        _check_against_oracle(q, k, v, kernel, dilation, causal, scale=rng.choice([None, 0.3]))


def test_default_path_many_chunks_and_bias_fp64(monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")  # the tile kernel's chunking
    """Tiny default chunk sizes (forward and backward chunk boundaries fall in different places,
    every chunk mixes window patterns) on the default tiles, with a relative-position bias."""
    monkeypatch.setattr(na_kernel, "CHUNK_SCORES", 3000)
    monkeypatch.setattr(na_kernel, "BACKWARD_CHUNK_SCORES", 700)
    gen = torch.Generator().manual_seed(5)
    for kernel, dilation, causal, size in [
        ((7, 5), (1, 2), (False, False), (9, 12)),
        ((3, 8), (2, 1), (True, False), (7, 10)),
        ((13, 4), (1, 1), (False, True), (14, 5)),
    ]:
        q, k, v = (torch.randn(2, *size, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
        rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        _check_against_oracle(q, k, v, kernel, dilation, causal, rpb=rpb)


def test_expanded_grad_out_read_in_place_fp64(na_kernel):
    """``out.sum().backward()`` hands the kernel a stride-0 dO, which it reads without copying."""
    gen = torch.Generator().manual_seed(11)
    kernel, dilation, causal = (5, 3), (1, 2), (False, True)
    q, k, v = (torch.randn(2, 7, 9, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    tplayers.na2d(*ins, kernel, dilation, causal).sum().backward()
    brute_na2d(*ref_ins, kernel, dilation, causal).sum().backward()
    for name, a, b in zip("qkv", ins, ref_ins):
        torch.testing.assert_close(a.grad, b.grad, **TIGHT, msg=lambda m: f"d{name}: {m}")


def test_backward_uses_smaller_chunks_than_forward(monkeypatch):
    """The backward plan holds the same tiles in more, smaller chunks (its per-chunk peak is higher)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")  # the tile kernel's plans
    q = torch.randn(1, 64, 64, 4, 8, requires_grad=True)
    out = tplayers.na2d(q, q, q, 7)
    node = out.grad_fn
    while node is not None and type(node).__name__ != "TileAttentionBackward":
        node = node.next_functions[0][0]
    assert node is not None
    bwd = node.plan  # the autograd node is the Function's ctx
    planes = 4
    assert max(t1 - t0 for t0, t1 in bwd.chunks) * bwd.tq * bwd.region * planes <= na_kernel.BACKWARD_CHUNK_SCORES
    assert len(bwd.chunks) > (bwd.num_tiles * bwd.tq * bwd.region * planes) // na_kernel.CHUNK_SCORES


@pytest.mark.parametrize("size, heads, dim", [(64, 4, 32), (96, 2, 16)])
def test_peak_memory_with_all_three_gradients_within_4x_bound(size, heads, dim, na_kernel):
    """The benchmark shapes (kernel 7, fp32): forward, and forward+backward with dq, dk, dv (an
    expanded gradient from .sum() and a dense one), peak <= 4x B*heads*H*W*k^2 fp32 scores."""
    kernel = 7
    q, k, v = (torch.randn(1, size, size, heads, dim) for _ in range(3))
    bound = heads * size * size * kernel**2 * 4
    cold = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    train_sum = peak_bytes(lambda: tplayers.na2d(*qkv, kernel).sum().backward())
    assert all(x.grad is not None for x in qkv)
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    cot = torch.randn_like(q)
    train_dense = peak_bytes(lambda: (tplayers.na2d(*qkv, kernel) * cot).sum().backward())
    peaks = {"forward": cold, "fwd+bwd (sum)": train_sum, "fwd+bwd (dense dO)": train_dense}
    for name, peak in peaks.items():
        assert peak <= 4 * bound, f"{name}: {peak / bound:.2f}x the bound (limit 4x)"
