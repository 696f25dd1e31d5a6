"""The channel-tiled halo pack / unpack kernel, for tensors whose channel dim has stride 1.

channels_last / channels_last_3d tensors (dim 1, the channels right after the batch, has stride 1):
the flat kernel of :mod:`tplayers.kernels.halo_pack` walks the buffer in its row-major logical
order (N, C, *spatial), so consecutive threads touch tensor elements C apart. This kernel views each
face as (N, C, R), R the face's spatial elements in row-major order, and a program moves one
[BLOCK_C, BLOCK_R] tile of one (n, face): contiguous along C in the tensor, along R in the buffer.
Triton's compiler gives the two sides their own coalesced layouts and converts between them through
shared memory. Same buffer order, same modes, same grid of all the faces of an exchange as the flat
kernel; ``halo_pack`` chooses between them and launches.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl

from tplayers.kernels.halo_common import _face_of, _move

__all__ = ["TILE", "MAX_BLOCK_C", "MIN_TILED_C_PACK", "MIN_TILED_C_UNPACK"]

# The channel-tiled kernel: elements per program (BLOCK_C * BLOCK_R), channels per tile (fewer for
# narrower tensors: the next power of 2 of C), and the fewest channels it is chosen for, to pack and
# to unpack. On an H100 (Triton 3.6, kernels timed in a CUDA graph) 2048 x 64 was the best of
# 1024 / 2048 / 4096 x 16 / 32 / 64, or within 0.03 of it, on the seven cases with C >= 16 (fp32 and
# bf16, 3 and 32 rows, 2-D and 3-D); 1024 did better with C = 3 / 8 (fp32, 32 rows). With C = 3 or 8
# the tiled kernel packed no faster than the flat one (0.18 / 0.21 of a copy against 0.49 / 0.21) but
# unpacked faster (0.18 / 0.22 against 0.13 / 0.11: the flat walk's scattered writes cost more than
# its scattered reads); with C = 16 it did both faster (0.94 / 0.95 against 0.33 / 0.16).
TILE = 2048
MAX_BLOCK_C = 64
MIN_TILED_C_PACK = 16
MIN_TILED_C_UNPACK = 2


@triton.jit
def _halo_tiled_kernel(
    t_ptr,
    buf_ptr,
    C,
    S2,
    S3,
    S4,
    T0,
    TC,
    T2,
    T3,
    T4,
    b1,
    b2,
    b3,
    st0,
    st1,
    st2,
    st3,
    ln0,
    ln1,
    ln2,
    ln3,
    of0,
    of1,
    of2,
    of3,
    DIM: tl.constexpr,
    NF: tl.constexpr,
    MODE: tl.constexpr,
    UNIT_C: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The tensor viewed as (N, C, S2, S3, S4) (3-D / 4-D tensors: spatial dims padded with leading
    size-1 dims), face dim ``DIM`` (0 or 2-4, never the channels). A program moves one
    [BLOCK_C, BLOCK_R] tile of face (n, channels, spatial elements in row-major order):
    tensor offset ``n*T0 + c*TC + spatial(r)``, buffer offset ``boff + (n*C + c)*R + r``.
    ``UNIT_C`` says ``TC == 1`` at compile time, so the compiler sees the tensor side contiguous
    along C (the case the kernel is for); the tiles are ordered n, channel block, spatial block.
    MODE as in :func:`tplayers.kernels.halo_pack._halo_kernel`."""
    pid = tl.program_id(0)
    blk, start, length, boff = _face_of(pid, b1, b2, b3, st0, st1, st2, st3, ln0, ln1, ln2, ln3, of0, of1, of2, of3, NF)
    s2 = length if DIM == 2 else S2
    s3 = length if DIM == 3 else S3
    s4 = length if DIM == 4 else S4
    R = s2 * s3 * s4
    r_blocks = (R + BLOCK_R - 1) // BLOCK_R
    c_blocks = (C + BLOCK_C - 1) // BLOCK_C
    rb = blk % r_blocks
    q = blk // r_blocks
    cb = q % c_blocks
    n = (q // c_blocks).to(tl.int64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    r = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i4 = r % s4
    i3 = (r // s4) % s3
    i2 = r // s4 // s3
    if DIM == 2:
        i2 += start
    if DIM == 3:
        i3 += start
    if DIM == 4:
        i4 += start
    spatial = i2 * T2 + i3 * T3 + i4 * T4
    nt = n + start if DIM == 0 else n
    if UNIT_C:
        coff = c.to(tl.int64)
    else:
        coff = c.to(tl.int64) * TC
    t_off = nt * T0 + coff[:, None] + spatial[None, :]
    b_off = boff + (n * C + c[:, None]) * R + r[None, :]
    mask = (c[:, None] < C) & (r[None, :] < R)
    _move(t_ptr + t_off, buf_ptr + b_off, mask, MODE)


def _tiled_view(t: torch.Tensor, dim: int) -> Tuple[List[int], List[int], int]:
    """(N, C, S2, S3, S4) sizes and strides of a tensor of 3-5 dims (spatial dims left-padded with
    size-1 dims) and the face dim in that view."""
    pad = 5 - t.dim()
    sizes = list(t.shape[:2]) + [1] * pad + list(t.shape[2:])
    strides = list(t.stride()[:2]) + [0] * pad + list(t.stride()[2:])
    return sizes, strides, dim if dim == 0 else dim + pad


def _spatial(shape: Sequence[int], dim: int, length: int) -> int:
    """Spatial elements (dims 2 on) of the face ``narrow(dim, start, length)``: its R."""
    return math.prod(length if i == dim else n for i, n in enumerate(shape) if i >= 2)


def _tile_blocks(shape: Sequence[int], dim: int, faces: Sequence[Tuple[int, int]]) -> Tuple[int, int, List[int]]:
    """(BLOCK_C, BLOCK_R, tiles of each face) of a launch: a face's tiles are batch x channel blocks x
    spatial blocks (a face along dim 0 has ``length`` batch entries)."""
    # plain int arithmetic: triton.cdiv / next_power_of_2 are jit functions (~10 us a call from Python)
    block_c = min(max(1 << (shape[1] - 1).bit_length(), 2), MAX_BLOCK_C)
    block_r = TILE // block_c
    blocks = [
        (n if dim == 0 else shape[0]) * -(-shape[1] // block_c) * -(-_spatial(shape, dim, n) // block_r)
        for _, n in faces
    ]
    return block_c, block_r, blocks
