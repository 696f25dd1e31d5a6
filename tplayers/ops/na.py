"""2-D neighborhood attention with NATTEN's semantics: the torch reference path.

:func:`na2d` is the public functional (``tplayers.na2d``). The work is tiled:
``tH x tW`` queries of one dilation group share a key region of
``(tH + kH - 1) x (tW + kW - 1)`` group members, so one batched matmul scores a
whole tile against its region, a precomputed additive mask (``-inf`` outside
each query's window) keeps exactly NATTEN's window, and a second
batched matmul applies the values. Scores and probabilities take
``B * heads * H * W * (tH + kH - 1) * (tW + kW - 1) / (tH * tW)`` elements, i.e.
``O(B * heads * H * W * kH * kW)`` for tiles of about the kernel's size; the
``(H*W)^2`` matrix of dense attention never exists. Autograd runs through
the gathers and an explicit backward of the tile attention that keeps only
the probabilities (one score-sized tensor).

:func:`neighborhood_attention_2d` is the general engine: queries and keys may be
windows of a larger global image (a domain-parallel shard with its halos), and
an optional relative-position-bias table is added to the scores.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch

from tplayers.ops.na_layout import DEFAULT_TILE, AxisTiles, axis_tiles

__all__ = ["na2d", "neighborhood_attention_2d", "normalize_na_args", "check_window_fits"]

IntPair = Union[int, Sequence[int]]
BoolPair = Union[bool, Sequence[bool]]


def _pair(value, name: str, kind: type) -> Tuple:
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2:
        raise ValueError(f"{name} must be a {kind.__name__} or a pair of them, got {value!r}")
    for item in items:
        if kind is bool:
            if not isinstance(item, bool):
                raise ValueError(f"{name} must be a bool or a pair of bools, got {value!r}")
        elif isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return items


def normalize_na_args(kernel_size: IntPair, dilation: IntPair, is_causal: BoolPair):
    """``(kernel, dilation, causal)`` as per-dim pairs; ``ValueError`` on bad values."""
    return _pair(kernel_size, "kernel_size", int), _pair(dilation, "dilation", int), _pair(is_causal, "is_causal", bool)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"na2d: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 5:
            raise ValueError(f"na2d: {name} must be (B, H, W, heads, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape[:-1] + k.shape[-1:] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"na2d: k and v must agree on (B, H, W, heads), got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3:] != k.shape[3:]:
        raise ValueError(
            f"na2d: q and k must agree on batch, heads and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"na2d: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )


def na2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: IntPair,
    dilation: IntPair = 1,
    is_causal: BoolPair = False,
    scale: Optional[float] = None,
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """2-D neighborhood attention, NATTEN's semantics, heads-last layout.

    ``q``, ``k``, ``v``: ``(B, H, W, heads, head_dim)`` (``v`` may have its own
    head dim). Each query ``(i, j)`` attends to the ``kH x kW`` keys of its
    window (see :mod:`tplayers.ops.na_layout` for the exact rule: windows
    shifted inside the image at borders, dilation groups, even kernels, causal
    per dim). ``kernel_size``, ``dilation``, ``is_causal``: int/bool or per-dim
    pairs. ``scale`` defaults to ``head_dim ** -0.5``. Needs
    ``kernel_size * dilation <= (H, W)``. Returns ``(B, H, W, heads, head_dim_v)``.
    ``backend="natten"`` (opt-in) dispatches to ``natten.na2d`` when natten is
    installed; the default ``"torch"`` path is the oracle and runs everywhere.

    >>> import torch, tplayers
    >>> q = k = v = torch.randn(1, 9, 11, 2, 8)
    >>> tplayers.na2d(q, k, v, kernel_size=(3, 4), dilation=(2, 1)).shape
    torch.Size([1, 9, 11, 2, 8])
    """
    _check_qkv(q, k, v)
    if q.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"na2d: q and k must have the same (H, W), got {tuple(q.shape)} and {tuple(k.shape)}")
    kernel, dil, causal = normalize_na_args(kernel_size, dilation, is_causal)
    size = (q.shape[1], q.shape[2])
    check_window_fits(kernel, dil, size, "na2d")
    if backend == "natten":
        natten = _natten()
        if natten is None:
            raise ImportError("na2d(backend='natten') needs the optional natten package: pip install natten==0.21.7")
        return natten.na2d(q, k, v, kernel_size=kernel, dilation=dil, is_causal=causal, scale=scale)
    if backend != "torch":
        raise ValueError(f"na2d: backend must be 'torch' or 'natten', got {backend!r}")
    return neighborhood_attention_2d(q, k, v, kernel, dil, causal, scale=scale, global_size=size)


@lru_cache(maxsize=1)
def _natten():
    """The natten module, or None when it is not installed (looked up once)."""
    try:
        import natten
    except ImportError:
        return None
    return natten


def check_window_fits(kernel: Tuple[int, int], dilation: Tuple[int, int], size: Sequence[int], who: str) -> None:
    """``ValueError`` unless ``kernel * dilation <= size`` along H and W (NATTEN's requirement)."""
    for axis, name in enumerate(("H", "W")):
        if kernel[axis] * dilation[axis] > size[axis]:
            raise ValueError(
                f"{who}: kernel_size * dilation must be <= the input size along {name}: got kernel_size "
                f"{kernel[axis]} * dilation {dilation[axis]} > {name}={size[axis]}"
            )


def neighborhood_attention_2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: Tuple[int, int],
    dilation: Tuple[int, int],
    causal: Tuple[bool, bool],
    *,
    scale: Optional[float] = None,
    global_size: Tuple[int, int],
    q_offset: Tuple[int, int] = (0, 0),
    k_offset: Tuple[int, int] = (0, 0),
    rel_pos_bias: Optional[torch.Tensor] = None,
    tile: Tuple[int, int] = (DEFAULT_TILE, DEFAULT_TILE),
) -> torch.Tensor:
    """The engine behind :func:`na2d` (arguments already normalised to pairs).

    ``q`` holds global rows/cols ``q_offset + [0, Hq) x [0, Wq)`` of an image of
    ``global_size``; ``k``/``v`` hold ``k_offset + [0, Hk) x [0, Wk)`` and must
    contain every key those queries attend to. ``rel_pos_bias``
    ``(heads, 2*kH - 1, 2*kW - 1)`` is added to each score at
    ``[(key - query) / dilation + kernel - 1]`` per dim.
    """
    _check_qkv(q, k, v)
    batch, hq, wq, heads, dim = q.shape
    if hq == 0 or wq == 0 or batch == 0:
        # nothing to compute (an empty shard): zeros still tied to every input, so backward runs
        tie = q.sum() + k.sum() + v.sum() + (0 if rel_pos_bias is None else rel_pos_bias.sum())
        return q.new_zeros(batch, hq, wq, heads, v.shape[-1]) + 0 * tie
    scale = dim ** -0.5 if scale is None else float(scale)
    th = axis_tiles(global_size[0], kernel[0], dilation[0], causal[0], q_offset[0], hq, k_offset[0], k.shape[1], tile[0])
    tw = axis_tiles(global_size[1], kernel[1], dilation[1], causal[1], q_offset[1], wq, k_offset[1], k.shape[2], tile[1])
    nth, ntw, tq, region = th.num_tiles, tw.num_tiles, th.tile * tw.tile, th.region * tw.region
    dev = q.device

    q_flat, k_flat, out_flat = _flat_indices(th, tw, wq, k.shape[2], dev)

    def tiles_of(x: torch.Tensor, index: torch.Tensor, per_tile: int) -> torch.Tensor:
        # (B, Hx, Wx, heads, D) -> (B, heads, nth, ntw, per_tile, D): one gather of the flat pixels
        x = x.flatten(1, 2).transpose(1, 2)  # (B, heads, Hx*Wx, D)
        return x.index_select(2, index).view(batch, heads, nth, ntw, per_tile, x.shape[-1])

    qt = tiles_of(q, q_flat, tq)  # (B, heads, nth, ntw, tq, D)
    kt = tiles_of(k, k_flat, region)  # (B, heads, nth, ntw, R, D)
    vt = tiles_of(v, k_flat, region)  # (B, heads, nth, ntw, R, Dv)
    bias = None if rel_pos_bias is None else _gather_rel_pos_bias(rel_pos_bias, th, tw)  # (heads, nT, tq, R)
    out = _TileAttention.apply(qt, kt, vt, bias, _window_bias(th, tw, dev, q.dtype), scale)
    out = out.view(batch, heads, nth * ntw * tq, -1).index_select(2, out_flat)  # (B, heads, Hq*Wq, Dv)
    return out.transpose(1, 2).reshape(batch, hq, wq, heads, out.shape[-1])


#: score elements processed per chunk (whole (batch, head) planes; at least one plane)
CHUNK_ELEMENTS = 1 << 21


def _plane_chunks(planes: int, heads: int, plane_elems: int):
    """``[p0, p1)`` ranges of (batch, head) planes: single planes, or whole batch elements."""
    if plane_elems * heads > CHUNK_ELEMENTS:
        return [(p, p + 1) for p in range(planes)]
    step = heads * max(1, CHUNK_ELEMENTS // (plane_elems * heads))
    return [(p, min(p + step, planes)) for p in range(0, planes, step)]


def _add_head_bias(scores: torch.Tensor, bias: torch.Tensor, p0: int, p1: int) -> None:
    """``scores`` (planes p0..p1 x nT, tq, R) += ``bias`` (heads, nT, tq, R) of each plane's head."""
    heads, tiles = bias.shape[0], bias.shape[1]
    if p1 - p0 == 1:
        scores.add_(bias[p0 % heads])
    else:
        scores.view(-1, heads, tiles, *scores.shape[1:]).add_(bias)


class _TileAttention(torch.autograd.Function):
    """Dense attention of each query tile against its key region, outside-window scores masked.

    forward: ``S = scale * Q K^T + window (0/-inf) + bias``, ``P = softmax(S)``, ``O = P V`` /
    backward: ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = scale * dS K``,
    ``dK = scale * dS^T Q``, ``dbias = sum over batch of dS``. Scores are made chunk by chunk
    of (batch, head) planes straight into ``P``, the one score-sized tensor kept for backward.
    """

    @staticmethod
    def forward(ctx, qt, kt, vt, bias, window, scale):
        # qt (B, heads, nth, ntw, tq, D); kt (..., R, D); vt (..., R, Dv); window (nth, ntw, tq, R)
        lead, tq, region = qt.shape[:-2], qt.shape[-2], kt.shape[-2]
        q3, k3, v3 = qt.flatten(0, 3), kt.flatten(0, 3), vt.flatten(0, 3)  # (N, tq|R, D)
        tiles, heads = lead[2] * lead[3], lead[1]
        window = window.view(tiles, tq, region)
        probs = q3.new_empty(q3.shape[0], tq, region)  # (N, tq, R)
        chunks = _plane_chunks(lead[0] * heads, heads, tiles * tq * region)
        for p0, p1 in chunks:
            rows = slice(p0 * tiles, p1 * tiles)
            base = window if p1 - p0 == 1 else window.repeat(p1 - p0, 1, 1)
            scores = torch.baddbmm(base, q3[rows], k3[rows].transpose(1, 2), alpha=scale)  # (chunk, tq, R)
            if bias is not None:
                _add_head_bias(scores, bias, p0, p1)
            torch._softmax(scores, -1, False, out=probs[rows])
            del base, scores
        out = torch.bmm(probs, v3)  # (N, tq, Dv)
        ctx.save_for_backward(q3, k3, v3, probs, out)
        ctx.scale, ctx.lead, ctx.chunks, ctx.has_bias = scale, lead, chunks, bias is not None
        return out.view(*lead, tq, v3.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, probs, out = ctx.saved_tensors
        lead, scale = ctx.lead, ctx.scale
        tiles, heads = lead[2] * lead[3], lead[1]
        g3 = grad_out.reshape(out.shape)  # (N, tq, Dv)
        delta = (g3 * out).sum(-1, keepdim=True)  # rowsum(dP * P) == rowsum(dO * O)
        grad_v = torch.bmm(probs.transpose(1, 2), g3)  # (N, R, Dv)
        grad_q, grad_k = torch.empty_like(q3), torch.empty_like(k3)
        want_bias = ctx.has_bias and ctx.needs_input_grad[3]
        grad_bias = q3.new_zeros(heads, tiles, *probs.shape[1:]) if want_bias else None
        for p0, p1 in ctx.chunks:
            rows = slice(p0 * tiles, p1 * tiles)
            grad_s = torch.bmm(g3[rows], v3[rows].transpose(1, 2))  # dP (chunk, tq, R)
            grad_s.sub_(delta[rows]).mul_(probs[rows])  # dS
            torch.bmm(grad_s, k3[rows], out=grad_q[rows])
            torch.bmm(grad_s.transpose(1, 2), q3[rows], out=grad_k[rows])
            if want_bias:
                if p1 - p0 == 1:
                    grad_bias[p0 % heads].add_(grad_s)
                else:
                    grad_bias.add_(grad_s.view(-1, heads, tiles, *grad_s.shape[1:]).sum(0))
        grad_q.mul_(scale)
        grad_k.mul_(scale)
        return (grad_q.view(*lead, *grad_q.shape[1:]), grad_k.view(*lead, *grad_k.shape[1:]),
                grad_v.view(*lead, *grad_v.shape[1:]), grad_bias, None, None)


@lru_cache(maxsize=16)
def _flat_indices(th: AxisTiles, tw: AxisTiles, wq: int, wk: int, device: torch.device):
    """Flat pixel indices: queries per tile slot, keys per region slot, and each query's slot.

    ``wq`` / ``wk``: widths of the query / key tensors (row strides of their flat pixels).
    """
    q_flat = th.q_index[:, None, :, None] * wq + tw.q_index[None, :, None, :]  # (nth, ntw, tH, tW)
    k_flat = th.k_index[:, None, :, None] * wk + tw.k_index[None, :, None, :]  # (nth, ntw, RH, RW)
    ti, mi = th.out_pos // th.tile, th.out_pos % th.tile
    tj, mj = tw.out_pos // tw.tile, tw.out_pos % tw.tile
    out_flat = ((ti[:, None] * tw.num_tiles + tj[None, :]) * th.tile + mi[:, None]) * tw.tile + mj[None, :]
    return tuple(t.flatten().to(device) for t in (q_flat, k_flat, out_flat))


@lru_cache(maxsize=16)
def _window_bias(th: AxisTiles, tw: AxisTiles, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(nth, ntw, tq, region)``: 0 where the key is in the query's window, -inf elsewhere.

    An additive float mask: adding it is much faster than a broadcast ``masked_fill``.
    """
    inside = th.mask[:, None, :, None, :, None] & tw.mask[None, :, None, :, None, :]  # (nth, ntw, tH, tW, RH, RW)
    inside = inside.reshape(th.num_tiles, tw.num_tiles, th.tile * tw.tile, th.region * tw.region)
    return torch.zeros(inside.shape, dtype=dtype).masked_fill_(~inside, -math.inf).to(device)


def _gather_rel_pos_bias(table: torch.Tensor, th: AxisTiles, tw: AxisTiles) -> torch.Tensor:
    """``(heads, nth * ntw, tq, region)``: ``table[h, rel_h, rel_w]`` for every score.

    One ``index_select`` of the flattened table (backward: one ``index_add``).
    """
    flat = _rel_index(th, tw, table.shape[-1], table.device)
    shape = (table.shape[0], th.num_tiles * tw.num_tiles, th.tile * tw.tile, th.region * tw.region)
    return table.flatten(1).index_select(1, flat).view(shape)


@lru_cache(maxsize=16)
def _rel_index(th: AxisTiles, tw: AxisTiles, width: int, device: torch.device) -> torch.Tensor:
    """Flat ``rel_h * width + rel_w`` index of every score, in tile order."""
    flat = th.rel[:, None, :, None, :, None] * width + tw.rel[None, :, None, :, None, :]  # (nth, ntw, tH, tW, RH, RW)
    return flat.flatten().to(device)
