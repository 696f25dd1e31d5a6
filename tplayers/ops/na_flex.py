"""Neighborhood attention through torch's ``flex_attention``: the default kernel on CUDA.

Each query's window (NATTEN's rule, :func:`tplayers.ops.na_layout.window_starts`: shifted inside the
image at borders, dilation groups, causal per axis, stride groups sharing their leader's window) is
a product of per-axis key ranges, so the mask is two small tables per axis: for every local query
coordinate the first and last local key coordinate of its window (keys between them at steps of the
dilation). ``mask_mod`` reads those tables; the block mask (which 128 x 128 blocks of row-major
(query, key) tokens can hold a window member) is built from the same tables without evaluating the
mask on all ``Lq x Lk`` pairs: a block of queries covers a box of coordinates per axis, its windows
fall inside the box of their per-axis key ranges, and a key block is listed where its own box
meets that one (a superset of the blocks that matter; ``mask_mod`` decides inside them).

On CUDA ``flex_attention`` runs compiled (``torch.compile``, inductor's Triton template: one fused
kernel forward and one backward, compiled on a process's first call: 8-15 s on an H100);
elsewhere (``TPLAYERS_NA_KERNEL=flex`` on the CPU) it runs eagerly, which materialises the scores
and has no backward: for tests only. Measured on an
H100 (``benchmarks/na_gpu.py``, fp32): 1.4-10x the tile kernel forward and 1.9-14x forward +
backward (na2d 1x64x64 and 4x128x128 k7, na1d 8x16384 k33, na3d 16^3 k5). Where it applies:
:func:`flex_applies`. fp32 inputs run in fp32; bf16 and fp16 inputs run as they are, as flash
attention and NATTEN's fused kernels run them: the scores, the softmax state and every sum in fp32
inside the kernel, the probabilities (and dS) rounded to the input dtype before their matmuls. On
an H100 that ran 3.7x / 12.6x (forward / forward + backward) faster than this kernel on fp32 copies
at na2d 4x128x128 bf16 (8 heads, d64), with the output's error the same and the gradients' twice
(benchmarks/RESULTS.md). See docs/neighborhood-attention.md.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch

from tplayers.ops.na_geometry import Axis
from tplayers.ops.na_layout import window_starts

__all__ = ["flex_module", "flex_applies", "flex_attention_na", "axis_windows", "block_table", "BLOCK"]

#: tokens per block of the block mask (flex_attention's default)
BLOCK = 128
#: the most (query block, key block) pairs a call's block mask may hold on the default path: its
#: kv and q index tables take 8 bytes a pair (2**26: 512 MB, about 1M tokens a call)
MAX_BLOCK_PAIRS = 2**26
#: the head dims the CUDA default takes (powers of two; 32 and 64 measured and tested on an H100)
HEAD_DIMS = (16, 32, 64, 128, 256)


def flex_module():
    """``torch.nn.attention.flex_attention``, or None where this torch has none."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:  # torch < 2.5
        return None
    return module


def flex_applies(
    q: torch.Tensor, v: torch.Tensor, compute: torch.dtype, has_bias: bool, window: int = 1
) -> Optional[str]:
    """None when the flex kernel is the default for this call, else why not: a CUDA tensor (other
    devices run it only when forced), fp32 / bf16 / fp16 (``compute``: fp32 for all three, see
    :func:`~tplayers.ops.na_dispatch.compute_dtype`; bf16 / fp16 then run natively, see the module
    docstring; fp64 runs the tile kernel), one head dim for q, k and v among :data:`HEAD_DIMS`, no
    relative-position bias, a block mask (8 bytes a block pair) within :data:`MAX_BLOCK_PAIRS` pairs and within the
    kernels' memory bound, 4x the fp32 scores ``B * heads * Lq * window`` (``window``: the keys of
    one query's window; beyond, the tile kernel runs, its memory linear in the tokens), a torch
    with ``flex_attention``."""
    if q.device.type != "cuda":
        return f"the flex kernel is the CUDA default, got a {q.device.type} tensor"
    if compute != torch.float32:
        return f"the compiled flex kernel takes fp32, bf16 or fp16 inputs (fp32 compute), got {compute}"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        return f"the flex default takes one head dim in {HEAD_DIMS} for q and v, got {q.shape[-1]} and {v.shape[-1]}"
    if has_bias:
        return "the flex kernel takes no relative-position bias"
    q_tokens = math.prod(q.shape[1:-2])
    pairs = -(-q_tokens // BLOCK) * -(-math.prod(v.shape[1:-2]) // BLOCK)
    bound = 2 * q.shape[0] * q.shape[-2] * q_tokens * window  # 8-byte pairs in 16 * scores bytes
    if pairs > min(MAX_BLOCK_PAIRS, bound):
        return f"its block mask would index {pairs} block pairs (> {min(MAX_BLOCK_PAIRS, bound)}: 8 bytes each)"
    if flex_module() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    return None


def axis_windows(axis: Axis) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` int64, one entry per query ``axis`` holds (``q_start + [0, q_count)``): the
    local key coordinates (global minus ``k_start``) of the first and last window member of each;
    the members are ``lo, lo + dilation, ..., hi``."""
    pos = torch.arange(axis.q_start, axis.q_start + axis.q_count, dtype=torch.int64)
    first, count = window_starts(pos, axis.length, axis.kernel, axis.dilation, bool(axis.causal), axis.stride)
    lo = pos % axis.dilation + axis.dilation * first - axis.k_start
    return lo, lo + axis.dilation * (count - 1)


def _block_boxes(sizes: Sequence[int], block: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` ``(blocks, rank)``: per block of ``block`` row-major tokens of a ``sizes``
    grid, the smallest and largest coordinate along each axis among its tokens (the whole axis
    where the block wraps around it)."""
    total = math.prod(sizes)
    start = torch.arange(0, total, block, dtype=torch.int64, device=device)
    stop = torch.clamp(start + block, max=total) - 1
    lows, highs = [], []
    for axis, size in enumerate(sizes):
        inner = math.prod(sizes[axis + 1 :])
        a, b = start // inner, stop // inner
        wraps = (b - a + 1 >= size) | (a % size > b % size)
        lows.append(torch.where(wraps, 0, a % size))
        highs.append(torch.where(wraps, size - 1, b % size))
    return torch.stack(lows, 1), torch.stack(highs, 1)


def _range_extrema(lo: torch.Tensor, hi: torch.Tensor, low: torch.Tensor, high: torch.Tensor):
    """Per block, ``min(lo)`` and ``max(hi)`` over its coordinates ``[low, high]`` along one axis, or
    over a range starting at ``low`` as long as the longest block's (a superset; blocks over the whole
    axis take the whole axis). Sliding windows of that length: memory linear in the axis."""
    whole = (low == 0) & (high == len(lo) - 1)
    span = int((high - low + 1).masked_fill(whole, 1).max()) if len(low) else 1
    big = torch.iinfo(torch.int64).max
    pad = (span - 1,)
    slide_lo = torch.cat([lo, lo.new_full(pad, big)]).unfold(0, span, 1).amin(1)
    slide_hi = torch.cat([hi, hi.new_full(pad, -big)]).unfold(0, span, 1).amax(1)
    return torch.where(whole, lo.min(), slide_lo[low]), torch.where(whole, hi.max(), slide_hi[low])


def block_table(windows, q_sizes: Sequence[int], k_sizes: Sequence[int], block: int = BLOCK) -> torch.Tensor:
    """Bool ``(q_blocks, k_blocks)``: True where a block of queries may attend to a block of keys.
    ``windows``: per axis :func:`axis_windows`' ``(lo, hi)`` (their device is the table's). A
    superset of the exact block mask."""
    device = windows[0][0].device
    q_low, q_high = _block_boxes(q_sizes, block, device)
    k_low, k_high = _block_boxes(k_sizes, block, device)
    table = torch.ones(q_low.shape[0], k_low.shape[0], dtype=torch.bool, device=device)
    for axis, (lo, hi) in enumerate(windows):
        key_lo, key_hi = _range_extrema(lo, hi, q_low[:, axis], q_high[:, axis])  # (q_blocks,)
        table &= (k_low[None, :, axis] <= key_hi[:, None]) & (k_high[None, :, axis] >= key_lo[:, None])
    return table


def _mask_mod(tables, dilations, q_sizes, k_sizes):
    """``mask_mod(b, h, q_idx, kv_idx)``: the key is a member of the query's window on every axis."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = None
        qi, ki = q_idx, kv_idx
        for (lo, hi), dil, q_size, k_size in reversed(list(zip(tables, dilations, q_sizes, k_sizes))):
            qc, kc = qi % q_size, ki % k_size
            qi, ki = qi // q_size, ki // k_size
            first, last = lo[qc], hi[qc]
            inside = (kc >= first) & (kc <= last)
            if dil > 1:
                inside = inside & ((kc - first) % dil == 0)
            keep = inside if keep is None else keep & inside
        return keep

    return mask_mod


@lru_cache(maxsize=8)
def _block_mask(axes: Tuple[Axis, ...], device: torch.device):
    """The ``BlockMask`` of one call's axes (:class:`~tplayers.ops.na_geometry.Axis`, counts
    given), cached (8 of them: a training loop builds each once; each holds ``q_blocks *
    k_blocks`` int32 indices twice)."""
    q_sizes, k_sizes = tuple(a.q_count for a in axes), tuple(a.k_count for a in axes)
    windows = [tuple(t.to(device) for t in axis_windows(a)) for a in axes]
    table = block_table(windows, q_sizes, k_sizes)
    counts = table.sum(1, dtype=torch.int32)
    # each row's listed key blocks first, ascending (full width: flex transposes it to q blocks)
    rows, cols = table.nonzero(as_tuple=True)
    slot = torch.arange(len(rows), device=device) - (torch.cumsum(counts, 0) - counts)[rows]
    order = torch.zeros(table.shape, dtype=torch.int32, device=device)
    order[rows, slot] = cols.to(torch.int32)
    mask_mod = _mask_mod(windows, [a.dilation for a in axes], q_sizes, k_sizes)
    module = flex_module()
    return module.BlockMask.from_kv_blocks(
        counts[None, None],
        order[None, None],
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(math.prod(q_sizes), math.prod(k_sizes)),
    )


@lru_cache(maxsize=1)
def _compiled():
    return torch.compile(flex_module().flex_attention)


def flex_attention_na(q, k, v, axes: Sequence[Axis], scale: float, compiled: bool) -> torch.Tensor:
    """Neighborhood attention of ``q`` ``(B, *Sq, heads, D)`` over ``k`` / ``v`` ``(B, *Sk,
    kv_heads, D|Dv)`` with the engine's per-axis ``axes`` (their counts ``Sq`` / ``Sk``), in
    ``q``'s dtype; ``compiled``: through ``torch.compile`` (CUDA), else eager (tests on the CPU)."""
    mask = _block_mask(tuple(axes), q.device)
    flat = [t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]).transpose(1, 2) for t in (q, k, v)]
    grouped = k.shape[-2] != q.shape[-2]
    fn = _compiled() if compiled else flex_module().flex_attention
    out = fn(*flat, block_mask=mask, scale=scale, enable_gqa=grouped)
    return out.transpose(1, 2).reshape(*q.shape[:-1], v.shape[-1])
