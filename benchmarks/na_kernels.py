"""Helpers of ``benchmarks/na.py``: interleaved thread-CPU timing, the same-run matmul rate,
useful FLOPs, the ISA labels, and the per-shape comparison of the three CPU kernels of
neighborhood attention (C, GEMM-tiled, tile) against each other and the matmul rate."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Tuple

import torch
from na_reference import COMMIT, OLD_KERNELS, old_fused, plane_fn, reference_library

import tplayers


def _cpu_times(fns: dict, repeats: int) -> dict:
    """Per function: (min thread CPU seconds, median wall seconds) over interleaved repeats.

    Thread CPU time does not count the time this thread waits for a core another job holds,
    so on a shared machine it tracks the work done; the wall median is printed beside it.
    """
    for fn in fns.values():
        fn()
    cpu, wall = {n: [] for n in fns}, {n: [] for n in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {n: (min(cpu[n]), statistics.median(wall[n])) for n in fns}


def rotated_times(fns: dict, evict, repeats: int) -> dict:
    """Per function: the minimum thread CPU seconds over ``repeats`` rounds, every call after
    ``evict()`` (the same cache state for each), the order of the functions rotated by one each
    round (no function always follows the same one: :func:`_cpu_times`' fixed order biased an A/A
    pair of identical kernels by 1.03-1.14x)."""
    names = list(fns)
    for fn in fns.values():
        fn()
    out = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            evict()
            t0 = time.thread_time()
            fns[n]()
            out[n].append(time.thread_time() - t0)
    return {n: min(v) for n, v in out.items()}


def matmul_rate(repeats: int = 7, n: int = 1024) -> Tuple[float, float]:
    """Single-core fp32 ``n x n`` matmul rate in FLOP/s: (from thread CPU time, from wall time)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    cpu, wall = _cpu_times({"mm": lambda: a @ b}, repeats)["mm"]
    return 2 * n**3 / cpu, 2 * n**3 / wall


def useful_flops(batch, size, heads, head_dim, kernel) -> float:
    """Useful forward FLOPs: every query scores k^2 keys (2*D per score) and sums k^2 values (2*Dv).

    Backward counts twice that: dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (the
    recomputed scores of the flash-style backward are not counted as useful).
    """
    return batch * heads * size * size * kernel**2 * (2 * head_dim + 2 * head_dim)


def use_kernel(choice: str) -> None:
    os.environ["TPLAYERS_NA_KERNEL"] = choice


def isa_label() -> str:
    """``[host avx512 (model); C: avx2 build, 8 fp32 lanes, -march=haswell; torch AVX2]``."""
    from tplayers.ops import na_cpu

    model = (
        next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
            "unknown CPU",
        )
        if os.path.exists("/proc/cpuinfo")
        else "unknown CPU"
    )
    isa = na_cpu.target_isa()
    march = next((f for f in na_cpu.build_flags(torch.float32, isa) if f.startswith("-march")), "no -march")
    return (
        f"[host {na_cpu.host_isa()} ({model}); C: {isa} build, {na_cpu.lanes(torch.float32, isa)} fp32 lanes, "
        f"{march}; torch {torch.backends.cpu.get_cpu_capability()}]"
    )


def default_vs_tile(size, heads, head_dim, kernel, repeats, shape=None, fn=None, kv_heads=None, with_reference=True):
    """Every CPU kernel against the torch tile kernel (and the GEMM kernel against the C kernel),
    forward, backward and both, timed interleaved in one run with the same-run matmul rate: the
    issue-22 ">= 1.0x" check of the default and issue 35's GEMM figures. ``shape`` / ``fn``:
    another input shape and functional (``na1d`` / ``na3d``); ``kv_heads``: fewer key/value heads (GQA)."""
    from tplayers.ops import na_dispatch

    shape, fn = shape or (1, size, size, heads, head_dim), fn or tplayers.na2d
    torch.manual_seed(0)
    kv_shape = (*shape[:-2], kv_heads or shape[-2], shape[-1])
    q, k, v = torch.randn(*shape), torch.randn(*kv_shape), torch.randn(*kv_shape)
    cot = torch.randn_like(q)
    rank = len(shape) - 3
    use_kernel("")
    default = na_dispatch.choose_kernel(q, (1,) * (3 - rank) + (kernel,) * rank, kv_shape[-2] < shape[-2])

    def on(choice, what):
        grads = [x.clone().requires_grad_() for x in (q, k, v)]

        def run():
            use_kernel(choice)
            if what == "fwd":
                return fn(q, k, v, kernel)
            for g in grads:
                g.grad = None
            (fn(*grads, kernel) * cot).sum().backward()

        return run

    names = ("", "c", "gemm", "torch")
    fns = {f"{c} {w}": on(c, w) for c in names for w in ("fwd", "both")}
    old = reference_library() if with_reference and not kv_heads else None
    if old is not None:  # issue 35's reference: the C kernel at its filing, same run
        ref = plane_fn(shape, kernel, OLD_KERNELS)
        grads_ref = [x.clone().requires_grad_() for x in (q, k, v)]

        def ref_both():
            for g in grads_ref:
                g.grad = None
            (ref(*grads_ref).view_as(cot) * cot).sum().backward()

        fns["old fwd"], fns["old both"] = (lambda: ref(q, k, v)), ref_both
    fns["mm"] = matmul_ref()
    fns["mm onednn"] = matmul_onednn()
    t = _cpu_times(fns, repeats)
    mm = 2 * 1024**3 / t["mm"][0]
    flops = useful_flops(1, 1, 1, shape[-1], 1) * math.prod(shape[1:-1]) * kernel**rank

    def parts(c):
        fwd = t[f"{c} fwd"][0]
        return fwd, t[f"{c} both"][0] - fwd, t[f"{c} both"][0]

    label = "" if size else f"{fn.__name__} {'x'.join(map(str, shape))} k{kernel}: "
    label += f"(GQA: {kv_shape[-2]} key/value heads) " if kv_heads else ""
    tile = parts("torch")
    speed = {c: [a / b for a, b in zip(tile, parts(c))] for c in names}
    vs_c = [a / b for a, b in zip(parts("c"), parts("gemm"))]
    print(
        f"  {label}default kernel here: {default}; speed over the torch tile kernel (same run, interleaved, thread "
        f"CPU time): forward {speed[''][0]:.2f}x, backward {speed[''][1]:.2f}x, forward+backward {speed[''][2]:.2f}x "
        f"(target >= 1.0) [{na_cpu_isa()}]"
    )
    for c in ("c", "gemm", "torch"):
        fwd, bwd, _ = parts(c)
        print(
            f"    {c:5s} kernel: forward {fwd * 1e3:7.2f} ms = {flops / fwd / mm:.3f} x matmul, backward "
            f"{bwd * 1e3:7.2f} ms = {2 * flops / bwd / mm:.3f} x matmul; over the tile kernel: forward "
            f"{speed[c][0]:.2f}x, backward {speed[c][1]:.2f}x"
        )
    print(
        f"    GEMM kernel over the C kernel: forward {vs_c[0]:.2f}x, backward {vs_c[1]:.2f}x, both {vs_c[2]:.2f}x "
        f"(matmul 1024^3 same run {mm / 1e9:.1f} GFLOP/s)"
    )
    if old is not None:
        ref_f, ref_b, _ = parts("old")
        # the old routing ran the tile kernel's backward where its C backward was unfused
        ref_route = ref_b if old_fused(kernel) else tile[1]
        now_f, now_b, _ = parts("c")  # the default here; "c" and "old" both follow a fwd+bwd on these inputs
        print(
            f"    issue 35 reference, the C kernel at its filing ({COMMIT}, same build flags, same run): forward "
            f"{ref_f * 1e3:7.2f} ms = {flops / ref_f / mm:.3f} x matmul, its own C backward {ref_b * 1e3:7.2f} ms; "
            f"the C kernel now over it: forward {ref_f / now_f:.2f}x, backward {ref_route / now_b:.2f}x over its "
            f"routed backward ({'C' if old_fused(kernel) else 'the tile kernel, today'}), {ref_b / now_b:.2f}x over "
            f"its C backward (target >= 2.0) [{na_cpu_isa()}; load {os.getloadavg()[0]:.1f}]"
        )
        rates = {"mm": mm, "onednn": 2 * 1024**3 / t["mm onednn"][0], "fma": fma_peak()}
        print(ceiling_line(flops, rates, (ref_f, ref_route), (now_f, now_b)))
    use_kernel("")


#: a fraction of the machine's best same-run matmul rate at or above which "2x the old kernel" is
#: taken as out of reach: neighborhood attention does a GEMM's work in small, window-shaped pieces
#: plus a softmax (exp, max, sums) the useful FLOPs do not count
CEILING = 0.9

FMA_SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#if W == 16
typedef __m512 V;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
#else
typedef __m256 V;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
#endif
int main(void) {  /* 12 independent chains of fp32 FMAs: the core's FMA throughput */
    V a[12], b = SET(0.9999999f), c = SET(1e-8f);
    for (int i = 0; i < 12; i++) a[i] = SET(1.0f + i * 1e-7f);
    long n = 100000000L / (W / 8);
    struct timespec t0, t1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = FMA(a[j], b, c);
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    float sink[W];
    for (int j = 1; j < 12; j++) a[0] = FMA(a[0], b, a[j]);
    *(V *)sink = a[0];
    double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    printf("%f %f\n", 2.0 * W * 12 * n / s, sink[0]);
    return 0;
}
"""


def fma_peak() -> float:
    """The core's fp32 FMA throughput in FLOP/s (thread CPU time) at the C kernel's ISA (16 lanes
    on AVX-512, 8 on AVX2), from a 12-chain FMA loop compiled with the system compiler; 0 when
    that fails."""
    import subprocess
    import tempfile

    from tplayers.ops import na_cpu

    isa = na_cpu.target_isa()
    if isa not in ("avx512", "avx2"):
        return 0.0
    march = "-march=native" if isa == na_cpu.host_isa() else f"-march={na_cpu.ISAS[isa][1]}"
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma")
        with open(src, "w") as f:
            f.write(FMA_SOURCE)
        cc = os.environ.get("CC") or "cc"
        width = "16" if isa == "avx512" else "8"
        try:
            subprocess.run([cc, "-O2", march, f"-DW={width}", src, "-o", exe], check=True, capture_output=True)
            return max(float(subprocess.run([exe], capture_output=True, text=True).stdout.split()[0]) for _ in range(3))
        except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
            return 0.0


def matmul_onednn():
    """A 1024^3 fp32 matmul through oneDNN (``F.linear`` on mkldnn tensors): on AMD CPUs MKL's
    ``torch.mm`` does not run its AVX-512 path, oneDNN does."""
    a, b = torch.randn(1024, 1024).to_mkldnn(), torch.randn(1024, 1024).to_mkldnn()
    return lambda: torch.nn.functional.linear(a, b)


def ceiling_line(flops: float, rates: dict, old: Tuple[float, float], now: Tuple[float, float]) -> str:
    """Issue 35's "2x the filing-time kernel" as a fraction of the same-run matmul rates: the old
    kernel's useful-FLOP fraction, twice it (what the target needs), and today's, forward and
    backward (``old`` / ``now``: seconds; backward FLOPs are twice the forward's). ``rates``: FLOP/s
    of ``torch.mm`` (MKL, the issue's yardstick), oneDNN's matmul and the FMA peak; the verdict is
    against the faster matmul."""
    best = max(rates["mm"], rates["onednn"])
    lines = [
        f"    2x target vs the machine: matmul torch.mm (MKL) {rates['mm'] / 1e9:.0f}, oneDNN {rates['onednn'] / 1e9:.0f}, "
        f"FMA peak {rates['fma'] / 1e9:.0f} GFLOP/s [{na_cpu_isa()}]"
    ]
    for what, work, t_old, t_now in (("forward", flops, old[0], now[0]), ("backward", 2 * flops, old[1], now[1])):
        r_old, r_now = work / t_old, work / t_now
        need = 2 * r_old / best
        verdict = "at or above" if need >= CEILING else "below"
        lines.append(
            f"      {what:8s}: old {r_old / 1e9:5.1f} GFLOP/s = {r_old / rates['mm']:.3f} x torch.mm, "
            f"{r_old / best:.3f} x best matmul; the 2x target needs {2 * r_old / rates['mm']:.3f} x torch.mm = "
            f"{need:.3f} x best matmul ({verdict} the ceiling {CEILING})"
            + (f" = {2 * r_old / rates['fma']:.3f} x FMA peak" if rates["fma"] else "")
            + f"; today {r_now / 1e9:5.1f} GFLOP/s = {r_now / best:.3f} x best matmul ({r_now / r_old / 2:.2f} of the target)"
        )
    return "\n".join(lines)


def matmul_ref():
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return lambda: a @ b


def bench_ranks(repeats):
    """1-D and 3-D: the default against the tile kernel (short and long 1-D windows, a 3-D volume)."""
    print(f"na1d / na3d, fp32, 1 thread {isa_label()}")
    for shape, fn, kernel, kv_heads in (
        ((1, 4096, 4, 32), tplayers.na1d, 7, None),
        ((1, 4096, 4, 32), tplayers.na1d, 33, None),
        ((1, 16, 16, 16, 4, 32), tplayers.na3d, 5, None),
        ((1, 48, 48, 4, 32), tplayers.na2d, 19, None),
        ((1, 64, 64, 8, 32), tplayers.na2d, 7, 2),
    ):
        default_vs_tile(0, 0, 0, kernel, repeats, shape, fn, kv_heads)


def na_cpu_isa() -> str:
    """The short ISA tag printed on each figure: the C build's ISA and lanes, torch's capability."""
    from tplayers.ops import na_cpu

    isa = na_cpu.target_isa()
    return f"C {isa} x{na_cpu.lanes(torch.float32, isa)}, torch {torch.backends.cpu.get_cpu_capability()}"
