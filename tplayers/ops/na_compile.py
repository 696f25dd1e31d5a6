"""Neighborhood attention as registered custom ops, for ``torch.compile(fullgraph=True)``.

The tile kernel (:class:`~tplayers.ops.na_kernel.TileAttention`) builds its index tables
from the geometry with torch ops and reads them on the host, which ``torch.compile`` cannot
trace. While compiling, :func:`~tplayers.ops.na_engine.neighborhood_attention` calls these ops
instead: each is one opaque node of the graph, its arguments the tensors and the geometry as
ints; the eager body builds (and caches) the same tables and runs the same kernel as eager
mode (the kernel :func:`~tplayers.ops.na_dispatch.choose_kernel` picks: the compiled C kernel, the
GEMM kernel or the tile kernel), so on the CPU the results are bitwise those of eager mode (on
CUDA eager mode runs ``flex_attention``, :mod:`tplayers.ops.na_flex`, and these ops the tile
kernel: the same window, fp rounding apart). ``tplayers::na2d_tiles`` is the forward,
``tplayers::na2d_tiles_backward`` its backward (registered as its autograd formula). Importing this
module registers nothing: :func:`ensure_na_ops` registers both on first use (idempotent; see
:mod:`tplayers.ops.registry`).

Example::

    import torch, tplayers
    q = k = v = torch.randn(1, 9, 9, 2, 4)
    f = torch.compile(lambda q, k, v: tplayers.na2d(q, k, v, 3), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v), tplayers.na2d(q, k, v, 3))
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from tplayers.ops import na_cpu, na_dispatch
from tplayers.ops.na_gemm import gemm_backward, gemm_forward
from tplayers.ops.na_geometry import split_geometry
from tplayers.ops.na_kernel import TileAttention, tile_backward, tile_plans
from tplayers.ops.registry import OpSpec, constant_result, register

__all__ = ["na2d_tiles", "ensure_na_ops", "expand_heads", "fold_heads"]


def _table(table: torch.Tensor) -> Optional[torch.Tensor]:
    return table if table.numel() else None  # an empty tensor stands for "no bias" in the schemas


def _kv_heads(q: torch.Tensor, k: torch.Tensor, heads: int) -> int:
    return k.shape[-1] * heads // q.shape[-1]


def _which(q: torch.Tensor, k: torch.Tensor, geo: List[int], heads: int) -> str:
    if na_cpu.kernel_choice() == "flex":  # forced flex: these ops run the tile kernel (see above)
        return "torch"
    kernel = [axis.kernel for axis in split_geometry(geo)[0]]
    return na_dispatch.choose_kernel(q, kernel, grouped=_kv_heads(q, k, heads) < heads)


def expand_heads(x: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """(B, P, kv_heads*D) -> (B, P, heads*D): GQA's query head ``h`` reads ``h // (heads // kv_heads)``.
    A contiguous copy (at ``D = 1`` the reshape alone is a view with a zero stride, which the C
    kernel, reading raw pointers, must not get)."""
    if kv_heads == heads:
        return x
    b, p = x.shape[:2]
    expanded = x.view(b, p, kv_heads, 1, -1).expand(-1, -1, -1, heads // kv_heads, -1)
    return expanded.reshape(b, p, -1).contiguous()


def fold_heads(grad: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """The adjoint of :func:`expand_heads`: each key head's gradient summed over its query heads."""
    if kv_heads == heads:
        return grad
    b, p = grad.shape[:2]
    return grad.view(b, p, kv_heads, heads // kv_heads, -1).sum(3).reshape(b, p, -1)


def na2d_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, geo: List[int], scale: float, heads: int
) -> torch.Tensor:
    """The forward: ``q`` (B, Pq, heads*D), ``k``/``v`` (B, Pk, kv_heads*D|Dv) pixel-major, ``table``
    the bias (or an empty tensor) -> (B, Pq, heads*Dv). The GEMM kernel reads grouped heads as they
    are; the others get them expanded."""
    which = _which(q, k, geo, heads)
    if which != "gemm":
        kv_heads = _kv_heads(q, k, heads)
        k, v = expand_heads(k, kv_heads, heads), expand_heads(v, kv_heads, heads)
    if which == "c":
        return na_cpu.c_forward(q, k, v, _table(table), geo, scale, heads)
    if which == "gemm":
        with torch.no_grad():
            return gemm_forward(q, k, v, _table(table), geo, scale, heads)
    plan, plan_bwd = tile_plans(geo, q.device, q.dtype)
    with torch.no_grad():
        return TileAttention.apply(q, k, v, _table(table), plan, plan_bwd, scale, heads)


def _na2d_tiles_fake(q, k, v, table, geo, scale, heads):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2] // _kv_heads(q, k, heads) * heads)


def na2d_tiles_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    geo: List[int],
    scale: float,
    heads: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dtable)`` (``dtable`` empty without a bias): the kernel's own backward
    (:func:`~tplayers.ops.na_kernel.tile_backward`) on the same tables."""
    tab = _table(table)
    which = _which(q, k, geo, heads)
    if which == "gemm":
        dq, dk, dv, dt = gemm_backward(grad_out, q, k, v, tab, out, geo, scale, heads)
        return dq, dk, dv, (dt if tab is not None else table.new_empty(0))
    kv_heads = _kv_heads(q, k, heads)
    k, v = expand_heads(k, kv_heads, heads), expand_heads(v, kv_heads, heads)
    if which == "c":
        dq, dk, dv, dt = na_cpu.attention_backward(grad_out, q, k, v, tab, out, geo, scale, heads)
    else:
        _, plan_bwd = tile_plans(geo, q.device, q.dtype)
        dq, dk, dv, dt = tile_backward(grad_out, q, k, v, tab, out, plan_bwd, scale, heads, True, True, tab is not None)
    dk, dv = fold_heads(dk, kv_heads, heads), fold_heads(dv, kv_heads, heads)
    return dq, dk, dv, (dt if tab is not None else table.new_empty(0))


def _na2d_tiles_backward_fake(grad_out, q, k, v, table, out, geo, scale, heads):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(table)


def _setup(ctx, inputs, output):
    q, k, v, table, geo, scale, heads = inputs
    ctx.save_for_backward(q, k, v, table, output)
    ctx.geo, ctx.scale, ctx.heads = geo, scale, heads


def _backward(ctx, grad):
    q, k, v, table, out = ctx.saved_tensors
    dq, dk, dv, dt = torch.ops.tplayers.na2d_tiles_backward(
        grad.contiguous(), q, k, v, table, out, ctx.geo, ctx.scale, ctx.heads
    )
    return dq, dk, dv, (dt if table.numel() else None), None, None, None


_OPS = (
    OpSpec("tplayers::na2d_tiles", na2d_tiles, _na2d_tiles_fake, (_backward, _setup)),
    OpSpec("tplayers::na2d_tiles_backward", na2d_tiles_backward, _na2d_tiles_backward_fake),
)


@constant_result
def ensure_na_ops() -> bool:
    """Register ``tplayers::na2d_tiles`` and its backward unless they are registered already."""
    return register(_OPS)
