"""``NeighborhoodAttention`` (the module: qkv linear, attention, projection) on one CPU core, with
the C kernel reading q, k and v as views of the qkv tensor (the library's path) against the same
forward with the three contiguous copies the kernel used to need, same run.

    python benchmarks/na_module.py [--repeats 15] [--isa avx2]

Per shape: the module's forward and forward + backward (thread CPU time, minimum over the
repeats, the two paths alternating which goes first), the ratio, and the check that both paths
give the same output and input gradient bit for bit. The "copies" path is the module's own
forward written out (``F.linear``, the views, ``.contiguous()``, ``tplayers.na{n}d``, ``F.linear``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from na import restart_capped
from na_kernels import isa_label

import tplayers

SHAPES = (  # (input shape, heads, kernel)
    ((1, 64, 64, 128), 4, 7),
    ((1, 96, 96, 32), 2, 7),
    ((1, 16, 16, 16, 128), 4, 5),
    ((1, 4096, 128), 4, 33),
)


def copies_forward(m, x):
    """The module's forward (single device, no bias table) with q, k, v copied contiguous."""
    rank = x.dim() - 2
    qkv = F.linear(x, m.qkv.weight, m.qkv.bias).view(*x.shape[:-1], 3, m.num_heads, m.head_dim)
    q, k, v = (t.contiguous() for t in qkv.unbind(rank + 1))
    fn = getattr(tplayers, f"na{rank}d")
    out = fn(q, k, v, m.kernel_size, m.dilation, m.is_causal, m.scale, stride=m.stride)
    return F.linear(out.reshape(x.shape), m.proj.weight, m.proj.bias)


def timed(fn, repeats: int):
    best = {name: float("inf") for name in fn}
    for r in range(repeats):
        for name in fn if r % 2 == 0 else reversed(list(fn)):
            t0 = time.thread_time()
            fn[name]()
            best[name] = min(best[name], time.thread_time() - t0)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--isa", default="", help="cap the C kernel at this ISA (avx2 / base)")
    args = parser.parse_args()
    restart_capped(args.isa)
    torch.set_num_threads(1)
    print(f"NeighborhoodAttention module, one core, fp32 {isa_label()}")
    print("| input | heads | k | fwd in place / copies (ms) | speed-up | fwd+bwd in place / copies (ms) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for shape, heads, kernel in SHAPES:
        torch.manual_seed(0)
        rank = len(shape) - 2
        m = getattr(tplayers, "NeighborhoodAttention" + ("" if rank == 2 else f"{rank}d"))(shape[-1], heads, kernel)
        x = torch.randn(shape)
        cot = torch.randn(shape)
        paths = {"in place": lambda: m(x), "copies": lambda: copies_forward(m, x)}
        grads = {}
        for name, f in paths.items():
            leaf = x.clone().requires_grad_()
            out = m(leaf) if name == "in place" else copies_forward(m, leaf)
            grads[name] = (out.detach(), torch.autograd.grad(out, leaf, cot)[0])
        same = all(torch.equal(a, b) for a, b in zip(grads["in place"], grads["copies"]))
        if not same:
            raise SystemExit(f"{shape}: the two paths differ")
        with torch.no_grad():
            fwd = timed(paths, args.repeats)
        leaf = x.clone().requires_grad_()
        both = timed(
            {
                "in place": lambda: m(leaf).backward(cot),
                "copies": lambda: copies_forward(m, leaf).backward(cot),
            },
            args.repeats,
        )
        a, b = fwd["in place"] * 1e3, fwd["copies"] * 1e3
        c, d = both["in place"] * 1e3, both["copies"] * 1e3
        print(
            f"| {'x'.join(map(str, shape))} | {heads} | {kernel} | {a:.3f} / {b:.3f} | {b / a:.3f}x "
            f"| {c:.3f} / {d:.3f} | {d / c:.3f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
