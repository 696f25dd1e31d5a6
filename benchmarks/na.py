"""tplayers.na2d vs natten.na2d on the CPU, peak memory vs the O(B*heads*H*W*k^2) bound, and
2-rank domain-parallel NeighborhoodAttention vs single-device.

    python benchmarks/na.py                # defaults: 1x64x64, 4 heads, head_dim 32, kernel 7
    python benchmarks/na.py --repeats 7 --size 64 --kernel 7

Timings are medians of interleaved repeats (the machine may be shared), one thread per process.
natten (``pip install natten==0.21.7``, optional) runs its CPU path: the Flex backend without
compilation, forward only (natten has no CPU backward). Its backward is reported as missing;
for a backward reference the same dense masked attention natten's CPU path computes is timed.
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

import tplayers  # noqa: E402
from memory_probe import peak_bytes  # noqa: E402


def _natten():
    try:
        import natten
    except ImportError:
        return None
    return natten


def _interleaved(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up (caches, first-call allocations)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _dense_masked(q, k, v, kernel):
    """The dense computation natten's CPU (Flex, uncompiled) path performs: (HW)^2 masked scores."""
    b, h, w, heads, d = q.shape
    rows = torch.arange(h)
    cols = torch.arange(w)
    start_h = (rows - kernel // 2).clamp(0, h - kernel)
    start_w = (cols - kernel // 2).clamp(0, w - kernel)
    in_h = (rows[None, :] >= start_h[:, None]) & (rows[None, :] < start_h[:, None] + kernel)
    in_w = (cols[None, :] >= start_w[:, None]) & (cols[None, :] < start_w[:, None] + kernel)
    mask = (in_h[:, None, :, None] & in_w[None, :, None, :]).reshape(h * w, h * w)
    flat = lambda t: t.reshape(b, h * w, heads, d).transpose(1, 2)  # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(b, h, w, heads, d)


def bench_single(size, heads, head_dim, kernel, repeats):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, size, size, heads, head_dim) for _ in range(3))
    natten = _natten()
    print(f"na2d 1x{size}x{size}, {heads} heads, head_dim {head_dim}, kernel {kernel}, fp32, 1 thread, "
          f"median of {repeats}")
    fwd = {"tplayers": lambda: tplayers.na2d(q, k, v, kernel)}
    if natten is not None:
        def natten_fwd():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return natten.na2d(q, k, v, kernel_size=kernel)
        fwd["natten"] = natten_fwd
        torch.testing.assert_close(fwd["tplayers"](), natten_fwd(), rtol=1e-4, atol=1e-4)
    t = _interleaved(fwd, repeats)
    print(f"  forward   tplayers {t['tplayers'] * 1e3:9.2f} ms")
    if natten is not None:
        print(f"  forward   natten   {t['natten'] * 1e3:9.2f} ms   ratio tplayers/natten = "
              f"{t['tplayers'] / t['natten']:.4f}")
    else:
        print("  forward   natten   MISSING PEER: natten is not installed (pip install natten==0.21.7); no ratio")
    grads = [x.clone().requires_grad_() for x in (q, k, v)]
    cot = torch.randn_like(q)

    def fwd_bwd(fn):
        def run():
            for g in grads:
                g.grad = None
            (fn(*grads) * cot).sum().backward()
        return run

    both = {"tplayers": fwd_bwd(lambda a, b, c: tplayers.na2d(a, b, c, kernel)),
            "dense": fwd_bwd(lambda a, b, c: _dense_masked(a, b, c, kernel))}
    t = _interleaved(both, max(3, repeats // 2))
    print(f"  fwd+bwd   tplayers {t['tplayers'] * 1e3:9.2f} ms")
    print("  fwd+bwd   natten   MISSING PEER: natten has no CPU backward (its Flex backend refuses it)")
    print(f"  fwd+bwd   dense masked attention (natten's CPU computation) {t['dense'] * 1e3:9.2f} ms   ratio "
          f"tplayers/dense = {t['tplayers'] / t['dense']:.4f}")


def bench_memory(size, heads, head_dim, kernel):
    q, k, v = (torch.randn(1, size, size, heads, head_dim) for _ in range(3))
    bound = heads * size * size * kernel ** 2 * 4
    dense = heads * (size * size) ** 2 * 4
    cold = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))
    warm = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))
    qg = q.clone().requires_grad_()
    train = peak_bytes(lambda: tplayers.na2d(qg, k, v, kernel).sum().backward())
    print(f"peak memory na2d 1x{size}x{size}, {heads} heads, head_dim {head_dim}, kernel {kernel} (fp32)")
    print(f"  bound B*heads*H*W*k^2*4 = {bound / 2**20:.2f} MiB; one dense attention matrix = {dense / 2**20:.1f} MiB")
    for name, val in (("forward (first call)", cold), ("forward (cached mask)", warm), ("forward+backward", train)):
        print(f"  {name:22s} {val / 2**20:8.2f} MiB = {val / bound:5.2f} x bound = 1/{dense / val:.0f} of dense")


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

    fns = {"domain": step(layer, local), "single": step(serial, x) if rank == 0 else None,
           "shard_alone": step(serial, local) if rank == 0 else None}  # same compute, no communication
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
    print(f"NeighborhoodAttention fwd+bwd 1x{size}x{size}x{heads * head_dim}, kernel {kernel}, rel_pos_bias, "
          f"1 thread per rank (parity checked)")
    print(f"  single device {single * 1e3:8.2f} ms; 2-rank H-sharded {dom * 1e3:8.2f} ms; "
          f"speed-up {single / dom:.2f}x")
    print(f"  (one shard's compute alone, no communication, other rank idle: {res[0]['shard_alone'] * 1e3:8.2f} ms; "
          f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bench_single(args.size, args.heads, args.head_dim, args.kernel, args.repeats)
    bench_memory(96, 2, 16, args.kernel)
    bench_domain(args.size, args.heads, args.head_dim, args.kernel, args.repeats)


if __name__ == "__main__":
    main()
