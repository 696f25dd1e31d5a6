"""2-D neighborhood attention with NATTEN's semantics.

On fp32/fp64 CPU tensors the work runs on the compiled kernel of :mod:`tplayers.ops.na_cpu`
(when a C compiler is available; ``TPLAYERS_NA_KERNEL`` chooses), elsewhere on the torch tile
kernel described here; both give NATTEN's exact window.

:func:`na2d` is the public functional (``tplayers.na2d``). The work is tiled:
``tH x tW`` queries of one dilation group share a key region of
``(tH + kH - 1) x (tW + kW - 1)`` group members, so one batched matmul scores a
whole tile against its region, an additive mask (``-inf`` outside each query's
window) keeps exactly NATTEN's window, and a second batched matmul applies the
values. :mod:`tplayers.ops.na_kernel` runs the tiles in chunks and keeps nothing
score-sized for backward (it scores a chunk again), so memory is the inputs',
the output's and the gradients' plus one chunk; the ``(H*W)^2`` matrix of dense
attention never exists.

:func:`neighborhood_attention_2d` is the general engine: queries and keys may be
windows of a larger global image (a domain-parallel shard with its halos), and
an optional relative-position-bias table is added to the scores.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch

from tplayers.ops import na_cpu, na_kernel
from tplayers.ops.na_compile import ensure_na_ops
from tplayers.ops.na_kernel import TileAttention
from tplayers.ops.na_layout import DEFAULT_TILE

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
    tile: Optional[Tuple[int, int]] = None,
    chunk_scores: Optional[int] = None,
) -> torch.Tensor:
    """The engine behind :func:`na2d` (arguments already normalised to pairs).

    ``q`` holds global rows/cols ``q_offset + [0, Hq) x [0, Wq)`` of an image of
    ``global_size``; ``k``/``v`` hold ``k_offset + [0, Hk) x [0, Wk)`` and must
    contain every key those queries attend to. ``rel_pos_bias``
    ``(heads, 2*kH - 1, 2*kW - 1)`` is added to each score at
    ``[(key - query) / dilation + kernel - 1]`` per dim. ``tile`` (queries per tile
    along H, W) and ``chunk_scores`` (score elements per (batch, head) plane per chunk,
    forward and backward) are tuning knobs: defaults from :func:`default_tile` and
    ``na_kernel.CHUNK_SCORES`` / ``BACKWARD_CHUNK_SCORES`` (all planes of a chunk
    together); any positive values give the same result.
    """
    _check_qkv(q, k, v)
    batch, hq, wq, heads, dim = q.shape
    if hq == 0 or wq == 0 or batch == 0:
        # nothing to compute (an empty shard): zeros still tied to every input, so backward runs
        tie = q.sum() + k.sum() + v.sum() + (0 if rel_pos_bias is None else rel_pos_bias.sum())
        return q.new_zeros(batch, hq, wq, heads, v.shape[-1]) + 0 * tie
    scale = dim ** -0.5 if scale is None else float(scale)
    tile = default_tile(kernel, dim) if tile is None else tile
    if chunk_scores is None:  # the defaults count every (batch, head) plane of a chunk
        planes = batch * heads
        fwd_chunk = max(1, na_kernel.CHUNK_SCORES // planes)
        bwd_chunk = max(1, na_kernel.BACKWARD_CHUNK_SCORES // planes)
    else:
        fwd_chunk = bwd_chunk = chunk_scores

    def pixels(x: torch.Tensor) -> torch.Tensor:  # (B, Hx, Wx, heads, D) -> (B, Hx*Wx, heads*D)
        return x.reshape(batch, x.shape[1] * x.shape[2], -1).contiguous()

    geo = na_kernel.geometry_args(global_size, kernel, dilation, causal, q_offset, k_offset, (hq, wq),
                                  (k.shape[1], k.shape[2]), tile, fwd_chunk, bwd_chunk)
    if torch.compiler.is_compiling():  # the tables are built inside one registered op (see na_compile)
        ensure_na_ops()

        table = rel_pos_bias if rel_pos_bias is not None else q.new_empty(0)
        out = torch.ops.tplayers.na2d_tiles(pixels(q), pixels(k), pixels(v), table, geo, scale, heads)
        return out.view(batch, hq, wq, heads, -1)
    if na_cpu.use_c_kernel(q, kernel):
        out = na_cpu.CAttention.apply(pixels(q), pixels(k), pixels(v), rel_pos_bias, geo, scale, heads)
        return out.view(batch, hq, wq, heads, -1)
    plan, plan_bwd = na_kernel.tile_plans(geo, q.device, q.dtype)
    out = TileAttention.apply(pixels(q), pixels(k), pixels(v), rel_pos_bias, plan, plan_bwd, scale, heads)
    return out.view(batch, hq, wq, heads, -1)


def default_tile(kernel: Tuple[int, int], head_dim: int) -> Tuple[int, int]:
    """Queries per tile along (H, W), chosen by measurement (``benchmarks/na.py``, one core).

    A tile of ``t`` queries along an axis scores ``t + k - 1`` keys where each query needs
    ``k``: small tiles waste fewer scores, large ones make larger matmuls. For kernel 7,
    head_dim 32 on one CPU core 4x4 and 4x8 measured fastest (8x8: ~15-25% slower);
    small kernels waste less per tile and get 8.
    """
    del head_dim  # measured at 16-64: the same choice
    return tuple(4 if k >= 5 else DEFAULT_TILE for k in kernel)
