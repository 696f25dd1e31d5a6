"""Issue 35, the 1-D forward on the user's layout (``na_forward_1d``, ``tplayers/ops/na_cpu_direct_fwd.c``)
(``TPLAYERS_NA_DIRECT=all``: on every window, not only where it is the default) against the C
kernel's planes (``TPLAYERS_NA_DIRECT=0``) and the filing-time kernel
(``benchmarks/na_reference.py``), one core, na1d 1x4096 (4 heads, d32) k7 and k33: forward, thread
CPU time, minimum over the repeats, the three calls in rotated order (``na_kernels.rotated_times``),
"cold" (a 1024^3 matmul before every timed call) and "warm" (none).

    python benchmarks/na_direct.py [--repeats 15] [--isa avx2]
"""

from __future__ import annotations

import argparse
import os

import torch
from na import restart_capped
from na_kernels import isa_label, matmul_ref, rotated_times, use_kernel
from na_reference import COMMIT, OLD_KERNELS, plane_fn, reference_library

import tplayers

SHAPE = (1, 4096, 4, 32)


def bench(kernel: int, repeats: int, cold: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(*SHAPE) for _ in range(3))
    old = plane_fn(SHAPE, kernel, OLD_KERNELS)

    def now(direct: str):
        def run():
            os.environ["TPLAYERS_NA_DIRECT"] = direct
            return tplayers.na1d(q, k, v, kernel)

        return run

    use_kernel("")
    fns = {"direct": now("all"), "planes": now("0"), "old": lambda: old(q, k, v)}
    t = rotated_times(fns, matmul_ref() if cold else (lambda: None), repeats)
    os.environ["TPLAYERS_NA_DIRECT"] = ""
    print(
        f"na1d {'x'.join(map(str, SHAPE))} k{kernel} {'cold' if cold else 'warm'} forward: "
        f"direct {t['direct'] * 1e3:.3f} ms, planes {t['planes'] * 1e3:.3f} ms, old ({COMMIT}) {t['old'] * 1e3:.3f} ms; "
        f"direct / old {t['old'] / t['direct']:.2f}x, planes / old {t['old'] / t['planes']:.2f}x, "
        f"direct / planes {t['planes'] / t['direct']:.2f}x (speed) [load {os.getloadavg()[0]:.1f}]"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--isa", choices=("avx512", "avx2"), default=None)
    args = parser.parse_args()
    if args.isa:
        restart_capped(args.isa)
    torch.set_num_threads(1)
    print(f"issue 35, na1d forward on the user's layout, 1 thread {isa_label()}")
    if reference_library() is None:
        return
    for cold in (True, False):
        for kernel in (7, 33):
            bench(kernel, args.repeats, cold)


if __name__ == "__main__":
    main()
