"""Brute-force neighborhood attention, built query by query from NATTEN's rule (test oracle).

Written independently of ``tplayers.ops``: ``brute_na2d`` lists each dilation group's members,
finds the window inside that list, and attends with plain loops; ``brute_na`` (any rank,
stride, GQA) evaluates NATTEN's mask predicate literally (the stride group's leader, the
window centre clamped into the dilation group, ``|centre - key| <= left/right``) for every
(query, key) pair and runs dense masked attention. Slow; for tiny fp64 inputs only.
"""

from __future__ import annotations

import itertools

import torch

import tplayers  # only check_na1d_case calls it: the oracle itself uses torch alone


def window_1d(i: int, length: int, kernel: int, dilation: int, causal: bool) -> list:
    """Global positions attended by position ``i`` along one axis."""
    members = [p for p in range(length) if p % dilation == i % dilation]
    n = members.index(i)
    if causal:
        return members[max(0, n - kernel + 1) : n + 1]
    start = n - kernel // 2
    if start < 0:
        start = 0
    if start + kernel > len(members):
        start = len(members) - kernel
    window = members[start : start + kernel]
    assert len(window) == kernel
    return window


def brute_na2d(q, k, v, kernel, dilation=(1, 1), causal=(False, False), scale=None, rpb=None):
    """``(B, H, W, heads, D)`` -> same; differentiable (stacks per-query results)."""
    batch, height, width, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
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


def natten_mask_1d(length: int, kernel: int, stride: int, dilation: int, causal: bool) -> torch.Tensor:
    """``(length, length)`` bool: query ``x`` attends key ``y`` along one axis (NATTEN 0.21's
    strided, dilated, causal predicate, evaluated pair by pair)."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    left, right = kernel // 2, kernel // 2 + (kernel % 2 - 1)
    for x, y in itertools.product(range(length), repeat=2):
        if x % dilation != y % dilation:
            continue
        group_len = len(range(x % dilation, length, dilation))  # positions of x's dilation group
        xi, yi = x // dilation, y // dilation
        if causal:
            leader = min(xi // stride * stride + stride - 1, group_len - 1)
            mask[x, y] = xi - yi >= 0 and leader - yi < kernel
        else:
            leader = min(xi // stride * stride + stride // 2, group_len - 1)
            centre = min(max(leader, left), group_len - 1 - right)
            mask[x, y] = 0 <= centre - yi <= left or 0 <= yi - centre <= right
    return mask


def brute_na(q, k, v, kernel, stride=None, dilation=None, causal=None, scale=None, rpb=None):
    """``q`` ``(B, *S, heads, D)``, ``k``/``v`` ``(B, *S, kv_heads, D|Dv)`` (``kv_heads`` divides
    ``heads``; query head ``h`` reads kv head ``h // (heads // kv_heads)``) -> ``(B, *S, heads, Dv)``.
    Per-dim tuples; ``rpb`` ``(heads, 2k_1 - 1, ..., 2k_n - 1)`` at ``(key - query) / dilation +
    kernel - 1`` (stride 1). Differentiable."""
    rank = q.dim() - 3
    size = q.shape[1 : 1 + rank]
    stride = stride or (1,) * rank
    dilation = dilation or (1,) * rank
    causal = causal or (False,) * rank
    heads, kv_heads = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    axes = [natten_mask_1d(size[i], kernel[i], stride[i], dilation[i], causal[i]) for i in range(rank)]
    mask = axes[0]
    for m in axes[1:]:  # product window: (N, N) over flattened positions, row-major
        mask = (mask[:, None, :, None] & m[None, :, None, :]).reshape(mask.shape[0] * m.shape[0], -1)
    n = mask.shape[0]
    qf, kf, vf = (
        q.reshape(q.shape[0], n, heads, -1),
        k.reshape(k.shape[0], n, kv_heads, -1),
        v.reshape(v.shape[0], n, kv_heads, -1),
    )
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        s = torch.einsum("bqd,bkd->bqk", qf[:, :, h], kf[:, :, g]) * scale
        if rpb is not None:
            coords = torch.stack(torch.meshgrid(*[torch.arange(x) for x in size], indexing="ij"), -1).reshape(n, rank)
            rel = coords[None, :, :] - coords[:, None, :]  # (q, k, rank) key - query
            idx = [
                (rel[..., i].div(dilation[i], rounding_mode="floor") + kernel[i] - 1).clamp(0, 2 * kernel[i] - 2)
                for i in range(rank)
            ]
            s = s + rpb[h][tuple(idx)][None]
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("bqk,bkd->bqd", torch.softmax(s, -1), vf[:, :, g]))
    return torch.stack(outs, 2).reshape(*q.shape[:-1], v.shape[-1])


def assert_out_and_grads(out, ref, ins, ref_ins, gen, where: str = "", rtol: float = 1e-10, atol: float = 1e-12):
    """``out`` equals the oracle's ``ref``, and after backpropagating one random cotangent through
    both, every input's gradient equals the oracle input's (``ins`` / ``ref_ins``: q, k, v[, rpb]).
    ``out`` may be of a narrower dtype than ``ref`` (fp32 against the fp64 oracle): compared in
    ``ref``'s."""
    torch.testing.assert_close(out.to(ref.dtype), ref, rtol=rtol, atol=atol, msg=lambda m: f"out {where}: {m}")
    cot = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
    (out * cot.to(out.dtype)).sum().backward()
    (ref * cot).sum().backward()
    for name, a, b in zip(("q", "k", "v", "rpb"), ins, ref_ins):
        got = a.grad.to(b.grad.dtype)
        torch.testing.assert_close(got, b.grad, rtol=rtol, atol=atol, msg=lambda m: f"d{name} {where}: {m}")


def check_na1d_case(
    gen, size, heads, kv_heads, dim, dim_v, kernel, stride, dil, causal, with_bias, where, scale=0.37, **tol
):
    """A random fp64 ``tplayers.na1d`` call (batch 2; the bias only with ``with_bias``) checked against
    :func:`brute_na`: output and every gradient (:func:`assert_out_and_grads`)."""
    q = torch.randn(2, size, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, size, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, size, kv_heads, dim_v, generator=gen, dtype=torch.float64)
    tensors = [q, k, v] + (
        [torch.randn(heads, 2 * kernel - 1, generator=gen, dtype=torch.float64)] if with_bias else []
    )
    ins = [t.clone().requires_grad_() for t in tensors]
    ref_ins = [t.clone().requires_grad_() for t in tensors]
    rpb = ins[3] if with_bias else None
    out = tplayers.na1d(*ins[:3], kernel, dil, causal, scale, stride=stride, rel_pos_bias=rpb)
    ref = brute_na(*ref_ins[:3], (kernel,), (stride,), (dil,), (causal,), scale, rpb=ref_ins[3] if with_bias else None)
    assert_out_and_grads(out, ref, ins, ref_ins, gen, where, **tol)


def record_results(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` by a wrapper that appends each call's result to the returned list."""
    taken = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: taken.append(real(*a)) or taken[-1])
    return taken


def at_thread_counts(fn, counts=(1, 3)) -> list:
    """``fn()``'s result with torch's thread count set to each of ``counts`` in turn (the count
    restored after): the C kernel splits its work over that many threads."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)
