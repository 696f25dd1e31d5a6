"""``torch.compile(fullgraph=True)`` of ``na2d``: the tile kernel runs as the registered ops
``tplayers::na2d_tiles`` / ``tplayers::na2d_tiles_backward``; output and every gradient
(q, k, v, the relative-position bias) are bitwise eager's, over kernels, dilation, causal,
non-square sizes and small chunks."""

import random

import pytest
import torch
import torch._dynamo as dynamo

from tplayers.ops.na_engine import neighborhood_attention


@pytest.mark.parametrize("seed", range(3))
def test_compiled_na2d_is_bitwise_eager(seed, na_kernel):
    rng = random.Random(70 + seed)
    kernel = (rng.choice([3, 4, 5]), rng.choice([3, 5]))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    causal = (rng.random() < 0.3, rng.random() < 0.3)
    size = (kernel[0] * dilation[0] + rng.randint(0, 5), kernel[1] * dilation[1] + rng.randint(0, 5))
    heads, dim = rng.randint(1, 2), rng.randint(2, 4)
    gen = torch.Generator().manual_seed(seed)
    ins = [torch.randn(2, *size, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3)]
    ins.append(torch.randn(heads, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64))
    chunk = rng.choice([None, 7])

    def f(q, k, v, rpb):
        return neighborhood_attention(
            q, k, v, kernel, dilation, causal, global_size=size, rel_pos_bias=rpb, chunk_scores=chunk
        )

    explained = dynamo.explain(f)(*ins)
    assert explained.graph_break_count == 0, explained.break_reasons
    dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    cot = torch.randn(2, *size, heads, dim, generator=gen, dtype=torch.float64)
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_(True) for t in ins]
        out = fn(*leaves)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves, cot)))
    for name, a, b in zip(("out", "dq", "dk", "dv", "drpb"), *results):
        assert torch.equal(a, b), name


def test_compiled_bf16_gqa_is_bitwise_eager(na_kernel):
    """bf16 with one key/value head (head_dim 1: the expanded heads of the compiled op must be a
    contiguous copy) and an fp32 table: compiled equals eager bit for bit, dtypes kept."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 7, 6, 4, 1, generator=gen).bfloat16()
    k, v = (torch.randn(1, 7, 6, 1, 1, generator=gen).bfloat16() for _ in range(2))  # MQA
    rpb = torch.randn(4, 5, 5, generator=gen)

    def f(q, k, v, rpb):
        return neighborhood_attention(q, k, v, (3, 3), (1, 1), (False, True), global_size=(7, 6), rel_pos_bias=rpb)

    dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    cot = torch.randn(1, 7, 6, 4, 1, generator=gen).bfloat16()
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, rpb)]
        out = fn(*leaves)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves, cot)))
    assert [t.dtype for t in results[1]] == [torch.bfloat16] * 4 + [torch.float32]
    for name, a, b in zip(("out", "dq", "dk", "dv", "drpb"), *results):
        assert torch.equal(a, b), name
