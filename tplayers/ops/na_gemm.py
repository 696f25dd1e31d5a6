"""The GEMM-tiled kernel of neighborhood attention: batched matmuls over whole tile blocks.

A tile of ``tH x tW`` queries reads the union of its windows, a region of ``RH x RW`` keys (the
row and column axes of :mod:`tplayers.ops.na_geometry`; 1-D runs with one row, 3-D with the
leading axes merged into the row axis). The kernel keeps the image's planes as they are,
``(B, heads, rows, cols, D)``, and cuts a *block* of ``ca x cb`` tiles at a time out of them with
two ``index_select`` per tensor (row indices, then column indices: the axes' tiles are
separable, :class:`~tplayers.ops.na_layout.AxisTiles`), so a block's queries, keys and values
are each one contiguous batch of tiles. Per block:
``S = (scale Q) K^T`` (one ``bmm`` over every (batch, head, tile)), the window mask added as the
outer sum of a row pattern and a column pattern (0 / -inf, broadcast), the bias added, ``P =
softmax(S)``, ``O = P V`` (one ``bmm``). Backward, per block: ``S`` and ``P`` again, ``dV = P^T
dO``, ``dP = dO V^T``, ``dS = P (dP - rowsum(dO O))``, ``dQ = dS K``, ``dK = dS^T (scale Q)``,
``dbias = sum_b dS``: five ``bmm`` and the scatter-adds of ``dK`` / ``dV`` (columns, then rows).

Padding slots (a partial tile repeats a query) read a zero gradient row, so they add nothing;
outputs are picked per axis from the tile buffer by each query's slot. Blocks hold at most
``CHUNK_SCORES`` (forward) / ``BACKWARD_CHUNK_SCORES`` scores over all (batch, head) planes, so
peak memory stays within a few times ``B*heads*H*W*k^2`` however large the image.

:func:`default_tile` picks the tile from the kernel (measured, ``benchmarks/na.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

import torch

from tplayers.ops.na_geometry import row_tiles, split_geometry
from tplayers.ops.na_layout import AxisTiles

__all__ = ["GemmPlan", "gemm_plan", "GemmAttention", "gemm_forward", "gemm_backward", "default_tile"]

#: scores per forward block, all (batch, head) planes together (1 MiB of fp32)
CHUNK_SCORES = 1 << 18
#: the same for backward (it holds P, dP and the dK / dV tiles besides)
BACKWARD_CHUNK_SCORES = 1 << 17


def default_tile(kernel: Sequence[int]) -> Tuple[int, ...]:
    """Queries per tile per axis. The column axis takes about ``k + 1`` (at least 4, at most 32):
    a tile of ``t`` reads ``t + k - 1`` columns, so ``t`` near ``k`` keeps the union within about
    twice the window while the ``bmm`` grows with it. In 2-D and 3-D the row axis takes 4 (k >= 5)
    or 8 (smaller kernels) and the column axis 4 / 8 likewise: measured fastest (one core) against
    2x8, 4x8, 8x8 and 1xN tiles. Leading axes of a 3-D call take 1."""
    if len(kernel) == 1:
        return (max(4, min(32, kernel[0] + 1)),)
    per_axis = [4 if k >= 5 else 8 for k in kernel]
    per_axis[: len(kernel) - 2] = [1] * (len(kernel) - 2)
    return tuple(per_axis)


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
    (n*R,), each query's slot ``out_*``, the additive window patterns ``mask_*`` (n, t, R), the
    bias indices ``rel_*`` (n, t, R); ``blocks``: ``(a0, a1, b0, b1)`` tile-row / tile-column ranges."""

    th: AxisTiles
    tw: AxisTiles
    q_h: torch.Tensor
    q_w: torch.Tensor
    dest_h: torch.Tensor
    dest_w: torch.Tensor
    k_h: torch.Tensor
    k_w: torch.Tensor
    out_h: torch.Tensor
    out_w: torch.Tensor
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
        to(th.out_pos),
        to(tw.out_pos),
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


def _tiles(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, th: int, tw: int) -> torch.Tensor:
    """``x`` (B, heads, rows, cols, D) -> (B*heads*na*nb, th*tw, D): the tiles of ``rows`` (na*th,)
    and ``cols`` (nb*tw,), one contiguous batch."""
    b, h, d = x.shape[0], x.shape[1], x.shape[-1]
    t = x.index_select(2, rows).index_select(3, cols)
    na, nb = rows.numel() // th, cols.numel() // tw
    t = t.view(b, h, na, th, nb, tw, d).transpose(3, 4)
    return t.reshape(b * h * na * nb, th * tw, d)


def _untile(t: torch.Tensor, b: int, h: int, na: int, nb: int, th: int, tw: int) -> torch.Tensor:
    """The inverse layout of :func:`_tiles`: (b*h*na*nb, th*tw, D) -> (b, h, na*th, nb*tw, D) (a copy)."""
    d = t.shape[-1]
    return t.view(b, h, na, nb, th, tw, d).transpose(3, 4).reshape(b, h, na * th, nb * tw, d)


def _scores(plan: GemmPlan, block, qt, kt, table, batch: int, heads: int) -> torch.Tensor:
    """``(scale Q) K^T + window + bias`` of one block: (B*heads*na*nb, tq, R)."""
    a0, a1, b0, b1 = block
    th, tw = plan.th, plan.tw
    s = torch.bmm(qt, kt.transpose(1, 2))
    view = s.view(batch, heads, a1 - a0, b1 - b0, th.tile, tw.tile, th.region, tw.region)
    mask = plan.mask_h[a0:a1, None, :, None, :, None] + plan.mask_w[None, b0:b1, None, :, None, :]
    view.add_(mask)
    if table is not None:
        rel = _rel(plan, table.shape[-1])[a0:a1, b0:b1]
        view.add_(table.flatten(1)[:, rel])
    return s


def _planes(x: torch.Tensor, heads: int, rows: int, cols: int) -> torch.Tensor:
    """(B, rows*cols, heads*D) pixel-major -> (B, heads, rows, cols, D) (a view)."""
    return x.view(x.shape[0], rows, cols, heads, -1).permute(0, 3, 1, 2, 4)


def _dims(plan: GemmPlan, geo) -> Tuple[int, int, int, int]:
    axes = split_geometry(geo)[0]
    rows = (math.prod(a.q_count for a in axes[:-1]), math.prod(a.k_count for a in axes[:-1]))
    return rows[0], axes[-1].q_count, rows[1], axes[-1].k_count


def gemm_forward(q, k, v, table, geo: List[int], scale: float, heads: int) -> torch.Tensor:
    """Forward: ``q`` (B, Pq, heads*D), ``k``/``v`` (B, Pk, heads*D|Dv) pixel-major, ``table``
    the bias or None -> (B, Pq, heads*Dv). ``k`` / ``v`` hold ``heads`` heads (GQA expanded)."""
    batch = q.shape[0]
    plan = gemm_plan(tuple(geo), batch * heads, q.device, q.dtype)
    hq, wq, hk, wk = _dims(plan, geo)
    th, tw = plan.th, plan.tw
    qp = _planes(q, heads, hq, wq)
    kp, vp = _planes(k, heads, hk, wk), _planes(v, heads, hk, wk)
    dim_v = vp.shape[-1]
    buf = q.new_empty(batch, heads, th.num_tiles * th.tile, tw.num_tiles * tw.tile, dim_v)
    for block in plan.blocks:
        a0, a1, b0, b1 = block
        rq, cq = plan.q_h[a0 * th.tile : a1 * th.tile], plan.q_w[b0 * tw.tile : b1 * tw.tile]
        rk, ck = plan.k_h[a0 * th.region : a1 * th.region], plan.k_w[b0 * tw.region : b1 * tw.region]
        qt = _tiles(qp, rq, cq, th.tile, tw.tile).mul_(scale)
        kt, vt = _tiles(kp, rk, ck, th.region, tw.region), _tiles(vp, rk, ck, th.region, tw.region)
        probs = torch.softmax(_scores(plan, block, qt, kt, table, batch, heads), -1)
        out = torch.bmm(probs, vt)
        del probs, qt, kt, vt
        buf[:, :, a0 * th.tile : a1 * th.tile, b0 * tw.tile : b1 * tw.tile] = _untile(
            out, batch, heads, a1 - a0, b1 - b0, th.tile, tw.tile
        )
    out = buf.index_select(2, plan.out_h).index_select(3, plan.out_w)  # (B, heads, hq, wq, Dv)
    return out.permute(0, 2, 3, 1, 4).reshape(batch, hq * wq, heads * dim_v)


def gemm_backward(
    grad_out, q, k, v, table, out, geo: List[int], scale: float, heads: int, want_kv=True, want_bias=True
):
    """``(dq, dk, dv, dtable)`` of :func:`gemm_forward` (``dk`` / ``dv`` None unless ``want_kv``,
    ``dtable`` None without a table or ``want_bias``)."""
    batch = q.shape[0]
    plan = gemm_plan(tuple(geo), batch * heads, q.device, q.dtype)
    hq, wq, hk, wk = _dims(plan, geo)
    th, tw = plan.th, plan.tw
    qp = _planes(q, heads, hq, wq)
    kp, vp = _planes(k, heads, hk, wk), _planes(v, heads, hk, wk)
    dim, dim_v = qp.shape[-1], vp.shape[-1]
    g = grad_out.reshape(batch, hq * wq, heads * dim_v)
    gp = _planes(g, heads, hq, wq)
    delta = (gp * _planes(out, heads, hq, wq)).sum(-1, keepdim=True)  # (B, heads, hq, wq, 1)
    # a zero row and column: padding slots read them (their gradient adds nothing)
    gp = torch.nn.functional.pad(gp, (0, 0, 0, 1, 0, 1))
    delta = torch.nn.functional.pad(delta, (0, 0, 0, 1, 0, 1))
    dq_buf = q.new_empty(batch, heads, th.num_tiles * th.tile, tw.num_tiles * tw.tile, dim)
    dk = q.new_zeros(batch, heads, hk, wk, dim) if want_kv else None
    dv = q.new_zeros(batch, heads, hk, wk, dim_v) if want_kv else None
    want_bias = want_bias and table is not None
    dtable = torch.zeros_like(table).flatten(1) if want_bias else None
    for block in plan.blocks_bwd:
        a0, a1, b0, b1 = block
        na, nb = a1 - a0, b1 - b0
        rq, cq = plan.q_h[a0 * th.tile : a1 * th.tile], plan.q_w[b0 * tw.tile : b1 * tw.tile]
        rd, cd = plan.dest_h[a0 * th.tile : a1 * th.tile], plan.dest_w[b0 * tw.tile : b1 * tw.tile]
        rk, ck = plan.k_h[a0 * th.region : a1 * th.region], plan.k_w[b0 * tw.region : b1 * tw.region]
        qt = _tiles(qp, rq, cq, th.tile, tw.tile).mul_(scale)
        kt, vt = _tiles(kp, rk, ck, th.region, tw.region), _tiles(vp, rk, ck, th.region, tw.region)
        gt, dt = _tiles(gp, rd, cd, th.tile, tw.tile), _tiles(delta, rd, cd, th.tile, tw.tile)
        probs = torch.softmax(_scores(plan, block, qt, kt, table, batch, heads), -1)
        ds = torch.bmm(gt, vt.transpose(1, 2)).sub_(dt).mul_(probs)
        if want_kv:
            _scatter(dv, torch.bmm(probs.transpose(1, 2), gt), rk, ck, (batch, heads, na, nb, th.region, tw.region))
        del probs, vt, gt
        dq_buf[:, :, a0 * th.tile : a1 * th.tile, b0 * tw.tile : b1 * tw.tile] = _untile(
            torch.bmm(ds, kt), batch, heads, na, nb, th.tile, tw.tile
        )
        del kt
        if want_kv:
            _scatter(dk, torch.bmm(ds.transpose(1, 2), qt), rk, ck, (batch, heads, na, nb, th.region, tw.region))
        if want_bias:
            rel = _rel(plan, table.shape[-1])[a0:a1, b0:b1].flatten()
            dtable.index_add_(1, rel, ds.view(batch, heads, -1).sum(0))
        del ds, qt
    dq = dq_buf.index_select(2, plan.out_h).index_select(3, plan.out_w).mul_(scale)
    dq = dq.permute(0, 2, 3, 1, 4).reshape(q.shape)
    if want_kv:
        dk = dk.permute(0, 2, 3, 1, 4).reshape(k.shape)
        dv = dv.permute(0, 2, 3, 1, 4).reshape(v.shape)
    return dq, dk, dv, (dtable.view(table.shape) if want_bias else None)


def _scatter(dest: torch.Tensor, tiles: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape) -> None:
    """``dest`` (B, heads, rows, cols, D) += the block's region tiles (columns, then rows)."""
    b, h, na, nb, rh, rw = shape
    d = tiles.shape[-1]
    flat = _untile(tiles, b, h, na, nb, rh, rw)  # (B, heads, na*RH, nb*RW, D)
    by_col = dest.new_zeros(b, h, na * rh, dest.shape[3], d).index_add_(3, cols, flat)
    dest.index_add_(2, rows, by_col)


class GemmAttention(torch.autograd.Function):
    """Neighborhood attention on the GEMM-tiled kernel (same inputs as
    :class:`~tplayers.ops.na_cpu.CAttention`: pixel-major ``q``, ``k``, ``v``, the bias ``table``
    or None, the geometry list, the scale, the query heads)."""

    @staticmethod
    def forward(ctx, q, k, v, table, geo, scale: float, heads: int):
        out = gemm_forward(q, k, v, table, geo, scale, heads)
        ctx.save_for_backward(q, k, v, table, out)
        ctx.geo, ctx.scale, ctx.heads = geo, scale, heads
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, table, out = ctx.saved_tensors
        want = ctx.needs_input_grad
        dq, dk, dv, dt = gemm_backward(
            grad_out, q, k, v, table, out, ctx.geo, ctx.scale, ctx.heads, want[1] or want[2], want[3]
        )
        return dq, dk, dv, dt, None, None, None
