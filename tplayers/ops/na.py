"""1-D, 2-D and 3-D neighborhood attention with NATTEN's semantics: the public functionals.

:func:`na1d`, :func:`na2d`, :func:`na3d` (``tplayers.na1d`` ...) take heads-last tensors
``(B, *spatial, heads, head_dim)`` and per-dim ``kernel_size``, ``dilation``, ``is_causal`` and
(keyword) ``stride``, as NATTEN 0.21 defines them (see :mod:`tplayers.ops.na_layout` for the
exact window rule: windows shifted inside the image at borders, dilation groups, even kernels,
causal per dim, stride groups sharing their leader's window). Keys and values may have fewer
heads than the queries (GQA/MQA: ``kv_heads`` divides ``heads``). All ranks run one engine
(:mod:`tplayers.ops.na_engine`): the compiled C kernel on fp32/fp64 CPU tensors where a C
compiler is available, ``flex_attention`` with a neighborhood block mask (compiled) on CUDA
(:mod:`tplayers.ops.na_flex`), the torch tile kernel elsewhere (``TPLAYERS_NA_KERNEL``
chooses); the ``(L)^2`` matrix of dense attention never exists.

:func:`neighborhood_attention` (re-exported) is the engine itself, which the domain-parallel layer calls
with a shard's window offsets.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch

from tplayers.ops.na_dispatch import check_dtype
from tplayers.ops.na_engine import neighborhood_attention

__all__ = [
    "na1d",
    "na2d",
    "na3d",
    "neighborhood_attention",
    "normalize_na_args",
    "normalize_window_args",
    "check_window_fits",
    "check_qkv",
    "check_bias",
]

IntArg = Union[int, Sequence[int]]
BoolArg = Union[bool, Sequence[bool]]
AXIS_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}


def _per_dim(value, rank: int, name: str, kind: type) -> Tuple:
    if type(value) is kind and (kind is bool or value >= 1):  # the common case, without the loop below
        return (value,) * rank
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,) * rank
    what = (
        f"a bool or a sequence of {rank} of them" if kind is bool else f"a positive int or a sequence of {rank} of them"
    )
    if len(items) != rank:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    for item in items:
        if kind is bool:
            if not isinstance(item, bool):
                raise ValueError(f"{name} must be {what}, got {value!r}")
        elif isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise ValueError(f"{name} must be {what}, got {value!r}")
    return items


def normalize_window_args(
    rank: int, kernel_size: IntArg, stride: IntArg = 1, dilation: IntArg = 1, is_causal: BoolArg = False
):
    """``(kernel, stride, dilation, causal)`` as ``rank``-tuples; ``ValueError`` on bad values
    (and on a stride larger than the kernel along a dim, as NATTEN)."""
    kernel, strides = _per_dim(kernel_size, rank, "kernel_size", int), _per_dim(stride, rank, "stride", int)
    for axis, (kk, ss) in enumerate(zip(kernel, strides)):
        if ss > kk:
            raise ValueError(
                f"stride must be <= kernel_size along every dim: got stride {ss} > kernel_size {kk} "
                f"along {AXIS_NAMES[rank][axis]}"
            )
    return kernel, strides, _per_dim(dilation, rank, "dilation", int), _per_dim(is_causal, rank, "is_causal", bool)


def normalize_na_args(kernel_size: IntArg, dilation: IntArg, is_causal: BoolArg):
    """2-D ``(kernel, dilation, causal)`` as per-dim pairs; ``ValueError`` on bad values."""
    kernel, _, dil, causal = normalize_window_args(2, kernel_size, 1, dilation, is_causal)
    return kernel, dil, causal


def check_window_fits(kernel: Sequence[int], dilation: Sequence[int], size: Sequence[int], who: str) -> None:
    """``ValueError`` unless ``kernel * dilation <= size`` along every dim (NATTEN's requirement)."""
    names = AXIS_NAMES.get(len(kernel), tuple(f"dim {i}" for i in range(len(kernel))))
    for axis, name in enumerate(names):
        if kernel[axis] * dilation[axis] > size[axis]:
            raise ValueError(
                f"{who}: kernel_size * dilation must be <= the input size along {name}: got kernel_size "
                f"{kernel[axis]} * dilation {dilation[axis]} > {name}={size[axis]}"
            )


def check_qkv(q, k, v, rank: int, who: str) -> None:
    """Types, ranks and agreeing shapes of ``q``, ``k``, ``v`` (``(B, *S, heads|kv_heads, D|Dv)``);
    ``kv_heads`` must divide ``heads``; ``q``'s dtype one of float32, float64, bfloat16, float16 and
    ``k``'s and ``v``'s the same. ``TypeError`` / ``ValueError`` naming the argument."""
    names = ", ".join(AXIS_NAMES[rank])
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank + 3:
            raise ValueError(f"{who}: {name} must be (B, {names}, heads, head_dim), got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{who}: k and v must agree on (B, {names}, heads), got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{who}: q and k must agree on batch and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    check_dtype(q, who)
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"{who}: the key/value heads must divide the query heads (GQA/MQA), got {kv_heads} "
            f"key/value heads for {heads} query heads"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"{who}: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )


def check_bias(rpb: Optional[torch.Tensor], heads: int, kernel: Sequence[int], stride: Sequence[int], who: str):
    """``rel_pos_bias`` must be ``(heads, 2*k_1 - 1, ..., 2*k_n - 1)`` of a floating dtype (it is
    added in the compute dtype: the inputs', fp32 for bf16 / fp16 inputs; its gradient comes back in
    its own), and needs stride 1 (a strided query's keys lie outside the table's ``2k - 1`` offsets)."""
    if rpb is None:
        return
    if not isinstance(rpb, torch.Tensor):
        raise TypeError(f"{who}: rel_pos_bias must be a torch.Tensor or None, got {type(rpb).__name__}")
    check_dtype(rpb, who, "rel_pos_bias")
    expect = (heads, *(2 * kk - 1 for kk in kernel))
    if tuple(rpb.shape) != expect:
        raise ValueError(
            f"{who}: rel_pos_bias must have shape {expect} (heads, 2*kernel_size - 1 per dim), got {tuple(rpb.shape)}"
        )
    if any(s != 1 for s in stride):
        raise ValueError(f"{who}: rel_pos_bias needs stride 1 along every dim, got stride {tuple(stride)}")


def _na(rank, q, k, v, kernel_size, dilation, is_causal, scale, stride, rel_pos_bias, backend):
    who = f"na{rank}d"
    check_qkv(q, k, v, rank, who)
    if q.shape[1 : 1 + rank] != k.shape[1 : 1 + rank]:
        raise ValueError(f"{who}: q and k must have the same spatial size, got {tuple(q.shape)} and {tuple(k.shape)}")
    kernel, strides, dil, causal = normalize_window_args(rank, kernel_size, stride, dilation, is_causal)
    size = tuple(q.shape[1 : 1 + rank])
    check_window_fits(kernel, dil, size, who)
    check_bias(rel_pos_bias, q.shape[-2], kernel, strides, who)
    if backend == "natten":
        natten = _natten()
        if natten is None:
            raise ImportError(f"{who}(backend='natten') needs the optional natten package: pip install natten==0.21.7")
        if rel_pos_bias is not None:
            raise ValueError(f"{who}(backend='natten'): natten 0.21 has no rel_pos_bias; use backend='torch'")
        return getattr(natten, who)(
            q, k, v, kernel_size=kernel, stride=strides, dilation=dil, is_causal=causal, scale=scale
        )
    if backend != "torch":
        raise ValueError(f"{who}: backend must be 'torch' or 'natten', got {backend!r}")
    return neighborhood_attention(
        q, k, v, kernel, dil, causal, stride=strides, scale=scale, global_size=size, rel_pos_bias=rel_pos_bias
    )


def na1d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: IntArg,
    dilation: IntArg = 1,
    is_causal: BoolArg = False,
    scale: Optional[float] = None,
    *,
    stride: IntArg = 1,
    rel_pos_bias: Optional[torch.Tensor] = None,
    backend: str = "torch",
) -> torch.Tensor:
    """1-D neighborhood attention, NATTEN's semantics: ``q`` ``(B, L, heads, D)``, ``k``/``v``
    ``(B, L, kv_heads, D|Dv)`` -> ``(B, L, heads, Dv)``. Args, returns and raises as :func:`na2d`
    (one dim).

    >>> import torch, tplayers
    >>> q = torch.randn(2, 20, 4, 8); kv = torch.randn(2, 20, 2, 8)   # 2 kv heads: GQA
    >>> tplayers.na1d(q, kv, kv, kernel_size=5, stride=2, is_causal=True).shape
    torch.Size([2, 20, 4, 8])
    >>> q, k, v = torch.randn(3, 2, 10, 4, 8, dtype=torch.float64).unbind(0)
    >>> causal = torch.nn.functional.scaled_dot_product_attention(   # a causal window of all 10 keys
    ...     q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    >>> torch.allclose(tplayers.na1d(q, k, v, kernel_size=10, is_causal=True), causal)
    True
    """
    return _na(1, q, k, v, kernel_size, dilation, is_causal, scale, stride, rel_pos_bias, backend)


def na2d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: IntArg,
    dilation: IntArg = 1,
    is_causal: BoolArg = False,
    scale: Optional[float] = None,
    *,
    stride: IntArg = 1,
    rel_pos_bias: Optional[torch.Tensor] = None,
    backend: str = "torch",
) -> torch.Tensor:
    """2-D neighborhood attention, NATTEN's semantics, heads-last layout.

    ``q``: ``(B, H, W, heads, head_dim)``; ``k``, ``v``: ``(B, H, W, kv_heads, head_dim)``
    (``v`` may have its own head dim; ``kv_heads`` divides ``heads``: GQA/MQA, query head ``h``
    reads ``h // (heads // kv_heads)``). Each query ``(i, j)`` attends to the ``kH x kW`` keys
    of its window (see :mod:`tplayers.ops.na_layout` for the exact rule: windows shifted inside
    the image at borders, dilation groups, even kernels, causal per dim, ``stride`` groups sharing
    their leader's window). ``kernel_size``, ``dilation``, ``is_causal``, ``stride``: int/bool
    or per-dim pairs (``stride <= kernel_size``). ``scale`` defaults to ``head_dim ** -0.5``.
    ``rel_pos_bias`` ``(heads, 2kH - 1, 2kW - 1)`` (stride 1) is added to the scores. Needs
    ``kernel_size * dilation <= (H, W)``. Returns ``(B, H, W, heads, head_dim_v)``.
    ``backend="natten"`` (opt-in) dispatches to ``natten.na2d`` when natten is installed; the
    default ``"torch"`` path is the oracle and runs everywhere.

    Args:
        q, k, v: the heads-last tensors above (one dtype and device).
        kernel_size, dilation, is_causal, stride: the window, per dim or one value.
        scale: the score scale (default ``head_dim ** -0.5``).
        rel_pos_bias: optional ``(heads, 2kH - 1, 2kW - 1)`` bias.
        backend: ``"torch"`` or ``"natten"``.

    Returns:
        ``(B, H, W, heads, head_dim_v)``.

    Raises:
        ValueError: shapes that do not fit (heads, sizes, a window larger than the input), a
            ``stride`` above the kernel, a bad ``rel_pos_bias`` or ``backend``.
        TypeError: a non-tensor argument.
        ImportError: ``backend="natten"`` without natten.

    >>> import torch, tplayers
    >>> q = k = v = torch.randn(1, 9, 11, 2, 8)
    >>> tplayers.na2d(q, k, v, kernel_size=(3, 4), dilation=(2, 1)).shape
    torch.Size([1, 9, 11, 2, 8])
    >>> q, k, v = torch.randn(3, 1, 5, 6, 2, 8, dtype=torch.float64).unbind(0)
    >>> full = torch.nn.functional.scaled_dot_product_attention(   # a window of the whole image
    ...     *(t.flatten(1, 2).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(1, 5, 6, 2, 8)
    >>> torch.allclose(tplayers.na2d(q, k, v, kernel_size=(5, 6)), full)
    True
    """
    return _na(2, q, k, v, kernel_size, dilation, is_causal, scale, stride, rel_pos_bias, backend)


def na3d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: IntArg,
    dilation: IntArg = 1,
    is_causal: BoolArg = False,
    scale: Optional[float] = None,
    *,
    stride: IntArg = 1,
    rel_pos_bias: Optional[torch.Tensor] = None,
    backend: str = "torch",
) -> torch.Tensor:
    """3-D neighborhood attention, NATTEN's semantics: ``q`` ``(B, D, H, W, heads, head_dim)``,
    ``k``/``v`` ``(B, D, H, W, kv_heads, head_dim|Dv)`` -> ``(B, D, H, W, heads, Dv)``; per-dim
    triples (or one value) for ``kernel_size``, ``dilation``, ``is_causal``, ``stride``;
    ``rel_pos_bias`` ``(heads, 2kD - 1, 2kH - 1, 2kW - 1)``. Args, returns and raises otherwise
    as :func:`na2d`.

    >>> import torch, tplayers
    >>> q = k = v = torch.randn(1, 6, 7, 8, 2, 4)
    >>> tplayers.na3d(q, k, v, kernel_size=(3, 3, 5), is_causal=(True, False, False)).shape
    torch.Size([1, 6, 7, 8, 2, 4])
    >>> q, k, v = torch.randn(3, 1, 3, 4, 5, 2, 8, dtype=torch.float64).unbind(0)
    >>> full = torch.nn.functional.scaled_dot_product_attention(   # a window of the whole volume
    ...     *(t.flatten(1, 3).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(1, 3, 4, 5, 2, 8)
    >>> torch.allclose(tplayers.na3d(q, k, v, kernel_size=(3, 4, 5)), full)
    True
    """
    return _na(3, q, k, v, kernel_size, dilation, is_causal, scale, stride, rel_pos_bias, backend)


@lru_cache(maxsize=1)
def _natten():
    """The natten module, or None when it is not installed (looked up once)."""
    try:
        import natten
    except ImportError:
        return None
    return natten
