"""Operands of one op sharded along different tensor dims: moved to one layout before they meet.

A spectrum leaves a distributed FFT sharded where the decomposition put it (along the modes of the
last transformed dim, one all-to-all fewer than returning it: :mod:`tplayers.region.rules_fft`), so
code that brings it back to the grid (``z + ifftshift(spec).real``) pairs tensors sharded over the
same mesh dim along different dims. A pointwise op does not refuse that: every operand is moved to
the layout of a reference operand (the one sharded like the region's input when there is one, else
the first), one all-to-all per mesh dim (``tplayers.comm.all_to_all.AllToAllDim``, its reverse in
backward), with the reference's partition. An operand with length 1 where the reference is sharded
(a broadcast) is all-gathered along its sharded dim instead; its gradient is summed over that mesh
dim where it meets the reference's rows. Only plain layouts (one tensor dim per mesh dim) are moved; a
merged dim whose sharded factor leads (one contiguous block per rank) counts as plain.
The decision reads which dims are sharded and the lengths of whole dims, the same on every rank.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from tplayers.comm.all_to_all import AllToAllDim
from tplayers.comm.collectives import GatherAlongDim
from tplayers.domain.layout import contiguous_blocks

__all__ = ["realign"]


def _plain(t: torch.Tensor, lay) -> Optional[Dict[int, int]]:
    """``{mesh dim: right-aligned (negative) tensor dim}`` of a plain layout, else ``None``."""
    out = {}
    for k, e in enumerate(lay):
        if e is None:
            continue
        if len(e) != 1 or e[0][1] is None:
            return None
        out[e[0][1]] = k - t.dim()
    return out


def _blocks(g, t: torch.Tensor) -> torch.Tensor:
    """``t``, or a view of it tagged with its layout's contiguous blocks written as plain sharded dims (a
    merged dim whose sharded factor leads: :func:`~tplayers.domain.layout.contiguous_blocks`)."""
    lay = g.layout(t)
    plain = contiguous_blocks(lay)
    return t if plain == lay else g.mark(t.view(t.shape), plain)


def realign(g, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``tensors`` with every sharded one moved to the reference operand's sharded dims (see the module docstring)."""
    sharded = [
        (i, t, _plain(t, contiguous_blocks(g.layout(t)))) for i, t in enumerate(tensors) if g.layout(t) is not None
    ]
    if len(sharded) < 2 or any(m is None for _, _, m in sharded):
        return list(tensors)
    region = {i: d for i, d in enumerate(g.shard_dims)}
    ref = next(
        (s for s in sharded if all(s[1].dim() + k == region.get(a) for a, k in s[2].items())),
        max(sharded, key=lambda s: len(s[2])),
    )
    _, rt, rmap = ref
    if all(m.get(a) == k for _, _, m in sharded for a, k in rmap.items() if a in m) and all(
        set(m) <= set(rmap) for _, _, m in sharded
    ):
        return list(tensors)
    out = list(tensors)
    rt = _blocks(g, rt)
    for i, t, m in sharded:
        if t is ref[1]:
            continue
        t = _blocks(g, t)
        lay = list(g.layout(t))
        for axis, want in rmap.items():
            have = m.get(axis)
            if have is None or have == want:
                continue
            if -want > t.dim() or any(a != axis and k == want for a, k in m.items()):
                continue  # no such dim, or another mesh dim's: left to the op's own check (refused)
            src, dst = t.dim() + have, t.dim() + want
            root = g.root(t, src)
            if int(t.shape[dst]) == 1:  # a broadcast along the reference's sharded dim: whole along ``axis``
                t = GatherAlongDim.apply(t, src, root.sizes(), g.groups[axis])
                lay[src] = None
            else:
                target = g.root(rt, rt.dim() + want).sizes()
                if int(t.shape[dst]) != sum(target):
                    continue  # not the reference's length there: the op's own check refuses it
                t = AllToAllDim.apply(t, src, dst, root.sizes(), target, g.groups[axis])
                lay[src], lay[dst] = None, ((int(t.shape[dst]), axis),)
            m = {a: (want if a == axis else k) for a, k in m.items() if not (a == axis and lay[dst] is None)}
            g.mark(t, tuple(lay))
        out[i] = t
    return out
