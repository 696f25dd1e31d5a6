"""tplayers.na2d on one CPU core against the same-run fp32 matmul rate, peak memory vs the
O(B*heads*H*W*k^2) bound, natten.na2d when installed, and 2-rank domain-parallel
NeighborhoodAttention vs single-device. The three CPU kernels are measured: the compiled C kernel
(``TPLAYERS_NA_KERNEL=c``, the default where a C compiler is available; its build time is
printed first, into a fresh cache), the GEMM-tiled torch kernel (``=gemm``) and the torch tile
kernel (``=torch``); torch's compiled ``flex_attention`` with a neighborhood block mask is a
forward peer (``benchmarks/na_flex.py``; no CPU backward in torch 2.13).

    python benchmarks/na.py                # 1x64x64, 4 heads, head_dim 32 and 1x96x96, 2 heads, head_dim 16; kernel 7
    python benchmarks/na.py --repeats 9 --no-domain
    python benchmarks/na.py --isa avx2     # on an AVX-512 CPU: as an AVX2-only CPU would run it
    python benchmarks/na.py --table-only [--isa avx2]   # the kernel table alone, with the 2x-target ceiling lines

Every figure is printed with the ISA it ran on: the host's, the one the C kernel was built for
(its vector lanes and ``-march``) and torch's CPU capability. ``--isa avx2`` (or ``base``) on a
wider CPU builds the C kernel as the host rule builds it on such a CPU (``TPLAYERS_NA_ISA``) and
restarts the script with torch's own kernels, MKL and oneDNN capped at that ISA
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``), so both kernels
and the matmul reference run the narrower instructions.

Rates are useful FLOPs (every query's k^2 scores and k^2 value sums; backward twice the
forward) over thread CPU time (the minimum over interleaved repeats: the machine may be
shared), divided by a 1024^3 fp32 matmul timed the same way in the same run; wall-time
medians are printed beside them (the order of the calls is fixed per repeat, which favours some
kernels by a few percent: an A/A pair of identical builds read 1.03-1.14x apart; issue 35's ratio to
the filing-time kernel is measured in balanced order by ``benchmarks/na_target.py``). One thread per process. natten (optional) runs its CPU
path (the Flex backend without compilation, forward only: natten has no CPU backward).
On a GPU, ``benchmarks/na_gpu.py`` measures the CUDA kernels (compiled ``flex_attention``, the
tile kernel) against natten on the whole tensor and dense SDPA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from memory_probe import peak_bytes  # noqa: E402
from na_flex import flex_peer  # noqa: E402
from na_kernels import (  # noqa: E402
    _cpu_times,
    bench_ranks,
    default_vs_tile,
    isa_label,
    matmul_rate,
    na_cpu_isa,
    use_kernel,
    useful_flops,
)

import tplayers  # noqa: E402


def _natten():
    try:
        import natten
    except ImportError:
        return None
    return natten


def tile_ceiling(size, heads, head_dim, kernel, mm_rate, tile=4, chunk=80):
    """The forward's tile compute alone, as na2d's kernel does it (mask copy + ``baddbmm_``,
    softmax, ``bmm`` with the values) on in-cache tiles, without the gathers, the output
    scatter and the per-chunk dispatch: the ceiling of this formulation, in useful FLOPs over
    the same-run matmul rate."""
    tq, region = tile * tile, (tile + kernel - 1) ** 2
    r = torch.arange(tile + kernel - 1)
    inside_1d = (r[None, :] >= torch.arange(tile)[:, None]) & (r[None, :] < torch.arange(tile)[:, None] + kernel)
    inside = (inside_1d[:, None, :, None] & inside_1d[None, :, None, :]).reshape(tq, region)
    mask = torch.zeros(tq, region).masked_fill_(~inside, float("-inf"))
    q, k, v = (
        torch.randn(chunk, tq, head_dim),
        torch.randn(chunk, region, head_dim),
        torch.randn(chunk, region, head_dim),
    )
    rounds = max(1, heads * size * size // tq // chunk)

    def compute():
        for _ in range(rounds):
            scores = torch.empty(chunk, tq, region)
            scores.copy_(mask.expand(chunk, tq, region)).baddbmm_(q, k.transpose(1, 2), alpha=head_dim**-0.5)
            torch.bmm(torch.softmax(scores, -1), v)

    cpu = _cpu_times({"ceiling": compute}, 5)["ceiling"][0]
    flops = useful_flops(1, size, heads, head_dim, kernel) * rounds * chunk * tq / (heads * size * size)
    return cpu, flops / cpu / mm_rate


KERNELS = ("c", "gemm", "torch")


#: what caps torch (its own kernels, MKL, oneDNN) at an ISA, per --isa value
TORCH_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "base": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def restart_capped(isa: str) -> None:
    """With ``--isa`` narrower than the host's: set ``TPLAYERS_NA_ISA`` and, unless done already,
    restart this script with torch capped at that ISA (the caps are read when torch loads)."""
    from tplayers.ops import na_cpu

    os.environ["TPLAYERS_NA_ISA"] = isa
    na_cpu.target_isa()  # ValueError for an ISA this CPU does not run
    caps = TORCH_CAPS.get(isa, {}) if isa != na_cpu.host_isa() else {}
    if caps and any(os.environ.get(key) != val for key, val in caps.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **caps})


def build_time() -> None:
    """Compile the C kernel (fp32 and fp64) into a fresh temporary cache and print how long it took."""
    import tempfile

    from tplayers.ops import na_cpu

    old = os.environ.get("TPLAYERS_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TPLAYERS_CACHE"] = tmp
        na_cpu._load.cache_clear()
        times = []
        for dtype in (torch.float32, torch.float64):
            start = time.perf_counter()
            na_cpu.load_library(dtype)
            times.append(time.perf_counter() - start)
        na_cpu._load.cache_clear()  # the next call loads from the regular cache
    if old is None:
        del os.environ["TPLAYERS_CACHE"]
    else:
        os.environ["TPLAYERS_CACHE"] = old
    flags = " ".join(na_cpu.build_flags(torch.float32))
    print(
        f"C kernel build (cc {flags}, {len(na_cpu.UNITS)} units side by side, into an empty cache): fp32 {times[0]:.2f} s, fp64 {times[1]:.2f} s "
        f"(once per machine; later processes load the cached library) {isa_label()}"
    )


def bench_single(size, heads, head_dim, kernel, repeats):
    for choice in KERNELS:
        use_kernel(choice)
        _bench_single(size, heads, head_dim, kernel, repeats, choice)
    default_vs_tile(size, heads, head_dim, kernel, repeats)


def _bench_single(size, heads, head_dim, kernel, repeats, choice):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, size, size, heads, head_dim) for _ in range(3))
    print(
        f"na2d [{choice} kernel] 1x{size}x{size}, {heads} heads, head_dim {head_dim}, kernel {kernel}, fp32, 1 thread, "
        f"{repeats} interleaved repeats; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        f"{isa_label()}"
    )
    grads = [x.clone().requires_grad_() for x in (q, k, v)]
    cot = torch.randn_like(q)

    def fwd_bwd():
        for g in grads:
            g.grad = None
        (tplayers.na2d(*grads, kernel) * cot).sum().backward()

    mm_cpu, mm_wall = matmul_rate()
    t = _cpu_times({"fwd": lambda: tplayers.na2d(q, k, v, kernel), "both": fwd_bwd}, repeats)
    mm_cpu2, mm_wall2 = matmul_rate()
    mm_cpu, mm_wall = max(mm_cpu, mm_cpu2), max(mm_wall, mm_wall2)
    flops = useful_flops(1, size, heads, head_dim, kernel)
    fwd_cpu, fwd_wall = t["fwd"]
    bwd_cpu, bwd_wall = t["both"][0] - fwd_cpu, t["both"][1] - fwd_wall
    print(
        f"  single-core fp32 matmul 1024^3 (same run, best of before/after, {torch.get_num_threads()} thread): "
        f"{mm_cpu / 1e9:6.1f} GFLOP/s (CPU time), {mm_wall / 1e9:6.1f} GFLOP/s (wall)"
    )
    print(f"  useful FLOPs: forward {flops / 1e6:.1f} M (B*heads*H*W*k^2*(2D+2Dv)), backward {2 * flops / 1e6:.1f} M")
    for name, c, w, f in (("forward", fwd_cpu, fwd_wall, flops), ("backward", bwd_cpu, bwd_wall, 2 * flops)):
        print(
            f"  {name:8s} {c * 1e3:7.2f} ms CPU = {f / c / 1e9:5.1f} GFLOP/s = {f / c / mm_cpu:.3f} x matmul "
            f"(target 0.25) | wall median {w * 1e3:7.2f} ms = {f / w / mm_wall:.3f} x matmul (wall) "
            f"[{na_cpu_isa()}]"
        )
    if choice == "torch":
        compare_peers(size, heads, head_dim, kernel, mm_cpu, fwd_cpu, q, k, v)


def compare_peers(size, heads, head_dim, kernel, mm_cpu, fwd_cpu, q, k, v):
    """The tile formulation's ceiling and natten's CPU forward (after the torch kernel's figures)."""
    natten = _natten()
    ceil_cpu, ceil_ratio = tile_ceiling(size, heads, head_dim, kernel, mm_cpu)
    print(
        f"  (ceiling of the 4x4-tile formulation: its forward tile compute alone, in cache, no gathers or "
        f"scatter: {ceil_cpu * 1e3:.2f} ms CPU = {ceil_ratio:.3f} x matmul)"
    )
    if natten is not None:

        def natten_fwd():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return natten.na2d(q, k, v, kernel_size=kernel)

        torch.testing.assert_close(tplayers.na2d(q, k, v, kernel), natten_fwd(), rtol=1e-4, atol=1e-4)
        tn = _cpu_times({"natten": natten_fwd}, 3)["natten"][0]
        print(f"  forward   natten.na2d (CPU) {tn * 1e3:9.2f} ms CPU   ratio tplayers/natten = {fwd_cpu / tn:.4f}")
    else:
        print("  forward   natten   MISSING PEER: natten is not installed (pip install natten==0.21.7); no ratio")
    print("  fwd+bwd   natten   MISSING PEER: natten has no CPU backward (its Flex backend refuses it)")
    flex, note = flex_peer(q, k, v, kernel)
    if flex is None:
        print(f"  forward   flex_attention MISSING PEER: {note}")
        return
    ours, theirs = tplayers.na2d(q, k, v, kernel), flex()
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4):
        print(
            f"  forward   torch flex_attention WRONG RESULT here: max |difference| from na2d "
            f"{(ours - theirs).abs().max().item():.3g} (tolerance 1e-4); not timed ({note})"
        )
        return
    tf = _cpu_times({"flex": flex}, 3)["flex"][0]
    flops = useful_flops(1, size, heads, head_dim, kernel)
    print(
        f"  forward   torch flex_attention (compiled, neighborhood block mask) {tf * 1e3:8.2f} ms CPU = "
        f"{flops / tf / mm_cpu:.3f} x matmul; ratio tplayers tile kernel / flex = {fwd_cpu / tf:.3f} ({note})"
    )


def bench_memory(size, heads, head_dim, kernel):
    for choice in KERNELS:
        use_kernel(choice)
        _bench_memory(size, heads, head_dim, kernel, choice)


def _bench_memory(size, heads, head_dim, kernel, choice):
    q, k, v = (torch.randn(1, size, size, heads, head_dim) for _ in range(3))
    bound = heads * size * size * kernel**2 * 4
    dense = heads * (size * size) ** 2 * 4
    cold = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))
    warm = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))
    qg = q.clone().requires_grad_()
    train = peak_bytes(lambda: tplayers.na2d(qg, k, v, kernel).sum().backward())
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    train_all = peak_bytes(lambda: tplayers.na2d(*qkv, kernel).sum().backward())
    qkv = [x.clone().requires_grad_() for x in (q, k, v)]
    cot = torch.randn_like(q)
    train_dense = peak_bytes(lambda: (tplayers.na2d(*qkv, kernel) * cot).sum().backward())
    print(
        f"peak memory na2d [{choice} kernel] 1x{size}x{size}, {heads} heads, head_dim {head_dim}, kernel {kernel} (fp32); "
        f"limit: 4 x bound [{na_cpu_isa()}]"
    )
    print(
        f"  bound B*heads*H*W*k^2*4 = {bound / 2**20:.2f} MiB; one dense attention matrix = {dense / 2**20:.1f} MiB; "
        f"q (= k = v) = {q.numel() * 4 / 2**20:.2f} MiB"
    )
    for name, val in (
        ("forward (first call)", cold),
        ("forward (cached plan)", warm),
        ("forward+backward, dq", train),
        ("forward+backward, dq dk dv", train_all),
        ("fwd+bwd, dq dk dv, dense dO", train_dense),
    ):
        print(
            f"  {name:28s} {val / 2**20:8.2f} MiB = {val / bound:5.2f} x bound (target <= 4) "
            f"= 1/{dense / val:.0f} of dense"
        )


def _domain_rank(rank, world, size, heads, head_dim, kernel, repeats):
    mesh = tplayers.init_mesh(device_type="cpu")
    torch.manual_seed(0)
    serial = tplayers.NeighborhoodAttention(heads * head_dim, heads, kernel, rel_pos_bias=True)
    layer = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=(1,))
    x = torch.randn(1, size, size, heads * head_dim)
    local = tplayers.shard(x, 1, mesh)
    torch.testing.assert_close(tplayers.gather(layer(local), 1, mesh), serial(x), rtol=1e-4, atol=1e-4)

    def step(module, inp):
        def run():
            inp_ = inp.clone().requires_grad_()
            module(inp_).sum().backward()

        return run

    fns = {
        "domain": step(layer, local),
        "single": step(serial, x) if rank == 0 else None,
        "shard_alone": step(serial, local) if rank == 0 else None,
    }  # same compute, no communication
    times = {name: [] for name in fns}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            torch.distributed.barrier()  # every rank, every round: no mismatch
            if fn is None:
                continue
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    times = {name: ts[1:] for name, ts in times.items() if ts}
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_domain(size, heads, head_dim, kernel, repeats):
    from harness import run_ranks

    res = run_ranks(_domain_rank, 2, args=(size, heads, head_dim, kernel, repeats), timeout=600)
    dom = max(r["domain"] for r in res)
    single = res[0]["single"]
    print(
        f"NeighborhoodAttention fwd+bwd 1x{size}x{size}x{heads * head_dim}, kernel {kernel}, rel_pos_bias, "
        f"1 thread per rank (parity checked)"
    )
    print(f"  single device {single * 1e3:8.2f} ms; 2-rank H-sharded {dom * 1e3:8.2f} ms; speed-up {single / dom:.2f}x")
    print(
        f"  (one shard's compute alone, no communication, other rank idle: {res[0]['shard_alone'] * 1e3:8.2f} ms; "
        f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="the first shape (the second is 96x96, 2 heads, d16)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-domain", action="store_true", help="skip the 2-rank NeighborhoodAttention run")
    parser.add_argument(
        "--isa",
        choices=("avx512", "avx2", "base"),
        default=None,
        help="run as a CPU of this ISA would (narrower than the host's: see the module docstring)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory figures")
    parser.add_argument(
        "--ranks-only", action="store_true", help="only the na1d / na3d / wide / GQA shapes (with issue 35's reference)"
    )
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="the kernel comparison alone (the two 2-D shapes, then the --ranks-only shapes), each with issue "
        "35's reference and the 2x target against the machine's matmul rates (torch.mm, oneDNN, FMA peak)",
    )
    args = parser.parse_args()
    if args.isa:
        restart_capped(args.isa)
    torch.set_num_threads(1)  # the rate is per core: matmul reference and na2d on one thread
    start_choice = os.environ.get("TPLAYERS_NA_KERNEL", "")
    if args.ranks_only or args.table_only:
        for size, heads, head_dim in ((args.size, args.heads, args.head_dim), (96, 2, 16)) if args.table_only else ():
            print(f"na2d 1x{size}x{size}, {heads} heads, d{head_dim}, k{args.kernel} {isa_label()}")
            default_vs_tile(size, heads, head_dim, args.kernel, args.repeats)
        bench_ranks(args.repeats)
        return
    build_time()
    shapes = [(args.size, args.heads, args.head_dim), (96, 2, 16)]
    for size, heads, head_dim in shapes:
        bench_single(size, heads, head_dim, args.kernel, args.repeats)
    bench_ranks(args.repeats)
    for size, heads, head_dim in shapes if not args.no_memory else ():
        bench_memory(size, heads, head_dim, args.kernel)
    if not args.no_domain:
        use_kernel(start_choice)  # the layer on the default (or the caller's) kernel
        bench_domain(args.size, args.heads, args.head_dim, args.kernel, args.repeats)


if __name__ == "__main__":
    main()
