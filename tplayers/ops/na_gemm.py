"""The GEMM-tiled kernel of neighborhood attention: batched matmuls over blocks of tiles.

A tile of ``tH x tW`` queries reads the union of its windows, a region of ``RH x RW`` keys (the
row and column axes of :mod:`tplayers.ops.na_geometry`; 1-D runs with one row, 3-D with the
leading axes merged into the row axis). The kernel works on a *block* of ``ca x cb`` tiles at a
time (whole tile rows, or one tile row cut into column ranges): one ``index_select`` per tensor
on its pixel-major ``(B*pixels*heads, D)`` rows gathers the block's queries, keys and values as
contiguous batches of tiles (the row numbers are built once per shape from the axes' separable
:class:`~tplayers.ops.na_layout.AxisTiles`). Grouped key/value heads (GQA/MQA) stay grouped: the
query heads of a group are stacked into one taller tile against the group's one key tile. Per
block: the window mask (the outer sum of a row and a column pattern, 0 / -inf) is copied into
the scores and ``scale Q K^T`` accumulated onto it (one ``baddbmm_``), the bias added, ``P =
softmax(S)``, ``O = P V`` (one ``bmm``), written to each query's row (``index_copy_``).
Backward, per block: ``S`` and ``P`` again, ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P (dP -
rowsum(dO O))``, ``dQ = dS K``, ``dK = dS^T Q`` (times the scale), ``dbias = sum_b dS``: five
``bmm`` and the ``index_add_`` of ``dK`` / ``dV``.

Padding slots (a partial tile repeats a query) write to a dummy row and get a zero gradient, so
they add nothing. Blocks hold at most ``CHUNK_SCORES`` (forward) / ``BACKWARD_CHUNK_SCORES``
scores over all (batch, head) planes, so peak memory stays within a few times
``B*heads*H*W*k^2`` however large the image.

:func:`~tplayers.ops.na_dispatch.default_tile` picks the tiles from the kernel (measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

import torch
from torch.autograd.function import once_differentiable

from tplayers.ops.na_geometry import row_tiles, split_geometry
from tplayers.ops.na_layout import AxisTiles

__all__ = ["GemmPlan", "gemm_plan", "GeoAttention", "GEMM_KERNELS", "gemm_forward", "gemm_backward"]

#: scores per forward block, all (batch, head) planes together (1 MiB of fp32)
CHUNK_SCORES = 1 << 18
#: the same for backward (it holds P, dP and the dK / dV tiles besides)
BACKWARD_CHUNK_SCORES = 1 << 16


def _dest(tiles: AxisTiles, count: int) -> torch.Tensor:
    """Per slot, the query it computes, or ``count`` (a zero row) at padding slots."""
    dest = torch.full((tiles.num_tiles * tiles.tile,), count, dtype=torch.int64)
    dest[tiles.out_pos] = torch.arange(count)
    return dest


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


@dataclass(frozen=True, eq=False)
class GemmPlan:
    """Per axis (row ``h``, column ``w``): the slots' query indices ``q_*`` (n*t,), their
    destinations ``dest_*`` (padding -> the zero row), the region slots' key indices ``k_*``
    (n*R,), the additive window patterns ``mask_*`` (n, t, R); ``blocks``: ``(a0, a1, b0, b1)`` tile-row / tile-column ranges."""

    th: AxisTiles
    tw: AxisTiles
    q_h: torch.Tensor
    q_w: torch.Tensor
    dest_h: torch.Tensor
    dest_w: torch.Tensor
    k_h: torch.Tensor
    k_w: torch.Tensor
    mask_h: torch.Tensor
    mask_w: torch.Tensor
    blocks: Tuple[Tuple[int, int, int, int], ...]
    blocks_bwd: Tuple[Tuple[int, int, int, int], ...]


def _blocks(nh: int, nw: int, per_tile: int, limit: int) -> Tuple[Tuple[int, int, int, int], ...]:
    """Blocks of whole tile rows when one row of tiles fits ``limit`` scores, else of one tile row
    cut into column ranges."""
    row = nw * per_tile
    if row <= limit:
        ca = max(1, limit // row)
        return tuple((a, min(a + ca, nh), 0, nw) for a in range(0, nh, ca))
    cb = max(1, limit // per_tile)
    return tuple((a, a + 1, b, min(b + cb, nw)) for a in range(nh) for b in range(0, nw, cb))


@lru_cache(maxsize=32)
def gemm_plan(geo: Tuple[int, ...], planes: int, device: torch.device, dtype: torch.dtype) -> GemmPlan:
    """The :class:`GemmPlan` of a :func:`~tplayers.ops.na_geometry.geometry_args` list for
    ``planes`` = batch * heads (cached)."""
    axes = split_geometry(geo)[0]
    th, col = row_tiles(axes[:-1]), axes[-1]
    tw = col.tiles(col.tile)
    rows_q = math.prod(a.q_count for a in axes[:-1])
    per_tile = planes * th.tile * tw.tile * th.region * tw.region
    dev = device

    def to(x):
        return x.to(dev)

    return GemmPlan(
        th,
        tw,
        to(th.q_index.flatten()),
        to(tw.q_index.flatten()),
        to(_dest(th, rows_q)),
        to(_dest(tw, col.q_count)),
        to(th.k_index.flatten()),
        to(tw.k_index.flatten()),
        to(_additive(th.mask, dtype)),
        to(_additive(tw.mask, dtype)),
        _blocks(th.num_tiles, tw.num_tiles, per_tile, CHUNK_SCORES),
        _blocks(th.num_tiles, tw.num_tiles, per_tile, BACKWARD_CHUNK_SCORES),
    )


@lru_cache(maxsize=16)
def _rel(plan: GemmPlan, width: int) -> torch.Tensor:
    """Flat bias-table index of every score: (nh, nw, tH, tW, RH, RW)."""
    th, tw = plan.th, plan.tw
    return (th.rel[:, None, :, None, :, None] * width + tw.rel[None, :, None, :, None, :]).to(plan.mask_h.device)


def _flat(rows, cols, t_r: int, t_c: int, width: int, pixels: int, batch: int, heads: int, groups: int = 1):
    """Row numbers in a pixel-major ``(batch * pixels * heads, D)`` matrix of a block's tiles, in the
    order (batch, head group, tile row, tile column, head in group, slot row, slot column): ``rows``
    (na*t_r,) and ``cols`` (nb*t_c,) are the axes' indices, ``width`` the row length of the image;
    ``groups`` consecutive heads share a tile batch entry (GQA: the query heads of one key head)."""
    na, nb = rows.numel() // t_r, cols.numel() // t_c
    pix = (rows.view(na, 1, t_r, 1) * width + cols.view(1, nb, 1, t_c)).reshape(na * nb, 1, t_r * t_c)
    dev = pix.device
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1, 1)
    g = torch.arange(heads // groups, device=dev).view(1, -1, 1, 1, 1) * groups
    j = torch.arange(groups, device=dev).view(1, 1, 1, -1, 1)
    return ((b * pixels + pix[None, None]) * heads + g + j).flatten()


@lru_cache(maxsize=8)
def _block_rows(plan: GemmPlan, backward: bool, batch: int, heads: int, kv_heads: int, dims: Tuple[int, ...]):
    """Per block ``(q_rows, k_rows, dest, valid)``: the gather rows of its query and key / value
    tiles, the output rows of its query slots (padding slots: the dummy row after the last) and
    ``valid`` (na*nb, tq, 1) 1/0 per slot (None without padding), built once per shape."""
    hq, wq, hk, wk = dims
    th, tw = plan.th, plan.tw
    out = []
    for a0, a1, b0, b1 in plan.blocks_bwd if backward else plan.blocks:
        rq, cq = plan.q_h[a0 * th.tile : a1 * th.tile], plan.q_w[b0 * tw.tile : b1 * tw.tile]
        rk, ck = plan.k_h[a0 * th.region : a1 * th.region], plan.k_w[b0 * tw.region : b1 * tw.region]
        rd, cd = plan.dest_h[a0 * th.tile : a1 * th.tile], plan.dest_w[b0 * tw.tile : b1 * tw.tile]
        # padding slots (row hq or column wq of the padded grid) -> the dummy row
        pad = ((rd == hq).view(-1, 1) | (cd == wq).view(1, -1)).view(a1 - a0, th.tile, b1 - b0, tw.tile)
        pad = pad.transpose(1, 2).reshape((a1 - a0) * (b1 - b0), th.tile * tw.tile, 1)
        groups = heads // kv_heads
        plain = _flat(rd.clamp(max=hq - 1), cd.clamp(max=wq - 1), th.tile, tw.tile, wq, hq * wq, batch, heads, groups)
        padded = pad.view(1, 1, -1, 1, pad.shape[1]).expand(batch, kv_heads, -1, groups, -1).flatten()
        out.append(
            (
                _flat(rq, cq, th.tile, tw.tile, wq, hq * wq, batch, heads, groups),
                _flat(rk, ck, th.region, tw.region, wk, hk * wk, batch, kv_heads),
                plain.masked_fill(padded, batch * hq * wq * heads),
                (~pad).to(plan.mask_h.dtype) if bool(pad.any()) else None,
            )
        )
    return tuple(out)


def _scores(plan: GemmPlan, block, qt, kt, scale, table, batch: int, kv_heads: int) -> torch.Tensor:
    """``mask + scale Q K^T (+ bias)`` of one block: (B*kv_heads*na*nb, groups*tq, R); the window
    mask (the outer sum of the row and column patterns) copied in first, the product accumulated
    onto it (one ``baddbmm_``)."""
    a0, a1, b0, b1 = block
    th, tw = plan.th, plan.tw
    na, nb, tq, region = a1 - a0, b1 - b0, th.tile * tw.tile, th.region * tw.region
    s = qt.new_empty(qt.shape[0], qt.shape[1], kt.shape[1])
    mask = plan.mask_h[a0:a1, None, :, None, :, None] + plan.mask_w[None, b0:b1, None, :, None, :]
    s.view(batch * kv_heads, na, nb, -1, th.tile, tw.tile, th.region, tw.region).copy_(mask[:, :, None])
    s.baddbmm_(qt, kt.transpose(1, 2), alpha=scale)
    if table is not None:
        rel = _rel(plan, table.shape[-1])[a0:a1, b0:b1]
        bias = table.flatten(1)[:, rel.flatten()].view(kv_heads, -1, na, nb, tq, region)
        s.view(batch, kv_heads, na, nb, -1, tq, region).add_(bias.permute(0, 2, 3, 1, 4, 5))
    return s


def _dims(geo) -> Tuple[int, int, int, int]:
    axes = split_geometry(geo)[0]
    rows = (math.prod(a.q_count for a in axes[:-1]), math.prod(a.k_count for a in axes[:-1]))
    return rows[0], axes[-1].q_count, rows[1], axes[-1].k_count


def gemm_forward(q, k, v, table, geo: List[int], scale: float, heads: int) -> torch.Tensor:
    """Forward: ``q`` (B, Pq, heads*D), ``k``/``v`` (B, Pk, kv_heads*D|Dv) pixel-major, contiguous
    (``kv_heads`` divides ``heads``: the query heads of a group run against one key tile, one
    taller GEMM), ``table`` the bias or None -> (B, Pq, heads*Dv)."""
    batch = q.shape[0]
    plan = gemm_plan(tuple(geo), batch * heads, q.device, q.dtype)
    dims = _dims(geo)
    th, tw = plan.th, plan.tw
    region = th.region * tw.region
    kv_heads = k.shape[-1] * heads // q.shape[-1]
    q2 = q.view(-1, q.shape[-1] // heads)  # one row per (pixel, head)
    k2, v2 = (x.view(-1, x.shape[-1] // kv_heads) for x in (k, v))
    out = q.new_empty(q2.shape[0] + 1, v2.shape[1])  # the last row takes the padding slots
    rows = _block_rows(plan, False, batch, heads, kv_heads, dims)
    for block, (q_rows, k_rows, dest, _) in zip(plan.blocks, rows):
        kt = k2.index_select(0, k_rows).view(-1, region, k2.shape[1])
        vt = v2.index_select(0, k_rows).view(-1, region, v2.shape[1])
        qt = q2.index_select(0, q_rows).view(kt.shape[0], -1, q2.shape[1])
        probs = torch.softmax(_scores(plan, block, qt, kt, scale, table, batch, kv_heads), -1)
        out.index_copy_(0, dest, torch.bmm(probs, vt).view(-1, v2.shape[1]))
        del qt, kt, vt, probs
    return out[:-1].view(batch, q.shape[1], -1)


def gemm_backward(
    grad_out, q, k, v, table, out, geo: List[int], scale: float, heads: int, want_kv=True, want_bias=True
):
    """``(dq, dk, dv, dtable)`` of :func:`gemm_forward` (``dk`` / ``dv`` None unless ``want_kv``,
    ``dtable`` None without a table or ``want_bias``)."""
    batch = q.shape[0]
    plan = gemm_plan(tuple(geo), batch * heads, q.device, q.dtype)
    dims = _dims(geo)
    th, tw = plan.th, plan.tw
    tq, region = th.tile * tw.tile, th.region * tw.region
    kv_heads = k.shape[-1] * heads // q.shape[-1]
    q2 = q.view(-1, q.shape[-1] // heads)
    k2, v2 = (x.view(-1, x.shape[-1] // kv_heads) for x in (k, v))
    dim_v = v2.shape[1]
    g2 = grad_out.reshape(-1, dim_v)  # a view when it can be (an expanded grad of .sum())
    delta = _rowdot(g2, out.view(-1, dim_v))  # rowsum(dO * O) per query; 0 in the dummy row
    grad_q = q.new_empty(q2.shape[0] + 1, q2.shape[1])
    grad_k = torch.zeros_like(k2) if want_kv else None
    grad_v = torch.zeros_like(v2) if want_kv else None
    want_bias = want_bias and table is not None
    grad_table = torch.zeros_like(table).flatten(1) if want_bias else None
    rows = _block_rows(plan, True, batch, heads, kv_heads, dims)
    for block, (q_rows, k_rows, dest, valid) in zip(plan.blocks_bwd, rows):
        a0, a1, b0, b1 = block
        kt = k2.index_select(0, k_rows).view(-1, region, k2.shape[1])
        vt = v2.index_select(0, k_rows).view(-1, region, dim_v)
        qt = q2.index_select(0, q_rows).view(kt.shape[0], -1, q2.shape[1])
        gt = g2.index_select(0, q_rows).view(kt.shape[0], -1, dim_v)
        if valid is not None:  # padding slots repeat a query: they must add nothing
            gt.view(batch * kv_heads, valid.shape[0], -1, tq, dim_v).mul_(valid[:, None])
        probs = torch.softmax(_scores(plan, block, qt, kt, scale, table, batch, kv_heads), -1)
        ds = torch.bmm(gt, vt.transpose(1, 2)).sub_(delta.index_select(0, dest).view(kt.shape[0], -1, 1)).mul_(probs)
        del vt
        if want_kv:
            grad_v.index_add_(0, k_rows, torch.bmm(probs.transpose(1, 2), gt).view(-1, dim_v))
        del probs, gt
        grad_q.index_copy_(0, dest, torch.bmm(ds, kt).view(-1, k2.shape[1]))  # times scale below
        del kt
        if want_kv:
            grad_k.index_add_(0, k_rows, torch.bmm(ds.transpose(1, 2), qt).view(-1, q2.shape[1]))
        if want_bias:
            rel = _rel(plan, table.shape[-1])[a0:a1, b0:b1].flatten()
            per_head = ds.view(batch, kv_heads, a1 - a0, b1 - b0, heads // kv_heads, -1).sum(0)
            grad_table.index_add_(1, rel, per_head.permute(0, 3, 1, 2, 4).reshape(heads, -1))
        del ds, qt
    grad_q = grad_q[:-1].mul_(scale).view(q.shape)
    grad_k = grad_k.mul_(scale).view(k.shape) if want_kv else None
    grad_v = grad_v.view(v.shape) if want_kv else None
    return grad_q, grad_k, grad_v, (grad_table.view(table.shape) if want_bias else None)


def _rowdot(a: torch.Tensor, b: torch.Tensor, rows: int = 1 << 12) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two ``(N, D)`` matrices and a last 0 (the padding slots' dummy row),
    in slices of ``rows`` (no ``N x D`` temporary), as ``(N + 1, 1)``."""
    out = a.new_zeros(a.shape[0] + 1, 1)
    for r0 in range(0, a.shape[0], rows):
        stop = min(r0 + rows, a.shape[0])
        torch.sum(a[r0:stop] * b[r0:stop], -1, keepdim=True, out=out[r0:stop])
    return out


class GeoAttention(torch.autograd.Function):
    """Neighborhood attention over the geometry list ``geo`` on a pair of plane kernels ``kernels =
    (forward, backward)``: the GEMM-tiled ones (:data:`GEMM_KERNELS`) or the compiled C ones
    (:data:`tplayers.ops.na_cpu.C_KERNELS`). Inputs: pixel-major ``q``, ``k``, ``v``, the bias ``table``
    or None, the geometry list, the scale, the query heads; the backward kernel takes
    ``(grad_out, q, k, v, table, out, geo, scale, heads, want_kv, want_bias)``."""

    @staticmethod
    def forward(ctx, q, k, v, table, geo, scale: float, heads: int, kernels):
        out = kernels[0](q, k, v, table, geo, scale, heads)
        ctx.save_for_backward(q, k, v, table, out)
        ctx.geo, ctx.scale, ctx.heads, ctx.backward_kernel = geo, scale, heads, kernels[1]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, table, out = ctx.saved_tensors
        want = ctx.needs_input_grad
        dq, dk, dv, dt = ctx.backward_kernel(
            grad_out, q, k, v, table, out, ctx.geo, ctx.scale, ctx.heads, want[1] or want[2], want[3]
        )
        return dq, dk, dv, (dt if want[3] else None), None, None, None, None


#: The GEMM-tiled plane kernels, for :class:`GeoAttention`.
GEMM_KERNELS = (gemm_forward, gemm_backward)
