"""The C kernel's 1-D forward and backward on the user's layout (``na_forward_1d``, ``na_backward_1d``,
tplayers/ops/na_cpu_direct_fwd.c and _bwd.c, issue 35): q, k, v (and dO) read in place, no planes. Exact against
the brute-force oracle in fp64 (output and every gradient, the bias's included) on random 1-D configurations
with head dims that are multiples of the lanes and windows of at most one vector (stride,
dilation, causal, GQA/MQA, the bias, batch 2), on the host's build and the AVX2 build where the
host has AVX-512; the path is checked to be the one taken, and its threads' split to give the same
bits; where it does not apply (head dims off the lanes, wider windows, ``TPLAYERS_NA_DIRECT=0``)
the planes run. The backward also with k and v not requiring grad and with the expanded gradient of
``.sum()`` (channel stride 0: copied)."""

import random

import pytest
import torch
from na_oracle import at_thread_counts, brute_na, check_na1d_case, record_results

import tplayers
from tplayers.ops import na_cpu, na_cpu_plans

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _isas():
    return ["avx2"] if na_cpu.host_isa() == "avx512" else []


def _spy(monkeypatch):
    return record_results(monkeypatch, na_cpu_plans, "forward_direct")


def _spy_backward(monkeypatch):
    return record_results(monkeypatch, na_cpu_plans, "backward_direct")


@pytest.mark.parametrize("isa", [None, *_isas()])
def test_random_1d_configurations_match_the_oracle(isa, monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_DIRECT", raising=False)
    if isa:
        monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    else:
        monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    lanes = na_cpu.lanes(torch.float64)
    taken, taken_bwd = _spy(monkeypatch), _spy_backward(monkeypatch)
    rng = random.Random(35 + lanes)
    for case in range(8):
        kernel = rng.randint(2, lanes)
        stride = rng.choice([1, 1, kernel, rng.randint(1, kernel)])
        dil = rng.choice([1, 1, 2, 3])
        causal = rng.random() < 0.35
        size = kernel * dil + rng.choice([0, 2, 5, 11, 19])
        heads = 9 if case == 0 else rng.choice([1, 2, 3, 4])  # 9: more head groups than run at once
        kv_heads = rng.choice([h for h in (1, 2, 3, 4) if heads % h == 0])
        with_bias = stride == 1 and rng.random() < 0.6
        dim, dim_v = lanes * rng.randint(1, 3), lanes * rng.randint(1, 3)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        where = f"isa {isa} k{kernel} s{stride} d{dil} causal {causal} L{size} heads {heads}/{kv_heads} D {dim}/{dim_v}"
        check_na1d_case(gen, size, heads, kv_heads, dim, dim_v, kernel, stride, dil, causal, with_bias, where, **TIGHT)
        assert taken and taken[-1], f"the direct forward did not run: {where}"
        assert taken_bwd and taken_bwd[-1], f"the direct backward did not run: {where}"


def test_threads_split_the_queries_bit_for_bit(monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_DIRECT", raising=False)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 300, 2, 16, generator=gen) for _ in range(3))
    taken = _spy(monkeypatch)
    one, three = at_thread_counts(lambda: tplayers.na1d(q, k, v, 5, dilation=2))
    assert taken == [True, True]
    assert torch.equal(one, three)


def test_where_it_does_not_apply_the_planes_run(monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_DIRECT", raising=False)
    lanes = na_cpu.lanes(torch.float64)
    taken, taken_bwd = _spy(monkeypatch), _spy_backward(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    cases = [(lanes + 1, lanes, ""), (3, lanes + 1, ""), (3, lanes, "0")]  # (kernel, head dim, TPLAYERS_NA_DIRECT)
    for kernel, dim, flag in cases:
        monkeypatch.setenv("TPLAYERS_NA_DIRECT", flag)
        q, k, v = (torch.randn(1, 40, 2, dim, generator=gen, dtype=torch.float64) for _ in range(3))
        out = tplayers.na1d(q, k, v, kernel)
        assert taken[-1] is False, (kernel, dim, flag)
        torch.testing.assert_close(out, brute_na(q, k, v, (kernel,)), **TIGHT)
        x = q.clone().requires_grad_()
        tplayers.na1d(x, k, v, kernel).sum().backward()
        assert taken_bwd[-1] is False, (kernel, dim, flag)
    monkeypatch.setenv("TPLAYERS_NA_DIRECT", "all")  # the benchmark's A/B: every window
    q, k, v = (torch.randn(1, 40, 2, lanes, generator=gen, dtype=torch.float64) for _ in range(3))
    out = tplayers.na1d(q, k, v, lanes + 5)
    assert taken[-1] is True
    torch.testing.assert_close(out, brute_na(q, k, v, (lanes + 5,)), **TIGHT)


def test_backward_without_kv_grads_and_with_an_expanded_gradient(monkeypatch):
    """k and v not requiring grad (no dK / dV written), the gradient of ``.sum()`` (expanded, channel
    stride 0), and threads splitting the planes: the same dq bits, equal to the oracle's."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_DIRECT", raising=False)
    lanes = na_cpu.lanes(torch.float64)
    kernel = 5 if lanes >= 5 else 3  # a window of one vector: the direct backward (AVX2: 4 fp64 lanes)
    taken = _spy_backward(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 50, 3, lanes, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 50, 3, 2 * lanes, generator=gen, dtype=torch.float64)[..., :lanes] for _ in range(2))
    ref_q = q.clone().requires_grad_()
    brute_na(ref_q, k, v, (kernel,), (1,), (2,), (True,)).sum().backward()

    def dq():
        x = q.clone().requires_grad_()
        tplayers.na1d(x, k, v, kernel, dilation=2, is_causal=True).sum().backward()
        return x.grad

    grads = at_thread_counts(dq)
    assert taken == [kernel <= lanes] * 2
    assert torch.equal(grads[0], grads[1])
    torch.testing.assert_close(grads[0], ref_q.grad, **TIGHT)
