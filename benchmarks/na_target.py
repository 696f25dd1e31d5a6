"""Issue 35's "na1d and na3d at least 2x today's kernel", measured with the order of the calls balanced,
and the target placed against the machine: the filing-time C kernel (``benchmarks/na_reference.py``)
and the C kernel now, one core, on na1d 1x4096 (4 heads, d32) k7 and k33 and na3d 1x16^3 (4 heads,
d32) k5.

``benchmarks/na.py`` times its kernels in one fixed order per repeat (each call finds the cache as
the previous call left it); an A/A check of two identical builds in that arrangement read 1.03-1.14x
apart. Here every timed call follows the same 1024^3 matmul (the same cache state: the matmul's
operands evict the inputs' lines) and the order of "now" and "old" alternates per repeat (an A/A
check then reads 0.94-1.02x): "cold". A second pass runs without the matmul ("warm": the inputs stay
in the caches between the two kernels' calls, but the forward + backward calls run between the forward
calls), and a third with each kernel's calls in a row ("hot": the inputs as the same kernel's previous
call left them, as a loop over one layer finds them). Minimum thread CPU time over the repeats.

For each shape it prints the old and today's useful FLOP/s as fractions of the same-run matmul rates
(``torch.mm``, i.e. MKL, issue 35's yardstick; oneDNN's matmul; the core's FMA peak, a compiled
12-chain FMA loop) and the fraction the 2x target needs (:func:`na_kernels.ceiling_line`). On AMD
CPUs MKL does not run its AVX-512 path, so ``torch.mm`` there is about 0.45x of oneDNN's matmul.

    python benchmarks/na_target.py [--repeats 9] [--isa avx2]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from na import restart_capped
from na_kernels import ceiling_line, fma_peak, isa_label, matmul_onednn, matmul_ref, use_kernel
from na_reference import COMMIT, OLD_KERNELS, old_fused, plane_fn, reference_library

import tplayers

SHAPES = (
    ((1, 4096, 4, 32), tplayers.na1d, 7),
    ((1, 4096, 4, 32), tplayers.na1d, 33),
    ((1, 16, 16, 16, 4, 32), tplayers.na3d, 5),
)


def balanced_times(pairs: dict, evict, repeats: int, runs: int = 1) -> dict:
    """Per name of ``pairs`` (``name -> (fn_a, fn_b)``): the minimum thread CPU seconds of each of
    its two functions, a and b alternating who goes first; per turn ``evict()``, then one timed call,
    or with ``runs`` > 1 one untimed call and ``runs`` timed calls in a row (each finding the inputs
    where its own previous call left them)."""
    for a, b in pairs.values():
        a(), b()
    out = {name: ([], []) for name in pairs}
    for r in range(repeats):
        for name, fns in pairs.items():
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                evict()
                if runs > 1:
                    fns[i]()
                for _ in range(runs):
                    t0 = time.thread_time()
                    fns[i]()
                    out[name][i].append(time.thread_time() - t0)
    return {name: (min(a), min(b)) for name, (a, b) in out.items()}


def bench(shape, fn, kernel, repeats, mode: str):
    cold = mode == "cold"
    torch.manual_seed(0)
    q, k, v, cot = (torch.randn(*shape) for _ in range(4))
    old = plane_fn(shape, kernel, OLD_KERNELS)
    grads = [[x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2)]

    def now_fwd():
        use_kernel("")
        return fn(q, k, v, kernel)

    def step(call, leaves, choice):
        def run():
            use_kernel(choice)
            for g in leaves:
                g.grad = None
            (call(*leaves).view_as(cot) * cot).sum().backward()

        return run

    # the old routing: its own C backward where fused, else today's tile kernel's backward
    old_both = step(old, grads[1], "") if old_fused(kernel) else step(lambda *t: fn(*t, kernel), grads[1], "torch")
    pairs = {
        "fwd": (now_fwd, lambda: old(q, k, v)),
        "both": (step(lambda *t: fn(*t, kernel), grads[0], ""), old_both),
    }
    mm, onednn = matmul_ref(), matmul_onednn()
    evict = mm if cold else (lambda: None)
    runs = 5 if mode == "hot" else 1
    t = balanced_times(pairs, evict, repeats, runs)
    rate = {n: min(balanced_times({n: (f, f)}, lambda: None, repeats)[n]) for n, f in (("mm", mm), ("onednn", onednn))}
    rates = {"mm": 2 * 1024**3 / rate["mm"], "onednn": 2 * 1024**3 / rate["onednn"], "fma": fma_peak()}
    use_kernel("")
    if old_fused(kernel):  # the old kernel's own forward + backward
        old_f, old_b = t["fwd"][1], t["both"][1] - t["fwd"][1]
    else:  # the old forward, then today's tile kernel's backward (both of the tile kernel less its forward)
        use_kernel("torch")
        tile = {"f": (lambda: fn(q, k, v, kernel),) * 2}
        tile_fwd = min(balanced_times(tile, evict, repeats, runs)["f"])
        old_f, old_b = t["fwd"][1], t["both"][1] - tile_fwd
    now_f, now_b = t["fwd"][0], t["both"][0] - t["fwd"][0]
    flops = 4 * shape[-1] * math.prod(shape[1:-1]) * kernel ** (len(shape) - 3)
    print(
        f"{fn.__name__} {'x'.join(map(str, shape))} k{kernel}, {mode}: now / old ({COMMIT}) "
        "speed, balanced order, same run: "
        f"forward {old_f / now_f:.2f}x ({now_f * 1e3:.3f} / {old_f * 1e3:.3f} ms), backward {old_b / now_b:.2f}x "
        f"({now_b * 1e3:.3f} / {old_b * 1e3:.3f} ms; old: {'its C backward' if old_fused(kernel) else 'the tile kernel'})"
        f" (target >= 2.0) [load {os.getloadavg()[0]:.1f}]"
    )
    print(ceiling_line(flops, rates, (old_f, old_b), (now_f, now_b)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--isa", choices=("avx512", "avx2"), default=None)
    args = parser.parse_args()
    if args.isa:
        restart_capped(args.isa)
    torch.set_num_threads(1)
    print(f"issue 35's 2x target, 1 thread {isa_label()}")
    if reference_library() is None:
        return
    for mode, what in (
        ("cold", "a 1024^3 matmul before every timed call (its 12 MiB evict the inputs)"),
        ("warm", "no eviction (each call finds the inputs where the other kernel's call on them left them)"),
        ("hot", "each kernel's calls in a row (each call finds the inputs where its own previous call left them)"),
    ):
        print(f"{mode}: {what}")
        for shape, fn, kernel in SHAPES:
            bench(shape, fn, kernel, args.repeats, mode)


if __name__ == "__main__":
    main()
