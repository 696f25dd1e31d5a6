"""The C kernel's 1-D forward for windows wider than a vector (``na_forward_line``,
tplayers/ops/na_cpu_line.c, issue 35): query and key planes, consecutive blocks of queries sharing
each key load in super-blocks, a chunk's values packed, the output written in place. Exact against the
brute-force oracle in fp64 (output and, through the C backward that receives its output, every
gradient) on random 1-D configurations (kernels wider than the lanes, uneven lengths, stride,
dilation, causal, GQA/MQA, the bias, batch 2, head dims on and off the lanes for q / k), on the
host's build and the narrower builds it runs (AVX2, base); the path is checked to be the one
taken and, where the windows are affine (dilation 1, stride 1), to run super-blocks; its threads'
split gives the same bits; ``TPLAYERS_NA_LINE=0`` and value dims off the lanes run ``na_forward``."""

import ctypes
import random

import pytest
import torch
from na_cases import wide_1d_window
from na_oracle import at_thread_counts, brute_na, check_na1d_case, record_results

import tplayers
from tplayers.ops import na_cpu, na_cpu_plans
from tplayers.ops.na_geometry import kernel_dims, kernel_tables

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _isas():
    """The narrower builds this CPU runs (the base build has 2 fp64 lanes: fewer than the P.V
    kernel's queries per pass elsewhere)."""
    host = na_cpu.host_isa()
    return {"avx512": ["avx2", "base"], "avx2": ["base"]}.get(host, [])


def _spy(monkeypatch):
    return record_results(monkeypatch, na_cpu_plans, "forward_line")


def _line_blocks(monkeypatch, dtype):
    """na_line_blocks of the last c_forward call (its geometry and dims, recorded by a spy)."""
    seen = {}
    real = na_cpu.c_forward

    def spy(q, k, v, table, geo, scale, heads):
        seen["args"] = (geo, q.shape[0], heads, q.shape[-1] // heads, v.shape[-1] // heads)
        return real(q, k, v, table, geo, scale, heads)

    monkeypatch.setattr(na_cpu, "c_forward", spy)
    monkeypatch.setattr(na_cpu, "C_KERNELS", (spy, na_cpu.C_KERNELS[1]))

    def count():
        geo, *rest = seen["args"]
        dims = kernel_dims(geo, *rest)
        rows, cols = kernel_tables(tuple(geo))
        lib = na_cpu.load_library(dtype)
        return lib.na_line_blocks(*(ctypes.c_void_p(t.data_ptr()) for t in (dims, rows, cols)))

    return count


@pytest.mark.parametrize("isa", [None, *_isas()])
def test_random_1d_configurations_match_the_oracle(isa, monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_LINE", raising=False)
    monkeypatch.delenv("TPLAYERS_NA_DIRECT", raising=False)
    if isa:
        monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    else:
        monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    lanes = na_cpu.lanes(torch.float64)
    taken = _spy(monkeypatch)
    line_blocks = _line_blocks(monkeypatch, torch.float64)
    rng = random.Random(33 + lanes)
    affine_runs = 0
    for case in range(10):
        kernel, stride, dil, causal, size, heads, kv_heads, with_bias = wide_1d_window(rng, lanes)
        dim = rng.choice([lanes, 2 * lanes, 3, lanes + 5])  # q / k planes: any head dim
        dim_v = lanes * rng.randint(1, 3)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        where = f"isa {isa} k{kernel} s{stride} d{dil} causal {causal} L{size} heads {heads}/{kv_heads} D {dim}/{dim_v}"
        check_na1d_case(gen, size, heads, kv_heads, dim, dim_v, kernel, stride, dil, causal, with_bias, where, **TIGHT)
        assert taken and taken[-1], f"the line forward did not run: {where}"
        blocks = line_blocks()
        if dil == 1 and stride == 1 and size >= kernel + 2 * lanes:
            assert blocks > 0, f"no super-block ran: {where}"
        affine_runs += blocks > 0
    assert affine_runs >= 3


def test_long_rows_run_full_super_blocks_in_fp32_and_bf16(monkeypatch):
    """A row of several chunks (full super-blocks and partial ones at chunk ends) in the fp32 build,
    against the oracle in fp64, and bf16 inputs (read as bf16 by the fp32 build) against the fp32
    result on the same values."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_LINE", raising=False)
    taken = _spy(monkeypatch)
    lanes = na_cpu.lanes(torch.float32)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1500, 4, 2 * lanes, generator=gen) for _ in range(3))
    kernel = 2 * lanes + 1
    out = tplayers.na1d(q, k, v, kernel)
    assert taken[-1] is True
    ref = brute_na(*(t.double() for t in (q, k, v)), (kernel,))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    out_b = tplayers.na1d(qb, kb, vb, kernel)
    ref_b = tplayers.na1d(qb.float(), kb.float(), vb.float(), kernel)
    torch.testing.assert_close(out_b.float(), ref_b, rtol=2e-2, atol=2e-2)


def test_threads_split_the_planes_bit_for_bit(monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.delenv("TPLAYERS_NA_LINE", raising=False)
    lanes = na_cpu.lanes(torch.float64)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 300, 3, lanes, generator=gen, dtype=torch.float64) for _ in range(3))
    taken = _spy(monkeypatch)
    one, three = at_thread_counts(lambda: tplayers.na1d(q, k, v, lanes + 7))
    assert taken == [True, True]
    assert torch.equal(one, three)


def test_where_it_does_not_apply_na_forward_runs(monkeypatch):
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    lanes = na_cpu.lanes(torch.float64)
    taken = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    # (kernel, value head dim, TPLAYERS_NA_LINE): value dims off the lanes, the switch, a 2-D call
    for kernel, dim_v, flag in [(lanes + 3, lanes + 1, ""), (lanes + 3, lanes, "0")]:
        monkeypatch.setenv("TPLAYERS_NA_LINE", flag)
        q, k = (torch.randn(1, 60, 2, lanes, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(1, 60, 2, dim_v, generator=gen, dtype=torch.float64)
        out = tplayers.na1d(q, k, v, kernel)
        assert taken[-1] is False, (kernel, dim_v, flag)
        torch.testing.assert_close(out, brute_na(q, k, v, (kernel,)), **TIGHT)
    monkeypatch.delenv("TPLAYERS_NA_LINE")
    q, k, v = (torch.randn(1, 12, 12, 2, lanes, generator=gen, dtype=torch.float64) for _ in range(3))
    out = tplayers.na2d(q, k, v, lanes + 1)
    assert taken[-1] is False
    torch.testing.assert_close(out, brute_na(q, k, v, (lanes + 1, lanes + 1)), **TIGHT)
