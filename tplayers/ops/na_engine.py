"""The engine behind :func:`tplayers.na1d` / :func:`~tplayers.na2d` / :func:`~tplayers.na3d`: one
code path for every spatial rank.

:func:`neighborhood_attention` takes queries that may be a window of a larger global image (a
domain-parallel shard) and the keys/values those queries read, per axis the window arguments
(kernel, stride, dilation, causal), an optional relative-position-bias table, and grouped
key/value heads (GQA/MQA). The geometry (:mod:`tplayers.ops.na_geometry`) merges the leading
spatial axes into one row axis, so the two 2-D kernels serve 1-D, 2-D and 3-D alike:

* the compiled C kernel (:mod:`tplayers.ops.na_cpu`) for fp32/fp64 CPU tensors where it builds
  (bf16 / fp16 ones are computed in fp32: :func:`~tplayers.ops.na_dispatch.compute_dtype`);
* ``flex_attention`` with a neighborhood block mask (:mod:`tplayers.ops.na_flex`) on CUDA, compiled;
* the GEMM-tiled torch kernel (:mod:`tplayers.ops.na_gemm`) or the torch tile kernel
  (:mod:`tplayers.ops.na_kernel`) elsewhere (any device), in blocks, nothing score-sized kept for
  backward; memory is bounded by ``B*heads*L*k`` (never ``L^2``).

:func:`~tplayers.ops.na_dispatch.choose_kernel` picks one per call (``TPLAYERS_NA_KERNEL``).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch

from tplayers.ops import na_cpu, na_dispatch, na_kernel
from tplayers.ops.na_compile import ensure_na_ops, expand_heads, fold_heads
from tplayers.ops.na_flex import flex_attention_na
from tplayers.ops.na_gemm import GEMM_KERNELS, GeoAttention
from tplayers.ops.na_geometry import Axis, geometry_args
from tplayers.ops.na_kernel import TileAttention

__all__ = ["neighborhood_attention", "default_tile", "expand_kv_heads", "fp32_kernels"]


def fp32_kernels(kernels, expand: bool = False, convert: bool = True):
    """A pair of plane kernels for :class:`~tplayers.ops.na_gemm.GeoAttention` (``(forward,
    backward)``) run on bf16 / fp16 ``q``, ``k``, ``v`` in fp32: the forward converts them, runs
    ``kernels[0]`` and returns its fp32 output (the caller rounds it); the backward converts them
    again (only the low-precision inputs are saved between the passes), runs ``kernels[1]`` on the
    fp32 output gradient and output and returns ``dq``, ``dk``, ``dv`` in the inputs' dtype and the
    table's gradient in the table's (fp32). ``expand``: grouped key/value heads are expanded to the
    query heads after the conversion, and their gradients summed back in fp32 before rounding.
    ``convert=False``: the kernels take the low-precision tensors as they are (the C kernel reads
    bf16 itself, widening exactly as it loads them) and return fp32."""
    forward, backward = kernels

    def up(q, k, v, heads):
        kv_heads = k.shape[-1] * heads // q.shape[-1]
        if convert:
            q, k, v = q.float(), k.float(), v.float()
        if expand:
            k, v = expand_heads(k, kv_heads, heads), expand_heads(v, kv_heads, heads)
        return q, k, v, kv_heads

    def run_forward(q, k, v, table, geo, scale, heads):
        return forward(*up(q, k, v, heads)[:3], table, geo, scale, heads)

    def run_backward(grad_out, q, k, v, table, out, geo, scale, heads, want_kv=True, want_bias=True):
        q32, k32, v32, kv_heads = up(q, k, v, heads)
        dq, dk, dv, dt = backward(grad_out.float(), q32, k32, v32, table, out, geo, scale, heads, want_kv, want_bias)
        low = q.dtype
        del q32, k32, v32
        dq = dq.to(low)  # each fp32 gradient freed as its rounded copy is made (peak memory)
        if dk is not None:
            dk = (fold_heads(dk, kv_heads, heads) if expand else dk).to(low)
            dv = (fold_heads(dv, kv_heads, heads) if expand else dv).to(low)
        return dq, dk, dv, dt

    return run_forward, run_backward


def default_tile(kernel: Sequence[int], head_dim: int = 0) -> Tuple[int, ...]:
    """Queries per tile per axis of the GEMM and tile kernels (:func:`~tplayers.ops.na_dispatch.default_tile`;
    ``head_dim``: measured at 16-64, the same choice)."""
    del head_dim
    return na_dispatch.default_tile(kernel)


def expand_kv_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA/MQA: ``(..., kv_heads, D)`` -> ``(..., heads, D)``, query head ``h`` reading key/value
    head ``h // (heads // kv_heads)`` (NATTEN's and ``torch`` SDPA's ``enable_gqa`` mapping). A
    copy, differentiable: the gradient of a shared head is the sum over its query heads."""
    groups = heads // k.shape[-2]
    return k if groups == 1 else k.repeat_interleave(groups, dim=-2)


@lru_cache(maxsize=256)
def _geometry(per_axis: Tuple[Tuple[int, ...], ...], fwd_chunk: int, bwd_chunk: int):
    """``(axes, geo)`` of a call: its :class:`Axis` list and :func:`geometry_args` (as a tuple), from
    the ints of each axis (global size, kernel, stride, dilation, causal, query offset and size, key
    offset and size, tile), built once per shape (a call's Python ran ~70 us on a 4x4 image)."""
    axes = [Axis(*fields) for fields in per_axis]
    return axes, tuple(geometry_args(axes, fwd_chunk, bwd_chunk))


def neighborhood_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: Sequence[int],
    dilation: Sequence[int],
    causal: Sequence[bool],
    *,
    stride: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    global_size: Sequence[int],
    q_offset: Optional[Sequence[int]] = None,
    k_offset: Optional[Sequence[int]] = None,
    rel_pos_bias: Optional[torch.Tensor] = None,
    tile: Optional[Sequence[int]] = None,
    chunk_scores: Optional[int] = None,
) -> torch.Tensor:
    """Neighborhood attention of any spatial rank ``n`` (arguments already normalised to ``n``-tuples).

    ``q`` ``(B, *Sq, heads, D)`` holds global positions ``q_offset + [0, Sq)`` of an image of
    ``global_size``; ``k`` ``(B, *Sk, kv_heads, D)`` / ``v`` ``(B, *Sk, kv_heads, Dv)`` hold
    ``k_offset + [0, Sk)`` and must contain every key those queries attend to (``kv_heads``
    divides ``heads``). ``rel_pos_bias`` ``(heads, 2*k_1 - 1, ..., 2*k_n - 1)`` is added to each
    score at ``[(key - query) / dilation + kernel - 1]`` per dim (stride 1 only). ``tile`` (queries
    per tile per axis) and ``chunk_scores`` (score elements per (batch, head) plane per chunk)
    tune the tile kernel; any positive values give the same result. Returns ``(B, *Sq, heads, Dv)``.
    """
    na_dispatch.check_dtype(q, "neighborhood_attention")
    rank = q.dim() - 3
    heads = q.shape[-2]
    stride = (1,) * rank if stride is None else tuple(stride)
    q_offset = (0,) * rank if q_offset is None else tuple(q_offset)
    k_offset = (0,) * rank if k_offset is None else tuple(k_offset)
    if q.shape[0] == 0 or any(s == 0 for s in q.shape[1 : 1 + rank]):
        # nothing to compute (an empty shard): zeros still tied to every input, so backward runs
        tie = q.sum() + k.sum() + v.sum() + (0 if rel_pos_bias is None else rel_pos_bias.sum())
        return q.new_zeros(*q.shape[:-1], v.shape[-1]) + 0 * tie
    if rank == 1:  # a row axis of length 1 (kernel 1) in front: the 2-D kernels run it
        out = neighborhood_attention(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            (1, *kernel),
            (1, *dilation),
            (False, *causal),
            stride=(1, *stride),
            scale=scale,
            global_size=(1, *global_size),
            q_offset=(0, *q_offset),
            k_offset=(0, *k_offset),
            rel_pos_bias=None if rel_pos_bias is None else rel_pos_bias.unsqueeze(1),
            tile=None if tile is None else (1, *tile),
            chunk_scores=chunk_scores,
        )
        return out.squeeze(1)
    batch, dim = q.shape[0], q.shape[-1]
    scale = dim**-0.5 if scale is None else float(scale)
    compute = na_dispatch.compute_dtype(q.dtype)  # bf16 / fp16 run in fp32 (rounded back at the end)
    if rel_pos_bias is not None and rel_pos_bias.dtype != compute:  # e.g. an fp32 table under bf16 autocast
        rel_pos_bias = rel_pos_bias.to(compute)
    tile = default_tile(kernel) if tile is None else tuple(tile)
    if chunk_scores is None:  # the defaults count every (batch, head) plane of a chunk
        fwd_chunk = max(1, na_kernel.CHUNK_SCORES // (batch * heads))
        bwd_chunk = max(1, na_kernel.BACKWARD_CHUNK_SCORES // (batch * heads))
    else:
        fwd_chunk = bwd_chunk = chunk_scores
    fields = (global_size, kernel, stride, dilation, causal, q_offset, q.shape[1:], k_offset, k.shape[1:], tile)
    axes, geo = _geometry(tuple(tuple(int(x[i]) for x in fields) for i in range(rank)), fwd_chunk, bwd_chunk)
    geo = list(geo)  # a list of its own per call (the kernels read it; the cached tuple stays as built)

    def pixels(x: torch.Tensor, dense: bool = True) -> torch.Tensor:  # (B, *S, heads, D) -> (B, prod(S), heads*D)
        x = x.reshape(batch, math.prod(x.shape[1 : 1 + rank]), -1)
        # the C kernel reads any batch / pixel strides (q, k, v as views of one qkv tensor: no copies)
        return x.contiguous() if dense or x.stride(-1) != 1 else x

    out_shape = (*q.shape[:-1], -1)
    low = q.dtype if compute != q.dtype else None
    grouped = k.shape[-2] < heads
    which = None if torch.compiler.is_compiling() else na_dispatch.choose_kernel(q, kernel, grouped, v, rel_pos_bias)
    if which in ("c", "gemm"):
        kernels = na_cpu.C_KERNELS if which == "c" else GEMM_KERNELS
        if low is not None:  # converted inside: the low-precision inputs are what is saved
            # bf16 on the C kernel: read as it is (no fp32 copies of q, k, v); fp16: converted
            kernels = fp32_kernels(kernels, expand=which == "c", convert=not (which == "c" and low == torch.bfloat16))
        elif which == "c":  # the C kernel reads as many key/value heads as query heads
            k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
        # the C kernel reads views (e.g. of one qkv tensor) in place, forward and backward: no copies
        # (benchmarks/na_module.py); fp16 is converted anyway
        dense = which != "c" or (low is not None and low != torch.bfloat16)
        args = (pixels(q, dense), pixels(k, dense), pixels(v, dense), rel_pos_bias, geo, scale, heads)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, rel_pos_bias)):
            out = GeoAttention.apply(*args, kernels)
        else:  # nothing to differentiate: the forward kernel alone (autograd's Function costs ~10 us a call)
            out = kernels[0](*args)
        return (out if low is None else out.to(low)).view(out_shape)
    if which == "flex":  # bf16 / fp16 as they are: fp32 scores, softmax and sums inside (na_flex)
        return flex_attention_na(q, k, v, list(axes), scale, compiled=q.device.type == "cuda")
    if low is not None:  # the tile kernel and the compiled op run fp32 copies
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
    if which is None:  # compiling: the tables are built inside one registered op (see na_compile)
        ensure_na_ops()  # registers tplayers::na2d_tiles on first use (nothing at import)

        table = rel_pos_bias if rel_pos_bias is not None else q.new_empty(0)
        out = torch.ops.tplayers.na2d_tiles(pixels(q), pixels(k), pixels(v), table, geo, scale, heads)
    else:
        k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
        plan, plan_bwd = na_kernel.tile_plans(geo, q.device, q.dtype)
        out = TileAttention.apply(pixels(q), pixels(k), pixels(v), rel_pos_bias, plan, plan_bwd, scale, heads)
    return (out if low is None else out.to(low)).view(out_shape)
