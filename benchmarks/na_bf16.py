"""bf16 neighborhood attention on one CPU core (issue 35, "bf16 where the CPU has it"): the routes
measured against each other and against fp32, interleaved in one run, with the same-run fp32
matmul rate and the ISA printed.

Routes, all on the same inputs (bf16 ones rounded from the fp32 ones):

* ``fp32 C``: fp32 q, k, v on the default kernel (the compiled C kernel);
* ``bf16 default``: bf16 q, k, v on the default route (what ``tplayers.na2d`` does with bf16): the
  fp32 C kernel reads them as bf16, widening them as its transposes load them, computes in fp32, and
  the output is rounded to bf16;
* ``bf16 C reads bf16`` / ``bf16 C converted``: the fair pair of the two C routes, both called the
  same way (the autograd function on pixel-major tensors, no engine; output rounded to bf16): the
  kernel reading bf16 itself (the default's route), and fp32 copies of q, k, v made first (the
  route before the kernel read bf16);
* ``bf16 GEMM fp32``: the same conversion around the GEMM-tiled torch kernel (``TPLAYERS_NA_KERNEL=gemm``);
* ``bf16 GEMM native``: the GEMM-tiled kernel run directly on bf16 tensors: bf16 ``baddbmm`` /
  ``bmm`` (oneDNN, ``avx512_bf16`` where the CPU has it), softmax and ``index_add_`` in bf16 (not
  a route the library takes: its gradient sums are bf16);
* ``bf16 matmul``: a 1024^3 bf16 matmul, to show what the CPU's bf16 instructions give a large GEMM.

    python benchmarks/na_bf16.py [--repeats 7] [--isa avx2]

``--isa avx2`` builds the C kernel for AVX2 and restarts with torch capped at AVX2 (as
``benchmarks/na.py``). Every timed call follows a 1024^3 fp32 matmul (its operands evict the
inputs: the same, cold, cache state for every route) and the order of the calls rotates each
repeat (:func:`na_kernels.rotated_times`). Rates: useful FLOPs over thread CPU time (minimum over
the repeats) over the fp32 matmul's; "x fp32": speed over the fp32 C kernel in the same run.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from na import restart_capped
from na_kernels import isa_label, matmul_ref, na_cpu_isa, rotated_times, use_kernel
from na_reference import plane_fn

import tplayers
from tplayers.ops import na_cpu
from tplayers.ops.na_engine import fp32_kernels
from tplayers.ops.na_gemm import GEMM_KERNELS

SHAPES = (
    ((1, 64, 64, 4, 32), tplayers.na2d, 7),
    ((1, 96, 96, 2, 16), tplayers.na2d, 7),
    ((1, 4096, 4, 32), tplayers.na1d, 7),
    ((1, 4096, 4, 32), tplayers.na1d, 33),
    ((1, 16, 16, 16, 4, 32), tplayers.na3d, 5),
)


def _rounded(fn):
    return lambda *t: fn(*t).to(torch.bfloat16)


def _step(fn, ins, cot, what, choice=""):
    grads = [x.clone().requires_grad_() for x in ins]

    def run():
        use_kernel(choice)
        if what == "fwd":
            return fn(*ins)
        for g in grads:
            g.grad = None
        (fn(*grads).view_as(cot) * cot).sum().backward()

    return run


def bench(shape, fn, kernel, repeats):
    torch.manual_seed(0)
    q, k, v, cot = (torch.randn(*shape) for _ in range(4))
    low = [t.bfloat16() for t in (q, k, v, cot)]

    def call(a, b, c):
        return fn(a, b, c, kernel)

    routes = {
        "fp32 C": (call, (q, k, v), cot, ""),
        "bf16 default": (call, low[:3], low[3], ""),
        "bf16 C reads bf16": (
            _rounded(plane_fn(shape, kernel, fp32_kernels(na_cpu.C_KERNELS, convert=False))),
            low[:3],
            low[3],
            "",
        ),
        "bf16 C converted": (_rounded(plane_fn(shape, kernel, fp32_kernels(na_cpu.C_KERNELS))), low[:3], low[3], ""),
        "bf16 GEMM fp32": (call, low[:3], low[3], "gemm"),
        "bf16 GEMM native": (plane_fn(shape, kernel, GEMM_KERNELS), low[:3], low[3], ""),
    }
    fns = {f"{name} {w}": _step(f, ins, c, w, ch) for name, (f, ins, c, ch) in routes.items() for w in ("fwd", "both")}
    mm_fn = matmul_ref()
    t = {n: (v,) for n, v in rotated_times(fns, mm_fn, repeats).items()}
    a16, b16 = torch.randn(1024, 1024).bfloat16(), torch.randn(1024, 1024).bfloat16()
    t.update({n: (v,) for n, v in rotated_times({"mm": mm_fn, "mm bf16": lambda: a16 @ b16}, lambda: None, 3).items()})
    use_kernel("")
    mm = 2 * 1024**3 / t["mm"][0]
    flops = 4 * shape[-1] * math.prod(shape[1:-1]) * kernel ** (len(shape) - 3)
    print(
        f"{fn.__name__} {'x'.join(map(str, shape))} k{kernel}: matmul fp32 {mm / 1e9:.1f} GFLOP/s, bf16 "
        f"{2 * 1024**3 / t['mm bf16'][0] / 1e9:.1f} GFLOP/s [{na_cpu_isa()}; load {os.getloadavg()[0]:.1f}]"
    )
    base_f = t["fp32 C fwd"][0]
    base_b = t["fp32 C both"][0] - base_f
    for name in routes:
        fwd = t[f"{name} fwd"][0]
        bwd = t[f"{name} both"][0] - fwd
        print(
            f"  {name:17s} forward {fwd * 1e3:7.2f} ms = {flops / fwd / mm:.3f} x mm ({base_f / fwd:.2f}x fp32), "
            f"backward {bwd * 1e3:7.2f} ms = {2 * flops / bwd / mm:.3f} x mm ({base_b / bwd:.2f}x fp32)"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", choices=("avx512", "avx2"), default=None)
    args = parser.parse_args()
    if args.isa:
        restart_capped(args.isa)
    torch.set_num_threads(1)
    print(f"bf16 neighborhood attention, 1 thread {isa_label()}")
    for shape, fn, kernel in SHAPES:
        bench(shape, fn, kernel, args.repeats)


if __name__ == "__main__":
    main()
