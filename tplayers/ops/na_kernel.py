"""The fused tile kernel of neighborhood attention (torch ops only, CPU or any device).

Work is tiled as in :mod:`tplayers.ops.na_layout`: ``tH x tW`` queries share a key
region of ``RH x RW`` pixels. :class:`TilePlan` holds, for one geometry, the flat
pixel index of every query slot and region slot, the window mask as a few distinct
``(tq, R)`` patterns (tiles whose windows sit alike share one) and the chunks the
tiles are processed in. :class:`TileAttention` runs the tiles chunk by chunk,
flash-style: gather a chunk's Q/K/V tiles (all batches and heads; the gather rows
of every chunk are built once per shape), copy the window mask in and accumulate
the scaled scores onto it (one ``baddbmm_``), add the bias, softmax, apply the
values (one ``bmm``), and keep nothing score-sized: backward gathers and scores
the chunk again, in smaller chunks of its own. Saved for backward: the inputs,
the output and the bias table, so peak memory is the inputs' and gradients' size
plus one chunk's tiles and scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from tplayers.ops.na_geometry import row_tiles, split_geometry
from tplayers.ops.na_layout import AxisTiles

__all__ = [
    "TilePlan",
    "tile_plan",
    "tile_plans",
    "TileAttention",
    "tile_backward",
    "CHUNK_SCORES",
    "BACKWARD_CHUNK_SCORES",
]

#: score elements per forward chunk, all (batch, head) planes together: 128 Ki fp32 = 512 KiB,
#: so a chunk's scores and tiles stay in a core's L2 cache
CHUNK_SCORES = 1 << 17
#: the same for backward, which holds dO, dS and the dK/dV tiles besides: smaller chunks keep
#: forward+backward under 4x the B*heads*H*W*k^2 score bound
BACKWARD_CHUNK_SCORES = 3 << 14


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Index tables of one tiled geometry (on the compute device).

    ``q_flat`` (T*tq,): flat query pixel of each query slot (a padding slot repeats a
    real query); ``q_dest``: the same, -1 at padding slots. ``k_flat`` (T*R,): flat key
    pixel of each region slot. ``valid`` (T*tq,) 1/0, or None when no slot pads.
    ``masks`` (P, tq, R): additive window patterns (0 / -inf); ``mask_id`` (T,): each
    tile's pattern. ``chunks``: ``[t0, t1)`` tile ranges; ``chunk_pattern``: per chunk the
    one pattern all its tiles share, or -1.
    """

    th: AxisTiles
    tw: AxisTiles
    q_flat: torch.Tensor
    q_dest: torch.Tensor
    k_flat: torch.Tensor
    valid: Optional[torch.Tensor]
    masks: torch.Tensor
    mask_id: torch.Tensor
    chunks: Tuple[Tuple[int, int], ...]
    chunk_pattern: Tuple[int, ...]

    @property
    def tq(self) -> int:
        return self.th.tile * self.tw.tile

    @property
    def region(self) -> int:
        return self.th.region * self.tw.region

    @property
    def num_tiles(self) -> int:
        return self.th.num_tiles * self.tw.num_tiles

    def chunk_masks(self, chunk: int) -> torch.Tensor:
        """``(t1 - t0, tq, R)`` additive masks of chunk number ``chunk`` (a view when it has one pattern)."""
        (t0, t1), pattern = self.chunks[chunk], self.chunk_pattern[chunk]
        if pattern >= 0:
            return self.masks[pattern].expand(t1 - t0, -1, -1)
        return self.masks.index_select(0, self.mask_id[t0:t1])


def _unique_rows(mask: torch.Tensor):
    """Distinct ``mask[i]`` patterns of an axis and each tile's pattern id."""
    flat = mask.flatten(1)
    patterns, ids = torch.unique(flat, dim=0, return_inverse=True)
    return patterns.view(-1, *mask.shape[1:]), ids


@lru_cache(maxsize=32)
def tile_plan(
    th: AxisTiles,
    tw: AxisTiles,
    wq: int,
    wk: int,
    device: torch.device,
    dtype: torch.dtype,
    chunk_scores: int = CHUNK_SCORES,
) -> TilePlan:
    """The :class:`TilePlan` of two axes' tiles; ``wq`` / ``wk``: row widths of the q / k tensors."""
    q_flat = th.q_index[:, None, :, None] * wq + tw.q_index[None, :, None, :]  # (nth, ntw, tH, tW)
    k_flat = th.k_index[:, None, :, None] * wk + tw.k_index[None, :, None, :]  # (nth, ntw, RH, RW)
    ti, mi = th.out_pos // th.tile, th.out_pos % th.tile
    tj, mj = tw.out_pos // tw.tile, tw.out_pos % tw.tile
    out_flat = ((ti[:, None] * tw.num_tiles + tj[None, :]) * th.tile + mi[:, None]) * tw.tile + mj[None, :]
    valid = torch.zeros(q_flat.numel(), dtype=dtype)
    valid[out_flat.flatten()] = 1
    q_dest = torch.where(valid == 1, q_flat.flatten(), -1)
    valid = None if bool((valid == 1).all()) else valid.to(device)
    # window masks: the outer product of one row pattern and one column pattern per tile
    ph, idh = _unique_rows(th.mask)  # (Ph, tH, RH), (nth,)
    pw, idw = _unique_rows(tw.mask)  # (Pw, tW, RW), (ntw,)
    inside = ph[:, None, :, None, :, None] & pw[None, :, None, :, None, :]  # (Ph, Pw, tH, tW, RH, RW)
    tq, region = th.tile * tw.tile, th.region * tw.region
    inside = inside.reshape(ph.shape[0] * pw.shape[0], tq, region)
    masks = torch.zeros(inside.shape, dtype=dtype).masked_fill_(~inside, float("-inf"))
    mask_id = (idh[:, None] * pw.shape[0] + idw[None, :]).flatten()
    # chunks of consecutive tiles (row-major over the tile grid), about chunk_scores scores per plane
    num_tiles, per_chunk = th.num_tiles * tw.num_tiles, max(1, chunk_scores // (tq * region))
    chunks: List[Tuple[int, int]] = []
    pattern: List[int] = []
    for t0 in range(0, num_tiles, per_chunk):
        t1 = min(t0 + per_chunk, num_tiles)
        ids = mask_id[t0:t1]
        chunks.append((t0, t1))
        pattern.append(int(ids[0]) if bool((ids == ids[0]).all()) else -1)
    return TilePlan(
        th,
        tw,
        q_flat.flatten().to(device),
        q_dest.to(device),
        k_flat.flatten().to(device),
        valid,
        masks.to(device),
        mask_id.to(device),
        tuple(chunks),
        tuple(pattern),
    )


def tile_plans(geo: List[int], device: torch.device, dtype: torch.dtype) -> Tuple[TilePlan, TilePlan]:
    """The forward and backward :class:`TilePlan` of a :func:`~tplayers.ops.na_geometry.geometry_args`
    list (cached): the leading spatial axes merged into the row axis, the last one the columns."""
    axes, fwd, bwd = split_geometry(geo)
    th, col = row_tiles(axes[:-1]), axes[-1]
    tw = col.tiles(col.tile)
    plan = tile_plan(th, tw, col.q_count, col.k_count, device, dtype, fwd)
    return plan, plan if bwd == fwd else tile_plan(th, tw, col.q_count, col.k_count, device, dtype, bwd)


@lru_cache(maxsize=32)
def _rel_index(plan: TilePlan, width: int) -> torch.Tensor:
    """Flat ``rel_h * width + rel_w`` index of every score, in tile order: (T, tq, R)."""
    th, tw = plan.th, plan.tw
    flat = th.rel[:, None, :, None, :, None] * width + tw.rel[None, :, None, :, None, :]  # (nth, ntw, tH, tW, RH, RW)
    return flat.reshape(plan.num_tiles, plan.tq, plan.region).to(plan.masks.device)


def _rows(pix: torch.Tensor, batch: int, pixels: int, heads: int, dummy: bool = False) -> torch.Tensor:
    """Rows of pixels ``pix`` in a ``(batch * pixels * heads, D)`` matrix, ordered (batch, head, pix).

    With ``dummy``, negative ``pix`` (padding slots) map to the row after the last.
    """
    dev = pix.device
    rows = (
        (torch.arange(batch, device=dev)[:, None, None] * pixels + pix) * heads
        + torch.arange(heads, device=dev)[None, :, None]
    ).flatten()
    if dummy:
        rows = rows.masked_fill((pix < 0).expand(batch, heads, -1).flatten(), batch * pixels * heads)
    return rows


@lru_cache(maxsize=8)
def _chunk_rows(plan: TilePlan, batch: int, heads: int, pq: int, pk: int):
    """Per chunk ``(q_rows, k_rows, dest)``: the gather rows of its Q and K/V tiles and the
    output rows of its query slots (padding slots to the dummy row), built once per shape.
    int64 throughout: ``index_add_`` with int32 rows measured slower on the CPU."""
    tq, region = plan.tq, plan.region
    return tuple(
        (
            _rows(plan.q_flat[t0 * tq : t1 * tq], batch, pq, heads),
            _rows(plan.k_flat[t0 * region : t1 * region], batch, pk, heads),
            _rows(plan.q_dest[t0 * tq : t1 * tq], batch, pq, heads, dummy=True),
        )
        for t0, t1 in plan.chunks
    )


def _gather(src: torch.Tensor, rows: torch.Tensor, per_tile: int) -> torch.Tensor:
    """Rows of ``src`` (B*P*heads, D) -> (B * heads * tiles, per_tile, D), contiguous."""
    return src.index_select(0, rows).view(-1, per_tile, src.shape[1])


def _scores(plan: TilePlan, chunk: int, qt, kt, scale: float, table, heads: int) -> torch.Tensor:
    """Masked (and biased) scores ``mask + scale * Q K^T (+ bias)`` of chunk number ``chunk``:
    (B*heads*c, tq, R). The mask is copied in first and the product accumulated onto it (one
    ``baddbmm_``: no separate passes to scale Q and to add the mask)."""
    t0, t1 = plan.chunks[chunk]
    c = t1 - t0
    scores = qt.new_empty(qt.shape[0], plan.tq, plan.region)
    scores.view(-1, c, plan.tq, plan.region).copy_(plan.chunk_masks(chunk))
    scores.baddbmm_(qt, kt.transpose(1, 2), alpha=scale)
    if table is not None:
        rel = _rel_index(plan, table.shape[-1])[t0:t1]
        bias = table.flatten(1).index_select(1, rel.flatten()).view(heads, c, plan.tq, plan.region)
        scores.view(-1, heads, c, plan.tq, plan.region).add_(bias)
    return scores


class TileAttention(torch.autograd.Function):
    """Neighborhood attention over a :class:`TilePlan`, chunk by chunk, nothing score-sized kept.

    forward: per chunk ``S = scale Q K^T + window (0/-inf) + bias``, ``P = softmax(S)``, ``O = P V`` /
    backward: ``Dq = rowsum(dO * O)`` once, then per chunk ``S`` and ``P`` again (torch's fused
    softmax measured faster than ``exp(S - logsumexp)`` from a saved log-sum-exp),
    ``dV += P^T dO``, ``dS = P * (dO V^T - Dq)``, ``dQ = scale dS K``, ``dK += scale dS^T Q``,
    ``dbias += sum over batch of dS``.
    Inputs: ``q`` (B, Pq, heads*D), ``k``/``v`` (B, Pk, heads*D|Dv) pixel-major, contiguous;
    ``plan`` for forward and ``plan_bwd`` (same tiles, smaller chunks) for backward; the bias
    ``table`` (heads, 2kH-1, 2kW-1) or None. Returns (B, Pq, heads*Dv).
    """

    @staticmethod
    def forward(ctx, q, k, v, table, plan: TilePlan, plan_bwd: TilePlan, scale: float, heads: int):
        batch, pq, pk = q.shape[0], q.shape[1], k.shape[1]
        tq, region = plan.tq, plan.region
        q2, k2, v2 = (x.view(-1, x.shape[-1] // heads) for x in (q, k, v))  # one row per (pixel, head)
        out = q.new_empty(q2.shape[0] + 1, v2.shape[1])  # the last row takes the padding slots
        for chunk, (q_rows, k_rows, dest) in enumerate(_chunk_rows(plan, batch, heads, pq, pk)):
            qt = _gather(q2, q_rows, tq)
            kt, vt = _gather(k2, k_rows, region), _gather(v2, k_rows, region)
            probs = torch.softmax(_scores(plan, chunk, qt, kt, scale, table, heads), -1)
            out.index_copy_(0, dest, torch.bmm(probs, vt).view(-1, vt.shape[-1]))
            del qt, kt, vt, probs
        out = out[:-1].view(batch, pq, -1)
        ctx.save_for_backward(q, k, v, table, out)
        ctx.plan, ctx.scale, ctx.heads = plan_bwd, scale, heads
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, table, out = ctx.saved_tensors
        want = ctx.needs_input_grad
        grads = tile_backward(
            grad_out,
            q,
            k,
            v,
            table,
            out,
            ctx.plan,
            ctx.scale,
            ctx.heads,
            want[1],
            want[2],
            table is not None and want[3],
        )
        return (*grads, None, None, None, None)


def tile_backward(
    grad_out, q, k, v, table, out, plan: TilePlan, scale: float, heads: int, want_k: bool, want_v: bool, want_bias: bool
):
    """:class:`TileAttention`'s backward as a function: ``(dq, dk or None, dv or None, dtable or None)``."""
    batch, pq, pk = q.shape[0], q.shape[1], k.shape[1]
    tq, region = plan.tq, plan.region
    q2, k2, v2 = (x.view(-1, x.shape[-1] // heads) for x in (q, k, v))
    g2 = grad_out.reshape(-1, v2.shape[1])  # a view when it can be (an expanded grad of .sum())
    delta = _rowdot(g2, out.view(-1, v2.shape[1]))  # rowsum(dO * O) per query; 0 in the dummy row
    grad_q = q.new_empty(q2.shape[0] + 1, q2.shape[1])  # every query written once; last row: padding
    grad_k = torch.zeros_like(k2) if want_k else None
    grad_v = torch.zeros_like(v2) if want_v else None
    grad_table = torch.zeros_like(table).flatten(1) if want_bias else None
    for chunk, (q_rows, k_rows, dest) in enumerate(_chunk_rows(plan, batch, heads, pq, pk)):
        t0, t1 = plan.chunks[chunk]
        qt = _gather(q2, q_rows, tq)
        kt, vt = _gather(k2, k_rows, region), _gather(v2, k_rows, region)
        gt = _gather(g2, q_rows, tq)
        if plan.valid is not None:  # padding slots repeat a query: they must add nothing
            gt.view(batch * heads, -1, tq, gt.shape[-1]).mul_(plan.valid[t0 * tq : t1 * tq].view(-1, tq, 1))
        probs = torch.softmax(_scores(plan, chunk, qt, kt, scale, table, heads), -1)
        ds = torch.bmm(gt, vt.transpose(1, 2)).sub_(delta.index_select(0, dest).view(-1, tq, 1)).mul_(probs)
        del vt
        if want_v:
            grad_v.index_add_(0, k_rows, torch.bmm(probs.transpose(1, 2), gt).view(-1, gt.shape[-1]))
        del probs, gt
        grad_q.index_copy_(0, dest, torch.bmm(ds, kt).view(-1, kt.shape[-1]))  # times scale below
        del kt
        if want_k:
            # times scale at the end, like dQ
            grad_k.index_add_(0, k_rows, torch.bmm(ds.transpose(1, 2), qt).view(-1, qt.shape[-1]))
        if want_bias:
            rel = _rel_index(plan, table.shape[-1])[t0:t1].flatten()
            grad_table.index_add_(1, rel, ds.view(batch, heads, -1).sum(0))
    grad_q = grad_q[:-1].mul_(scale).view(q.shape)
    grad_table = grad_table.view(table.shape) if want_bias else None
    grad_k = grad_k.mul_(scale).view(k.shape) if want_k else None
    grad_v = grad_v.view(v.shape) if want_v else None
    return grad_q, grad_k, grad_v, grad_table


def _rowdot(a: torch.Tensor, b: torch.Tensor, rows: int = 1 << 12) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two ``(N, D)`` matrices and a last 0 (the padding slots' dummy row),
    in slices of ``rows`` (no ``N x D`` temporary)."""
    out = a.new_zeros(a.shape[0] + 1)
    for r0 in range(0, a.shape[0], rows):
        stop = min(r0 + rows, a.shape[0])
        torch.sum(a[r0:stop] * b[r0:stop], -1, out=out[r0:stop])
    return out
