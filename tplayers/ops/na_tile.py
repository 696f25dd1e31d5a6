"""The local compute of domain-parallel neighborhood attention on a whole-image kernel.

NATTEN's fused kernels (``natten.na1d/na2d/na3d``, Hopper/Blackwell/CUTLASS on CUDA) only run
whole images: every border of the tensor they get is an image border. A domain-parallel shard
therefore runs them on a *tile*: its rows extended, per sharded axis, to the
:func:`~tplayers.ops.na_layout.tile_span` whose windows, seen as a whole image, equal the global
ones (an internal shard edge must not trigger the border shift; stride runs and dilation groups
aligned). Queries, keys and values are all gathered to the tile; the outputs of the shard's own
rows are cut out of the tile's. The tplayers kernels are the fallback and the oracle: with
``backend="tplayers"`` the same tile path runs on :func:`~tplayers.ops.na_engine.neighborhood_attention`
over the tile as a whole image, which is how the tile logic is tested on the CPU.

natten is an optional dependency, looked up once (:func:`natten_module`); asking for it without
it installed raises ``ImportError`` saying how to install it, when it is first needed.

Example (single device: the tile is the image)::

    import torch
    from tplayers.ops.na_tile import tile_attention
    q = k = v = torch.randn(1, 10, 12, 2, 8)
    out = tile_attention(q, k, v, (3, 5), (1, 1), (1, 2), (False, True), None, backend="tplayers")
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import torch

from tplayers.ops.na_engine import neighborhood_attention

__all__ = ["natten_module", "natten_fused", "natten_applies", "tile_attention", "INSTALL_HINT"]

INSTALL_HINT = "pip install natten==0.21.7 (CUDA wheels: see https://natten.org/install/)"


@lru_cache(maxsize=1)
def natten_module():
    """The ``natten`` module, or None when it is not installed (looked up once per process)."""
    try:
        import natten
    except ImportError:
        return None
    return natten


def natten_fused() -> bool:
    """Whether natten is installed with its compiled library (``natten.HAS_LIBNATTEN``: the fused
    CUDA kernels). A Python-only natten (built without CUDA) would run its Flex backend uncompiled,
    materialising every score; the tplayers engine (compiled ``flex_attention`` on CUDA) runs
    instead. natten before 0.20 has no flag and always shipped its library."""
    natten = natten_module()
    return natten is not None and bool(getattr(natten, "HAS_LIBNATTEN", True))


def natten_applies(
    device: torch.device, kernel: Sequence[int], has_bias: bool, installed: Optional[bool] = None
) -> Optional[str]:
    """None when natten's fused kernels can run this call, else why not: natten installed with its
    fused kernels (``installed``, else :func:`natten_fused`), a CUDA device, no relative-position bias (natten 0.21 has
    none), every kernel size >= 2 (natten's requirement). The device is checked first: a CPU call
    never looks natten up (nor imports it while ``torch.compile`` traces)."""
    if device.type != "cuda":
        return f"natten's fused kernels run CUDA tensors, got a {device.type} tensor"
    if not (natten_fused() if installed is None else installed):
        return f"natten with its fused CUDA kernels is not installed ({INSTALL_HINT})"
    if has_bias:
        return "natten 0.21 has no relative-position bias"
    if min(kernel) < 2:
        return f"natten needs kernel_size >= 2 along every dim, got {tuple(kernel)}"
    return None


def tile_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    causal: Sequence[bool],
    scale: Optional[float],
    *,
    backend: str,
    rel_pos_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Neighborhood attention over ``q``, ``k``, ``v`` ``(B, *tile, heads|kv_heads, D)`` as one
    whole image (NATTEN's semantics): ``backend="natten"`` runs ``natten.na{n}d`` (``ImportError``
    / ``ValueError`` saying why when it cannot), ``"tplayers"`` the tplayers engine."""
    rank = q.dim() - 3
    size = tuple(q.shape[1 : 1 + rank])
    if backend == "natten":
        if natten_module() is None:
            raise ImportError(f"neighborhood attention with backend='natten': natten is not installed ({INSTALL_HINT})")
        why = natten_applies(q.device, kernel, rel_pos_bias is not None, True)
        if why is not None:
            raise ValueError(f"neighborhood attention with backend='natten': {why}")
        fn = getattr(natten_module(), f"na{rank}d")
        return fn(
            q,
            k,
            v,
            kernel_size=tuple(kernel),
            stride=tuple(stride),
            dilation=tuple(dilation),
            is_causal=tuple(causal),
            scale=scale,
        )
    if backend != "tplayers":
        raise ValueError(f"tile_attention: backend must be 'natten' or 'tplayers', got {backend!r}")
    return neighborhood_attention(
        q, k, v, kernel, dilation, causal, stride=stride, scale=scale, global_size=size, rel_pos_bias=rel_pos_bias
    )
