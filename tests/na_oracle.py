"""Brute-force neighborhood attention, built query by query from NATTEN's rule (test oracle).

Written independently of ``tplayers.ops``: it lists each dilation group's
members, finds the window inside that list, and attends with plain loops.
Slow; for tiny fp64 inputs only.
"""

from __future__ import annotations

import torch


def window_1d(i: int, length: int, kernel: int, dilation: int, causal: bool) -> list:
    """Global positions attended by position ``i`` along one axis."""
    members = [p for p in range(length) if p % dilation == i % dilation]
    n = members.index(i)
    if causal:
        return members[max(0, n - kernel + 1): n + 1]
    start = n - kernel // 2
    if start < 0:
        start = 0
    if start + kernel > len(members):
        start = len(members) - kernel
    window = members[start: start + kernel]
    assert len(window) == kernel
    return window


def brute_na2d(q, k, v, kernel, dilation=(1, 1), causal=(False, False), scale=None, rpb=None):
    """``(B, H, W, heads, D)`` -> same; differentiable (stacks per-query results)."""
    batch, height, width, heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    rows = []
    for i in range(height):
        wi = window_1d(i, height, kernel[0], dilation[0], causal[0])
        cols = []
        for j in range(width):
            wj = window_1d(j, width, kernel[1], dilation[1], causal[1])
            keys = k[:, wi][:, :, wj].reshape(batch, len(wi) * len(wj), heads, dim)
            vals = v[:, wi][:, :, wj].reshape(batch, len(wi) * len(wj), heads, v.shape[-1])
            s = torch.einsum("bhd,bnhd->bhn", q[:, i, j], keys) * scale
            if rpb is not None:
                ri = [(a - i) // dilation[0] + kernel[0] - 1 for a in wi]
                rj = [(c - j) // dilation[1] + kernel[1] - 1 for c in wj]
                bias = torch.stack([torch.stack([rpb[:, a, c] for c in rj], -1) for a in ri], -2)
                s = s + bias.reshape(heads, -1)[None]
            p = torch.softmax(s, dim=-1)
            cols.append(torch.einsum("bhn,bnhd->bhd", p, vals))
        rows.append(torch.stack(cols, 1))
    return torch.stack(rows, 1)


def assert_out_and_grads(out, ref, ins, ref_ins, gen, where: str = "", rtol: float = 1e-10, atol: float = 1e-12):
    """``out`` equals the oracle's ``ref``, and after backpropagating one random cotangent through
    both, every input's gradient equals the oracle input's (``ins`` / ``ref_ins``: q, k, v[, rpb])."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, msg=lambda m: f"out {where}: {m}")
    cot = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
    (out * cot).sum().backward()
    (ref * cot).sum().backward()
    for name, a, b in zip(("q", "k", "v", "rpb"), ins, ref_ins):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol, msg=lambda m: f"d{name} {where}: {m}")
