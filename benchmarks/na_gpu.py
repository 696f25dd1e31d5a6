"""Neighborhood attention on one CUDA GPU: tplayers' kernels against natten on the whole tensor
(issue 35, item 3), and dense attention over every token as the work NA avoids.

``python benchmarks/na_gpu.py`` prints, per shape and dtype, forward and forward + backward times
(CUDA events, median of ``--repeats`` after warm-up) and useful TFLOP/s (``4 * D * queries * heads *
window`` forward, 2.5x that for forward + backward) for:

* tplayers' default kernel on CUDA (``flex_attention`` with the neighborhood block mask, compiled:
  :mod:`tplayers.ops.na_flex`) and the torch tile kernel (``TPLAYERS_NA_KERNEL=torch``, the CUDA
  default before); for bf16 inputs also the default on fp32 copies rounded back (``tplayers on fp32
  copies``: how the flex kernel ran bf16 before it took it natively);
* natten, when it is importable: ``natten.na{n}d`` with ``torch_compile=True`` and natten's flex
  compile (and its backward) allowed. With natten's compiled CUDA library it picks its fused
  kernels (Hopper / CUTLASS FNA); a Python-only natten picks its Flex backend (``flex_attention``
  with a neighborhood block mask, compiled by inductor): the line names which backend ran;
* torch's ``flex_attention`` compiled with the window as a block mask built by evaluating the mask
  (``create_block_mask``; ``--no-flex`` leaves it out);
* ``scaled_dot_product_attention`` over all tokens (flash / memory-efficient), the dense work.

Every case is first checked against tplayers' fp64 CUDA result (the oracle path): output and the
gradients of q, k and v, for tplayers and natten alike (max abs error printed). Without a CUDA
device the script says so and exits 0.

The device check that fits a lent GPU's 15 minutes (about 4 of them; natten left out)::

    PYTHONPATH=. python3 -m pytest -q tests/unit/test_na_flex.py -k cuda_compiled
    PYTHONPATH=. python3 benchmarks/na_gpu.py --no-natten --no-flex --only fp32 --repeats 10
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

import tplayers

CASES = [  # (dims, shape heads-last, kernel, dtypes)
    (2, (1, 64, 64, 4, 32), 7, ("fp32",)),
    (2, (4, 128, 128, 8, 64), 7, ("fp32", "bf16")),
    (1, (8, 16384, 8, 64), 33, ("fp32", "bf16")),
    (3, (1, 16, 16, 16, 4, 32), 5, ("fp32",)),
    (3, (2, 32, 32, 32, 4, 32), 5, ("bf16",)),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICE = "cuda"
FLEX = True


def cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` CUDA-event timed calls after two warm-ups
    (wall clock where the device is the CPU: ``--dry``)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def natten_fn(dims: int):
    """``natten.na{dims}d`` compiled (flex compile and its backward allowed), or None."""
    try:
        import natten
    except ImportError:
        return None
    natten.allow_flex_compile(True, backprop=True)
    fn = getattr(natten, f"na{dims}d")
    return lambda q, k, v, kernel: fn(q, k, v, kernel_size=kernel, torch_compile=True)


def natten_backend(q, k, v) -> str:
    from natten.backends import choose_backend

    return choose_backend(q, k, v, torch_compile=True)


def natten_refusal(q, k, v) -> str:
    """Why natten's Flex backend refuses ``q``, ``k``, ``v`` (its own check, raising)."""
    from natten.backends.configs.checks import can_run_flex_attention

    try:
        can_run_flex_attention(q, k, v, torch_compile=True, raise_error=True)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return "its Flex check passes"


def window_mask(spatial, kernel: int):
    """``mask_mod`` of NATTEN's non-causal, undilated window (kernel ``kernel`` on every axis) over
    row-major tokens of a ``spatial`` grid."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = None
        qi, ki = q_idx, kv_idx
        for size in reversed(spatial):
            qc, kc = qi % size, ki % size
            qi, ki = qi // size, ki // size
            start = torch.clamp(qc - kernel // 2, 0, size - kernel)
            inside = (kc >= start) & (kc < start + kernel)
            keep = inside if keep is None else keep & inside
        return keep

    return mask_mod


def flex_peer(shape, kernel: int):
    """``flex_attention`` compiled, with :func:`window_mask` as a block mask (128-token blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    spatial, tokens = shape[1:-2], math.prod(shape[1:-2])
    mask = create_block_mask(window_mask(spatial, kernel), None, None, tokens, tokens, device=DEVICE)
    compiled = torch.compile(flex_attention)

    def call(q, k, v, kernel):
        b, heads, dim = q.shape[0], q.shape[-2], q.shape[-1]
        flat = [t.reshape(b, -1, heads, dim).transpose(1, 2) for t in (q, k, v)]
        return compiled(*flat, block_mask=mask).transpose(1, 2).reshape(q.shape)

    return call


def tplayers_fn(dims: int, kernel_env: str):
    fn = getattr(tplayers, f"na{dims}d")

    def call(q, k, v, kernel):
        before = os.environ.get("TPLAYERS_NA_KERNEL")
        os.environ["TPLAYERS_NA_KERNEL"] = kernel_env
        try:
            return fn(q, k, v, kernel)
        finally:
            if before is None:
                del os.environ["TPLAYERS_NA_KERNEL"]
            else:
                os.environ["TPLAYERS_NA_KERNEL"] = before

    return call


def fp32_copies(fn):
    """``fn`` on fp32 copies of low-precision inputs, its result rounded back: tplayers' flex path
    before it took bf16 / fp16 as they are (the A/B of that change, in the same run)."""

    def call(q, k, v, kernel):
        return fn(q.float(), k.float(), v.float(), kernel).to(q.dtype)

    return call


def dense_fn(q, k, v, kernel):
    b, heads, dim = q.shape[0], q.shape[-2], q.shape[-1]
    flat = [t.reshape(b, -1, heads, dim).transpose(1, 2) for t in (q, k, v)]
    return torch.nn.functional.scaled_dot_product_attention(*flat).transpose(1, 2).reshape(q.shape)


def inputs(shape, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(*shape, device=DEVICE, dtype=dtype, generator=gen) for _ in range(4)]


def run_grads(fn, q, k, v, cot, kernel):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, kernel)
    out.backward(cot)
    return [out.detach()] + [t.grad for t in leaves]


def check(name, fn, oracle, q, k, v, cot, kernel) -> str:
    got = run_grads(fn, q, k, v, cot, kernel)
    errs = [(g.double() - o).abs().max().item() for g, o in zip(got, oracle)]
    return f"{name}: max |err| out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, dv {errs[3]:.1e}"


def bench_case(dims, shape, kernel, dtype_name, repeats):
    dtype = DTYPES[dtype_name]
    q, k, v, cot = inputs(shape, dtype)
    window = kernel**dims
    tokens = math.prod(shape[:-1])
    flops = 4 * shape[-1] * tokens * window
    dense_flops = 4 * shape[-1] * tokens * math.prod(shape[1:-2])
    print(f"\nna{dims}d {'x'.join(map(str, shape))} k{kernel} {dtype_name}", flush=True)
    oracle = run_grads(tplayers_fn(dims, "torch"), *(t.double() for t in (q, k, v, cot)), kernel)
    peers = {"tplayers": tplayers_fn(dims, ""), "tplayers tile": tplayers_fn(dims, "torch")}
    if dtype != torch.float32:  # the default before it ran bf16 / fp16 natively
        peers["tplayers on fp32 copies"] = fp32_copies(tplayers_fn(dims, ""))
    nat = natten_fn(dims)
    if nat is not None:
        start = time.perf_counter()
        try:
            run_grads(nat, q, k, v, cot, kernel)
            backend = natten_backend(q, k, v)
            peers[f"natten ({backend})"] = nat
            print(f"  natten backend {backend}, first forward + backward (compile) {time.perf_counter() - start:.1f} s")
        except Exception as exc:
            print(
                f"  natten   refused: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}; its Flex check: {natten_refusal(q, k, v)}"
            )
    else:
        print("  natten   MISSING PEER: natten is not importable here; no ratio")
    if FLEX and DEVICE == "cuda":
        start = time.perf_counter()
        try:
            flex = flex_peer(shape, kernel)
            run_grads(flex, q, k, v, cot, kernel)
            torch.cuda.synchronize()
            peers["torch flex (block mask)"] = flex
            print(f"  torch flex_attention first forward + backward (compile) {time.perf_counter() - start:.1f} s")
        except Exception as exc:
            print(f"  torch flex_attention fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    for name, fn in peers.items():
        print("  " + check(name, fn, oracle, q, k, v, cot, kernel), flush=True)
    del oracle
    peers["dense sdpa"] = dense_fn
    rows = {}
    for name, fn in peers.items():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

        def fwd():  # inputs that require grad: the graph natten compiled for its backward
            fn(*leaves, kernel)

        def both():
            fn(*leaves, kernel).backward(cot)

        try:
            rows[name] = (cuda_ms(fwd, repeats), cuda_ms(both, repeats))
        except torch.OutOfMemoryError:
            print(f"  {name:26s} out of GPU memory")
            continue
        useful = dense_flops if name == "dense sdpa" else flops
        tf, tb = rows[name]
        print(
            f"  {name:26s} fwd {tf:8.3f} ms ({useful / tf / 1e9:7.2f} TFLOP/s)"
            f"   fwd+bwd {tb:8.3f} ms ({2.5 * useful / tb / 1e9:7.2f} TFLOP/s)",
            flush=True,
        )
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for name in rows:
        if name != "tplayers" and "tplayers" in rows:
            fa, ba = rows["tplayers"]
            fb, bb = rows[name]
            print(f"  {name} time / tplayers time: fwd {fb / fa:6.2f}   fwd+bwd {bb / ba:6.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", default="", help="run the cases whose label contains this")
    parser.add_argument(
        "--dry", action="store_true", help="a tiny 2-D case on the CPU without natten (checks the script)"
    )
    parser.add_argument("--no-natten", action="store_true", help="leave natten out")
    parser.add_argument("--no-flex", action="store_true", help="leave torch's compiled flex_attention out")
    args = parser.parse_args()
    global DEVICE, CASES, FLEX, natten_fn
    FLEX = not args.no_flex
    if args.no_natten or args.dry:
        natten_fn = lambda dims: None  # noqa: E731
    if args.dry:
        DEVICE, CASES = "cpu", [(2, (1, 12, 12, 2, 8), 5, ("fp32",))]
        bench_case(*CASES[0][:3], "fp32", 3)
        return
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured (this benchmark needs a GPU)")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    try:
        import natten

        nat = f"natten {natten.__version__}"
    except ImportError:
        nat = "natten not installed"
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; {nat}; TF32 off")
    for dims, shape, kernel, dtypes in CASES:
        for dtype_name in dtypes:
            label = f"na{dims}d {'x'.join(map(str, shape))} {dtype_name}"
            if args.only in label:
                bench_case(dims, shape, kernel, dtype_name, args.repeats)


if __name__ == "__main__":
    main()
