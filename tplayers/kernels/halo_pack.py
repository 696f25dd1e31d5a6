"""Triton kernels that pack the faces of a halo exchange into one buffer, and unpack it.

One launch handles every face (up to :data:`MAX_FACES`) of one exchange: the
grid is the concatenation of each face's blocks, and each program finds its
face from the block prefix. Tensors of up to 5 dims (so 1-D, 2-D and 3-D
domains) with any strides (non-contiguous, channels_last, channels_last_3d) are
read and written in place.

Pack and plain unpack move raw bits: the tensor is viewed as an integer dtype
of the same element size, so results are bitwise equal to the torch reference
for every dtype (this also sidesteps the Triton interpreter's bfloat16 loads).
Unpack-add (the adjoint of pack, used in backward) adds in the tensor's dtype;
bfloat16 is widened to float32 by bit shifts, added, and rounded back to
nearest-even, which is what PyTorch's own bfloat16 ``add_`` does (NaN payloads
may differ). Overlapping faces must not be accumulated in one launch (the
front door, ``tplayers.ops.halo``, splits them).

Only ``tplayers.ops`` imports this module; the torch reference there is its oracle.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["pack", "unpack", "MAX_FACES", "BLOCK"]

MAX_FACES = 4
BLOCK = 1024
NDIM = 5  # tensors of 1-5 dims (1-D to 3-D domains: (N, C, L), (N, C, H, W), (N, C, D, H, W))

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _face_of(pid, b1, b2, b3, st0, st1, st2, st3, ln0, ln1, ln2, ln3, of0, of1, of2, of3, NF: tl.constexpr):
    """(block index inside the face, face start, face length, buffer offset) of program ``pid``.

    Branch-free selects (``tl.where``) so compiled and interpreted kernels agree on types.
    """
    base, start, length, boff = pid * 0, st0 + pid * 0, ln0 + pid * 0, of0 + pid * 0
    if NF > 1:
        sel = pid >= b1
        base, start, length, boff = (
            tl.where(sel, b1, base),
            tl.where(sel, st1, start),
            tl.where(sel, ln1, length),
            tl.where(sel, of1, boff),
        )
    if NF > 2:
        sel = pid >= b2
        base, start, length, boff = (
            tl.where(sel, b2, base),
            tl.where(sel, st2, start),
            tl.where(sel, ln2, length),
            tl.where(sel, of2, boff),
        )
    if NF > 3:
        sel = pid >= b3
        base, start, length, boff = (
            tl.where(sel, b3, base),
            tl.where(sel, st3, start),
            tl.where(sel, ln3, length),
            tl.where(sel, of3, boff),
        )
    return pid - base, start, length, boff


@triton.jit
def _offsets(e, start, length, S1, S2, S3, S4, T0, T1, T2, T3, T4, DIM: tl.constexpr):
    """Strided tensor offset of element ``e`` (row-major) of the face ``narrow(DIM, start, length)``
    of a tensor viewed as 5-D (leading dims of size 1 for fewer dims)."""
    s1 = length if DIM == 1 else S1
    s2 = length if DIM == 2 else S2
    s3 = length if DIM == 3 else S3
    s4 = length if DIM == 4 else S4
    i4 = e % s4
    r = e // s4
    i3 = r % s3
    r = r // s3
    i2 = r % s2
    r = r // s2
    i1 = r % s1
    i0 = r // s1
    if DIM == 0:
        i0 += start
    if DIM == 1:
        i1 += start
    if DIM == 2:
        i2 += start
    if DIM == 3:
        i3 += start
    if DIM == 4:
        i4 += start
    return i0 * T0 + i1 * T1 + i2 * T2 + i3 * T3 + i4 * T4


@triton.jit
def _halo_kernel(
    t_ptr,
    buf_ptr,
    S0,
    S1,
    S2,
    S3,
    S4,
    T0,
    T1,
    T2,
    T3,
    T4,
    ROW,
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
    BLOCK: tl.constexpr,
):
    """MODE 0: pack (tensor -> buffer); 1: unpack (buffer -> tensor); 2: unpack-add native;
    3: unpack-add bfloat16 stored as int16 bits."""
    pid = tl.program_id(0)
    blk, start, length, boff = _face_of(pid, b1, b2, b3, st0, st1, st2, st3, ln0, ln1, ln2, ln3, of0, of1, of2, of3, NF)
    e = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < ROW * length
    off = _offsets(e, start, length, S1, S2, S3, S4, T0, T1, T2, T3, T4, DIM)
    if MODE == 0:
        tl.store(buf_ptr + boff + e, tl.load(t_ptr + off, mask=mask), mask=mask)
    elif MODE == 1:
        tl.store(t_ptr + off, tl.load(buf_ptr + boff + e, mask=mask), mask=mask)
    elif MODE == 2:
        acc = tl.load(t_ptr + off, mask=mask) + tl.load(buf_ptr + boff + e, mask=mask)
        tl.store(t_ptr + off, acc, mask=mask)
    else:
        a = ((tl.load(t_ptr + off, mask=mask).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        b = ((tl.load(buf_ptr + boff + e, mask=mask).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        bits = (a + b).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        tl.store(t_ptr + off, bits.to(tl.int16), mask=mask)


def _as5d(t: torch.Tensor, dim: int) -> Tuple[List[int], List[int], int]:
    assert t.dim() <= NDIM, f"halo_pack handles tensors of up to {NDIM} dims"
    pad = NDIM - t.dim()
    return [1] * pad + list(t.shape), [0] * pad + list(t.stride()), dim + pad


def _launch(t: torch.Tensor, buf: torch.Tensor, dim: int, faces: Sequence[Tuple[int, int]], mode: int) -> None:
    faces = [f for f in faces if f[1] > 0]
    if not faces:
        return
    assert len(faces) <= MAX_FACES
    sizes, strides, d = _as5d(t, dim)
    row = t.numel() // t.size(dim) if t.size(dim) else 0
    if row == 0:
        return
    starts, lens, boffs, begins = [], [], [], []
    blocks = boff = 0
    for start, length in faces:
        starts.append(start), lens.append(length), boffs.append(boff), begins.append(blocks)
        boff += row * length
        blocks += triton.cdiv(row * length, BLOCK)
    fill = MAX_FACES - len(faces)
    starts, lens, boffs = starts + [0] * fill, lens + [0] * fill, boffs + [0] * fill
    begins = begins + [blocks] * fill
    _halo_kernel[(blocks,)](
        t, buf, *sizes, *strides, row, *begins[1:], *starts, *lens, *boffs, DIM=d, NF=len(faces), MODE=mode, BLOCK=BLOCK
    )


def pack(x: torch.Tensor, dim: int, faces: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Faces of ``x`` -> one contiguous buffer (bitwise copy), one launch."""
    row = x.numel() // x.size(dim) if x.size(dim) else 0
    buf = torch.empty(row * sum(n for _, n in faces), dtype=x.dtype, device=x.device)
    bits = _BITS[x.element_size()]
    _launch(x.view(bits), buf.view(bits), dim, faces, 0)
    return buf


def unpack(
    buf: torch.Tensor, out: torch.Tensor, dim: int, faces: Sequence[Tuple[int, int]], accumulate: bool = False
) -> torch.Tensor:
    """Buffer segments -> faces of ``out`` (written, or added with ``accumulate``), one launch."""
    if not accumulate:
        bits = _BITS[out.element_size()]
        _launch(out.view(bits), buf.view(bits), dim, faces, 1)
    elif out.dtype == torch.bfloat16:
        _launch(out.view(torch.int16), buf.view(torch.int16), dim, faces, 3)
    else:
        _launch(out, buf, dim, faces, 2)
    return out
