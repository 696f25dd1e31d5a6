"""Triton kernels that pack the faces of a halo exchange into one buffer, and unpack it.

A face is a slab ``t.narrow(dim, start, length)``; the buffer holds the faces one
after the other, each in row-major *logical* order (N, C, *spatial) whatever the
tensor's memory format, so both ends of an exchange agree on it.

One launch handles every face (up to :data:`MAX_FACES`) of one exchange: the
grid is the concatenation of each face's blocks, and each program finds its
face from the block prefix (``_face_of``). Tensors of up to 5 dims (so 1-D, 2-D
and 3-D domains) with any strides are read and written in place, by one of two
kernels (``_kernel_for`` picks):

- ``_halo_kernel`` (flat): a program takes :data:`BLOCK` consecutive buffer
  elements and computes each one's strided tensor offset. Both sides are
  coalesced when the face's innermost logical dim is the tensor's innermost in
  memory (contiguous tensors, bandwidth-bound faces: 0.82-0.85 of a device
  copy on an H200 per call, 0.95-0.98 on an H100 in a CUDA graph).
- ``_halo_tiled_kernel`` (channel-tiled, in :mod:`tplayers.kernels.halo_pack_tiled`;
  the helpers both kernels share are in ``halo_common``), for tensors whose channel dim (dim 1,
  right after the batch) has stride 1: channels_last, channels_last_3d. There
  the flat walk reads (pack) or writes (unpack) tensor elements C apart from
  one thread to the next, uncoalesced (0.05-0.35 of a copy). The tiled kernel
  views each face as (N, C, R), R the face's spatial elements in row-major
  order, and a program moves one [BLOCK_C, BLOCK_R] tile of one (n, face):
  contiguous along C in the tensor, along R in the buffer. Triton's compiler
  gives each side its own coalesced layout and converts between them through
  shared memory, so both the read and the write are coalesced. Packs take it
  from :data:`MIN_TILED_C_PACK` channels on, unpacks from
  :data:`MIN_TILED_C_UNPACK` (measured on an H100, see the constants'
  comment; ``benchmarks/halo_pack_gpu.py`` prints the A/B).

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

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from tplayers.kernels.halo_common import _face_of, _move
from tplayers.kernels.halo_pack_tiled import (
    MIN_TILED_C_PACK,
    MIN_TILED_C_UNPACK,
    _halo_tiled_kernel,
    _spatial,
    _tile_blocks,
    _tiled_view,
)

__all__ = ["pack", "unpack", "MAX_FACES", "BLOCK"]

MAX_FACES = 4
BLOCK = 1024  # elements per program of the flat kernel
NDIM = 5  # tensors of 1-5 dims (1-D to 3-D domains: (N, C, L), (N, C, H, W), (N, C, D, H, W))

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    _move(t_ptr + off, buf_ptr + boff + e, mask, MODE)


def _as5d(t: torch.Tensor, dim: int) -> Tuple[List[int], List[int], int]:
    assert t.dim() <= NDIM, f"halo_pack handles tensors of up to {NDIM} dims"
    pad = NDIM - t.dim()
    return [1] * pad + list(t.shape), [0] * pad + list(t.stride()), dim + pad


def _kernel_for(
    t: torch.Tensor, dim: int, faces: Sequence[Tuple[int, int]], tiled: Optional[bool] = None, mode: int = 0
) -> str:
    """``"tiled"`` or ``"flat"``: the kernel :func:`_launch` runs for these faces in ``mode`` (0: pack,
    1-3: unpack). Automatic (``tiled=None``): the tiled kernel where the channel dim (dim 1) has stride
    1 and at least :data:`MIN_TILED_C_PACK` (pack) or :data:`MIN_TILED_C_UNPACK` (unpack) channels,
    the face is not the channel dim and a face has more than one spatial element (there the flat
    kernel's accesses are C apart); the flat kernel everywhere else (contiguous tensors are already
    coalesced; a pack with few channels reads close enough together). ``tiled=True`` / ``False``
    forces one (benchmarks and tests); the tiled kernel takes tensors of 3-5 dims and faces along
    dim 0 or a spatial dim, any strides."""
    fits = 3 <= t.dim() <= NDIM and dim != 1
    if tiled is None:
        tiled = (
            fits
            and t.stride(1) == 1
            and t.size(1) >= (MIN_TILED_C_PACK if mode == 0 else MIN_TILED_C_UNPACK)
            and max((_spatial(t.shape, dim, n) for _, n in faces), default=0) > 1
        )
    elif tiled and not fits:
        raise ValueError(
            f"the tiled halo kernel takes 3-5 dim tensors and faces off dim 1; got {t.dim()} dims, dim {dim}"
        )
    return "tiled" if tiled else "flat"


def _face_table(blocks_per_face: List[int], faces, boffs: List[int]) -> List[int]:
    """The face arguments of a launch: block prefix b1-b3, starts, lengths, buffer offsets (padded
    to :data:`MAX_FACES`)."""
    fill = MAX_FACES - len(faces)
    begins = [sum(blocks_per_face[:i]) for i in range(len(faces))] + [sum(blocks_per_face)] * fill
    starts = [s for s, _ in faces] + [0] * fill
    lens = [n for _, n in faces] + [0] * fill
    return begins[1:] + starts + lens + boffs + [0] * fill


def _launch(
    t: torch.Tensor,
    buf: torch.Tensor,
    dim: int,
    faces: Sequence[Tuple[int, int]],
    mode: int,
    tiled: Optional[bool] = None,
) -> None:
    faces = [f for f in faces if f[1] > 0]
    if not faces:
        return
    assert len(faces) <= MAX_FACES
    row = t.numel() // t.size(dim) if t.size(dim) else 0
    if row == 0:
        return
    boffs = [row * sum(n for _, n in faces[:i]) for i in range(len(faces))]
    if _kernel_for(t, dim, faces, tiled, mode) == "flat":
        sizes, strides, d = _as5d(t, dim)
        blocks = [-(-row * n // BLOCK) for _, n in faces]  # plain ints: triton.cdiv is a jit function (~10 us a call)
        _halo_kernel[(sum(blocks),)](
            t,
            buf,
            *sizes,
            *strides,
            row,
            *_face_table(blocks, faces, boffs),
            DIM=d,
            NF=len(faces),
            MODE=mode,
            BLOCK=BLOCK,
        )
        return
    sizes, strides, d = _tiled_view(t, dim)
    block_c, block_r, blocks = _tile_blocks(sizes, d, faces)
    _halo_tiled_kernel[(sum(blocks),)](
        t,
        buf,
        *sizes[1:],
        *strides,
        *_face_table(blocks, faces, boffs),
        DIM=d,
        NF=len(faces),
        MODE=mode,
        UNIT_C=strides[1] == 1,
        BLOCK_C=block_c,
        BLOCK_R=block_r,
    )


def pack(x: torch.Tensor, dim: int, faces: Sequence[Tuple[int, int]], *, tiled: Optional[bool] = None) -> torch.Tensor:
    """Faces of ``x`` -> one contiguous buffer (bitwise copy), one launch. ``tiled``: see
    :func:`_kernel_for` (None, the default, chooses)."""
    row = x.numel() // x.size(dim) if x.size(dim) else 0
    buf = torch.empty(row * sum(n for _, n in faces), dtype=x.dtype, device=x.device)
    bits = _BITS[x.element_size()]
    _launch(x.view(bits), buf.view(bits), dim, faces, 0, tiled)
    return buf


def unpack(
    buf: torch.Tensor,
    out: torch.Tensor,
    dim: int,
    faces: Sequence[Tuple[int, int]],
    accumulate: bool = False,
    *,
    tiled: Optional[bool] = None,
) -> torch.Tensor:
    """Buffer segments -> faces of ``out`` (written, or added with ``accumulate``), one launch.
    ``tiled``: see :func:`_kernel_for` (None, the default, chooses)."""
    if not accumulate:
        bits = _BITS[out.element_size()]
        _launch(out.view(bits), buf.view(bits), dim, faces, 1, tiled)
    elif out.dtype == torch.bfloat16:
        _launch(out.view(torch.int16), buf.view(torch.int16), dim, faces, 3, tiled)
    else:
        _launch(out, buf, dim, faces, 2, tiled)
    return out
