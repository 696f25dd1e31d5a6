"""The C kernel's 1-D backward for windows wider than a vector (``na_backward_line``,
tplayers/ops/na_cpu_line_bwd.c, issue 35): the scores of consecutive blocks sharing key loads, dQ
summed over packed keys and written in place, dK / dV added in place by the pixel route. Exact
against the brute-force oracle in fp64 (output and every gradient, the bias's included) on random
1-D configurations (kernels wider than the lanes, uneven lengths, stride, dilation, causal, GQA / MQA,
head dims of 1 to 8 vectors), on the host's build and the narrower ones it runs; rows of several
column chunks (the in-place dK / dV zeroed chunk by chunk) in fp32 and bf16; the super-blocks' dK /
dV at every head dim its kernels specialize; q alone wanting a
gradient (no dK / dV); a gradient of any strides; the same bits at 1 and 3 threads; the calls it does
not take (head dims off the lanes, ``TPLAYERS_NA_LINE=0``) run ``na_backward``."""

import ctypes
import random

import pytest
import torch
from na_cases import wide_1d_window
from na_oracle import at_thread_counts, brute_na, check_na1d_case, record_results

import tplayers
from tplayers.ops import na_cpu, na_cpu_plans
from tplayers.ops.na_geometry import Axis, geometry_args, kernel_dims, kernel_tables

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _isas():
    host = na_cpu.host_isa()
    return {"avx512": ["avx2", "base"], "avx2": ["base"]}.get(host, [])


def _env(monkeypatch, isa=None):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    for name in ("TPLAYERS_NA_LINE", "TPLAYERS_NA_DIRECT"):
        monkeypatch.delenv(name, raising=False)
    if isa:
        monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    else:
        monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)


def _chunks(size, kernel, heads, dim, dtype):
    """Column chunks of the backward plan of a 1-D call (na_chunks)."""
    geo = geometry_args([Axis(1, 1, 1, 1, 0), Axis(size, kernel, 1, 1, 0)], 1, 1)
    keep = (kernel_dims(geo, 1, heads, dim, dim), *kernel_tables(tuple(geo)))
    lib = na_cpu.load_library(dtype)
    return lib.na_chunks(*(ctypes.c_void_p(t.data_ptr()) for t in keep), 1)


@pytest.mark.parametrize("isa", [None, *_isas()])
def test_random_1d_configurations_match_the_oracle(isa, monkeypatch):
    _env(monkeypatch, isa)
    lanes = na_cpu.lanes(torch.float64)
    taken = record_results(monkeypatch, na_cpu_plans, "backward_line")
    rng = random.Random(35 + lanes)
    for case in range(10):
        kernel, stride, dil, causal, size, heads, kv_heads, with_bias = wide_1d_window(rng, lanes)
        dim, dim_v = lanes * rng.randint(1, 3), lanes * rng.choice([1, 2, 8])
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        where = f"isa {isa} k{kernel} s{stride} d{dil} causal {causal} L{size} heads {heads}/{kv_heads} D {dim}/{dim_v}"
        taken.clear()
        check_na1d_case(gen, size, heads, kv_heads, dim, dim_v, kernel, stride, dil, causal, with_bias, where, **TIGHT)
        assert taken and all(taken), f"the line backward did not run: {where}"


@pytest.mark.parametrize("isa", [None, *_isas()])
def test_super_block_dk_dv_at_every_head_dim_it_specializes(isa, monkeypatch):
    """The super-blocks' dK / dV (``pxl_rows``: each key summed over all its run's queries at once) at
    head dims of 1, 2, 3 and 4 vectors (the kernels with 4, 2 or 1 key columns a pass and the generic
    one), on rows of two full super-blocks, a short one and a partial block (runs ending mid-row and
    windows reaching past a run's blocks), with a bias: fp64 against the oracle; fp32 against the
    planes backward (``TPLAYERS_NA_LINE=0``) on the same values."""
    _env(monkeypatch, isa)
    taken = record_results(monkeypatch, na_cpu_plans, "backward_line")
    for dtype in (torch.float64, torch.float32):
        lanes = na_cpu.lanes(dtype)
        size, kernel = 19 * lanes + 5, 2 * lanes + 3
        for nv in (1, 2, 3, 4):
            dim = nv * lanes
            where = f"isa {isa} {dtype} D {dim} L{size} k{kernel}"
            gen = torch.Generator().manual_seed(nv)
            taken.clear()
            if dtype == torch.float64:
                check_na1d_case(gen, size, 2, 2, dim, dim, kernel, 1, 1, False, True, where, **TIGHT)
                assert taken and all(taken), f"the line backward did not run: {where}"
                continue
            base = [torch.randn(1, size, 2, dim, generator=gen) for _ in range(4)]
            grads = []
            for flag in ("", "0"):
                monkeypatch.setenv("TPLAYERS_NA_LINE", flag)
                ins = [t.clone().requires_grad_() for t in base[:3]]
                tplayers.na1d(*ins, kernel).backward(base[3])
                grads.append([t.grad for t in ins])
            assert taken == [True, False], where
            for got, want in zip(*grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
            monkeypatch.delenv("TPLAYERS_NA_LINE")


def test_rows_of_several_chunks_in_fp32_and_bf16(monkeypatch):
    """dK / dV added in place across column chunks (each key column zeroed before the first chunk
    that reaches it): fp32 against the fp64 oracle, bf16 (q widened for the pixel route) against the
    fp32 call on the same values; q alone wanting a gradient (no dK / dV)."""
    _env(monkeypatch)
    lanes = na_cpu.lanes(torch.float32)
    kernel, heads = 2 * lanes + 1, 2
    # the shortest of these rows the plan cuts into column chunks (they follow the host's L2 size)
    size = next((n for n in (1000, 2000, 4000) if _chunks(n, kernel, heads, 2 * lanes, torch.float32) > 1), None)
    assert size is not None, "no row of up to 4000 keys runs in column chunks on this host"
    taken = record_results(monkeypatch, na_cpu_plans, "backward_line")
    gen = torch.Generator().manual_seed(11)
    base = [torch.randn(1, size, heads, 2 * lanes, generator=gen) for _ in range(3)]
    cot = torch.randn(1, size, heads, 2 * lanes, generator=gen)
    ins = [t.clone().requires_grad_() for t in base]
    tplayers.na1d(*ins, kernel).backward(cot)
    ref_ins = [t.double().requires_grad_() for t in base]
    brute_na(*ref_ins, (kernel,)).backward(cot.double())
    for got, want in zip(ins, ref_ins):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-4)
    bf = [t.bfloat16().requires_grad_() for t in base]
    tplayers.na1d(*bf, kernel).backward(cot)
    widened = [t.bfloat16().float().requires_grad_() for t in base]
    tplayers.na1d(*widened, kernel).backward(cot)
    for got, want in zip(bf, widened):
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=2e-2, atol=2e-2)
    q_only = base[0].clone().requires_grad_()
    tplayers.na1d(q_only, base[1], base[2], kernel).backward(cot)
    torch.testing.assert_close(q_only.grad.double(), ref_ins[0].grad, rtol=1e-4, atol=1e-4)
    assert len(taken) >= 4 and all(taken)


def test_a_gradient_of_any_strides_and_threads_give_the_same_bits(monkeypatch):
    """``.sum()``'s expanded gradient (channel stride 0) is read as a dense copy; 1 and 3 threads
    give the same bits for every gradient."""
    _env(monkeypatch)
    lanes = na_cpu.lanes(torch.float64)
    taken = record_results(monkeypatch, na_cpu_plans, "backward_line")
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(2, 300, 3, lanes, generator=gen, dtype=torch.float64) for _ in range(3)]
    kernel = lanes + 7

    def grads():
        ins = [t.clone().requires_grad_() for t in base]
        tplayers.na1d(*ins, kernel).sum().backward()
        return [t.grad for t in ins]

    one, three = at_thread_counts(grads)
    assert all(torch.equal(a, b) for a, b in zip(one, three))
    ref_ins = [t.clone().requires_grad_() for t in base]
    brute_na(*ref_ins, (kernel,)).sum().backward()
    for got, want in zip(one, ref_ins):
        torch.testing.assert_close(got, want.grad, **TIGHT)
    assert len(taken) >= 2 and all(taken)


def test_where_it_does_not_apply_na_backward_runs(monkeypatch):
    _env(monkeypatch)
    lanes = na_cpu.lanes(torch.float64)
    taken = record_results(monkeypatch, na_cpu_plans, "backward_line")
    gen = torch.Generator().manual_seed(6)
    # (head dim, value head dim, TPLAYERS_NA_LINE): dims off the lanes, the switch
    for dim, dim_v, flag in [(lanes + 1, lanes, ""), (lanes, lanes + 3, ""), (lanes, lanes, "0")]:
        monkeypatch.setenv("TPLAYERS_NA_LINE", flag)
        where = f"D {dim}/{dim_v} TPLAYERS_NA_LINE={flag!r}"
        taken.clear()
        check_na1d_case(gen, 90, 2, 2, dim, dim_v, lanes + 3, 1, 1, False, True, where, **TIGHT)
        assert taken and not any(taken), where
