"""Triton helpers shared by the halo pack / unpack kernels (``halo_pack``, ``halo_pack_tiled``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__: list = []  # jit helpers only, imported by name by the kernel modules


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
def _move(t_ptrs, buf_ptrs, mask, MODE: tl.constexpr):
    """The elementwise step both kernels share, on pointer blocks of any (equal) shape; MODE as in
    :func:`tplayers.kernels.halo_pack._halo_kernel`."""
    if MODE == 0:
        tl.store(buf_ptrs, tl.load(t_ptrs, mask=mask), mask=mask)
    elif MODE == 1:
        tl.store(t_ptrs, tl.load(buf_ptrs, mask=mask), mask=mask)
    elif MODE == 2:
        tl.store(t_ptrs, tl.load(t_ptrs, mask=mask) + tl.load(buf_ptrs, mask=mask), mask=mask)
    else:
        a = ((tl.load(t_ptrs, mask=mask).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        b = ((tl.load(buf_ptrs, mask=mask).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        bits = (a + b).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        tl.store(t_ptrs, bits.to(tl.int16), mask=mask)
