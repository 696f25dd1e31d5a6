"""torch's ``flex_attention`` with a neighborhood block mask, as a peer of ``tplayers.na2d`` on the
CPU (imported by ``benchmarks/na.py``).

The mask is NATTEN's non-causal, undilated 2-D window (each query's ``k x k`` window shifted
inside the image); ``create_block_mask`` skips the key blocks no query of a block reads, and
``torch.compile(flex_attention)`` builds the CPU kernel (inductor's C++ template). On torch 2.13
the CPU path has no backward (``NotImplementedError``); :func:`flex_peer` reports that instead of
a figure.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import torch


def neighborhood_mask(height: int, width: int, kernel: int) -> Callable:
    """The ``mask_mod`` of 2-D neighborhood attention (kernel ``kernel``, no dilation, not causal)
    over row-major pixels."""

    def mask_mod(b, h, q_idx, kv_idx):
        qr, qc = q_idx // width, q_idx % width
        kr, kc = kv_idx // width, kv_idx % width
        sr = torch.clamp(qr - kernel // 2, 0, height - kernel)
        sc = torch.clamp(qc - kernel // 2, 0, width - kernel)
        return (kr >= sr) & (kr < sr + kernel) & (kc >= sc) & (kc < sc + kernel)

    return mask_mod


def flex_peer(q, k, v, kernel: int, block: int = 64) -> Tuple[Optional[Callable], str]:
    """``(forward, note)``: a function running compiled ``flex_attention`` on heads-last ``q``, ``k``,
    ``v`` ``(1, H, W, heads, D)`` (returning the same layout), or None and why it cannot run here;
    ``note`` says what the first call (the compilation) took and whether backward runs."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return None, f"no flex_attention in this torch ({exc})"
    _, height, width, heads, dim = q.shape
    n = height * width
    start = time.perf_counter()
    try:
        mask = create_block_mask(neighborhood_mask(height, width, kernel), 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
        compiled = torch.compile(flex_attention)
        qf, kf, vf = (x.reshape(1, n, heads, -1).transpose(1, 2).contiguous() for x in (q, k, v))

        def forward():
            out = compiled(qf, kf, vf, block_mask=mask)
            return out.transpose(1, 2).reshape(1, height, width, heads, -1)

        forward()
    except Exception as exc:  # an unsupported CPU / compiler: reported, not fatal
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        return None, f"compiled flex_attention does not run here: {type(exc).__name__}: {first[:160]}"
    note = f"block mask {block}, first call (compile) {time.perf_counter() - start:.1f} s"
    try:  # eager, on tiny tensors: an error inside the compiled function would make dynamo skip it
        tiny = [torch.randn(1, 1, 128, 8, requires_grad=True) for _ in range(3)]
        flex_attention(*tiny).sum().backward()
        note += "; backward runs"
    except Exception as exc:
        note += f"; no backward: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return forward, note
