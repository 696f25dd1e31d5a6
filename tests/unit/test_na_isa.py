"""The C kernel's vector width follows the host's ISA (issue 22): AVX-512 16 fp32 / 8 fp64 lanes,
AVX2 8 / 4, anything else 4 / 2; ``TPLAYERS_NA_ISA`` builds for a narrower ISA the host runs (how
the AVX2 build is measured and tested on an AVX-512 machine), never a wider one; each ISA's build
agrees with the oracle."""

import random

import pytest
import torch
from na_cases import isas_this_host_runs, na_on_subwindow
from na_oracle import assert_out_and_grads, brute_na2d

from tplayers.ops import na_cpu

AVX512 = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni"
AVX2 = "flags\t\t: fpu sse2 avx avx2 fma bmi2"


def test_host_isa_from_flags():
    assert na_cpu.host_isa(AVX512) == "avx512"
    assert na_cpu.host_isa(AVX2) == "avx2"
    assert na_cpu.host_isa("flags : fpu sse2 avx avx512f") == "base"  # no AVX2/FMA, no BW/VL
    assert na_cpu.host_isa("flags : fpu sse2 avx avx2 avx512f") == "base"  # AVX2 without FMA
    assert na_cpu.host_isa("Features : fp asimd") == "base"
    assert na_cpu.host_isa() in na_cpu.ISAS


def test_lanes_and_flags_per_isa():
    assert [na_cpu.lanes(torch.float32, isa) for isa in ("avx512", "avx2", "base")] == [16, 8, 4]
    assert [na_cpu.lanes(torch.float64, isa) for isa in ("avx512", "avx2", "base")] == [8, 4, 2]
    host = na_cpu.host_isa()
    own = na_cpu.build_flags(torch.float32, host)
    assert "-march=native" in own and f"-DNA_LANES={na_cpu.lanes(torch.float32, host)}" in own
    if host == "avx512":
        avx2 = na_cpu.build_flags(torch.float64, "avx2")
        assert "-march=haswell" in avx2 and "-DNA_LANES=4" in avx2 and "-DNA_DOUBLE" in avx2


def test_target_isa_override_and_errors(monkeypatch):
    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    assert na_cpu.target_isa() == na_cpu.host_isa()
    for isa in isas_this_host_runs():
        monkeypatch.setenv("TPLAYERS_NA_ISA", isa.upper())
        assert na_cpu.target_isa() == isa
    monkeypatch.setenv("TPLAYERS_NA_ISA", "sve")
    with pytest.raises(ValueError, match=r"TPLAYERS_NA_ISA must be one of .* got 'sve'"):
        na_cpu.target_isa()
    wider = list(na_cpu.ISAS)[: list(na_cpu.ISAS).index(na_cpu.host_isa())]
    for isa in wider:  # a wider ISA than the host's would build a kernel that dies of SIGILL
        monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
        with pytest.raises(ValueError, match=f"host ISA {na_cpu.host_isa()}.*got '{isa}'"):
            na_cpu.target_isa()


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_each_isa_build_matches_the_oracle(isa, monkeypatch):
    """The build for each ISA this host runs (its lanes: blocks, shuffles, transposes and the exp
    at that width), fp64 and fp32 against the fp64 oracle, random kernels, dilation, causal, bias
    and a query sub-window, and a window whose border blocks' dK / dV fill two key registers."""
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    rng = random.Random(f"isa {isa}")
    border = ((5, 5), (1, 2), (False, True), (9, 30))  # shuffled border blocks whose keys fill two registers
    for n in range(4):
        kernel = (rng.randint(2, 7), rng.randint(2, 9))
        dilation = (rng.choice([1, 2]), rng.choice([1, 2]))
        causal = (rng.random() < 0.3, rng.random() < 0.3)
        h, w = (kk * d + rng.choice([0, 2, 11, 19]) for kk, d in zip(kernel, dilation))
        if n == 3:
            kernel, dilation, causal, (h, w) = border
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        dim = rng.choice([3, 8, 16])
        q, k, v = (torch.randn(2, h, w, 2, dim, generator=gen, dtype=torch.float64) for _ in range(3))
        rpb = torch.randn(2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])
        q0, q1 = sorted(rng.sample(range(h + 1), 2))
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = na_on_subwindow(ins, (h, w), kernel, dilation, causal, (q0, q1, 0, w))
        where = f"isa {isa} kernel {kernel} dilation {dilation} causal {causal} size {(h, w)} rows {(q0, q1)}"
        assert_out_and_grads(out, ref[:, q0:q1], ins, ref_in, gen, where, rtol=1e-10, atol=1e-12)
        # fp32 (twice the lanes: other blocks, folds and shuffles) against the fp64 oracle
        ins = [t.float().requires_grad_() for t in (q, k, v, rpb)]
        out = na_on_subwindow(ins, (h, w), kernel, dilation, causal, (q0, q1, 0, w))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])[:, q0:q1]
        assert_out_and_grads(out, ref, ins, ref_in, gen, f"fp32 {where}", rtol=1e-4, atol=1e-4)


def test_backward_choice_follows_the_fused_rule(monkeypatch):
    """The C backward runs where its dK/dV sums stay in registers ((kW - 1) * dW <= lanes), the
    tile kernel's elsewhere; both exact against the oracle (fp64, a wide and a narrow window)."""
    from tplayers.ops.na_geometry import Axis, geometry_args

    monkeypatch.delenv("TPLAYERS_NA_ISA", raising=False)
    n = na_cpu.lanes(torch.float64)
    wide = geometry_args([Axis(30, 3), Axis(40, n + 2)], 1, 1)
    narrow = geometry_args([Axis(30, 3), Axis(40, n // 2 + 1, dilation=2)], 1, 1)
    assert not na_cpu.backward_is_fused(wide, torch.float64) and na_cpu.backward_is_fused(narrow, torch.float64)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    gen = torch.Generator().manual_seed(1)
    for kernel, dil in (((3, n + 2), (1, 1)), ((3, n // 2 + 1), (1, 2))):
        q, k, v = (torch.randn(1, 9, 2 * n + 9, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        out = na_on_subwindow(ins + [None], (9, 2 * n + 9), kernel, dil, (False, True), (0, 9, 0, 2 * n + 9))
        ref = brute_na2d(*ref_in, kernel, dil, (False, True))
        assert_out_and_grads(out, ref, ins, ref_in, gen, f"kernel {kernel} dilation {dil}", rtol=1e-10, atol=1e-12)
