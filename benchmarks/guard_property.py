"""The long run of the property test that hunts silent paths in the domain-region guard (issue 33 item 6).

Random small models (``tests/guard_property.py``: convolutions, transposed convolutions, norms, pools,
module and functional interpolation, reductions, per-pixel linears on flattened pixels, attention over
pixels, residuals, skip concatenations, refused ops; plans on the root, containers, leaves, mixtures,
type keys; calls through ``forward`` and another method; random uneven partitions) on 2 ranks, 3 ranks
and a 2 x 2 mesh, each against the serial model in fp64. Prints how many graphs ran and how many were
exact, refused on every rank, silent, crashed or split; exits non-zero on any of the last three.

    python benchmarks/guard_property.py --graphs 2000
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from guard_property import run_graphs  # noqa: E402
from harness import run_ranks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=2000, help="graphs in all (split 2 : 1.5 : 1.5 by mesh)")
    parser.add_argument("--seed", type=int, default=1_000_000)
    args = parser.parse_args()
    n2 = args.graphs * 2 // 5
    n3 = (args.graphs - n2) // 2
    plan = [(2, None, n2), (3, None, n3), (4, (2, 2), args.graphs - n2 - n3)]
    total = {"exact": 0, "refused": 0, "silent": 0, "crash": 0, "split": 0}
    bad = []
    start = time.perf_counter()
    for i, (world, shape, count) in enumerate(plan):
        seed = args.seed + i * 10_000_000
        t0 = time.perf_counter()
        counts, cases = run_ranks(run_graphs, world, args=(seed, count, shape), timeout=3600)[0]
        print(
            f"{world} ranks {shape or '(1-D)'}: {count} graphs in {time.perf_counter() - t0:.0f} s: {counts}",
            flush=True,
        )
        for k in total:
            total[k] += counts[k]
        for why, n in cases["reasons"][:6]:
            print(f"    refused {n:4d}x: {why}")
        bad += [f"[{k}] {c}" for k in ("silent", "crash", "split") for c in cases[k]]
    ran = sum(total.values())
    print(
        f"{ran} graphs in {time.perf_counter() - start:.0f} s: {total['exact']} exact, {total['refused']} refused "
        f"on every rank, {total['silent']} silent, {total['crash']} crashed, {total['split']} split"
    )
    for line in bad:
        print(line)
    return 1 if total["silent"] or total["crash"] or total["split"] else 0


if __name__ == "__main__":
    sys.exit(main())
