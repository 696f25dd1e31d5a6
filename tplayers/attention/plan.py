"""The bookkeeping of attention over domain-sharded tokens: who holds which keys, in what order.

:class:`Topology` names the ranks of a (1-D or N-D) mesh in flattened order and the groups that
reach them; :func:`gather_rows` all-gathers one small integer row per rank (the metadata every
call agrees on before any K/V moves); :class:`Cols` says which columns of the global key sequence
one rank's block is (a contiguous range, or explicit positions); :class:`AttentionPlan` holds
everything the ring and all-gather Functions need besides q, k and v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.collectives import all_gather_along_dim, posts_direct
from tplayers.sharding import offsets_from_sizes

__all__ = ["Topology", "topology", "gather_rows", "Cols", "AttentionPlan"]


@dataclass(frozen=True)
class Topology:
    """The ranks of ``mesh`` in flattened (row-major) order and how to reach them.

    ``groups``: one process group per mesh dim (all-gathers nest over them, last dim first, which
    yields the flattened order); ``p2p_group``: the group ring messages go through (the mesh's own
    group for a 1-D mesh, the default group for an N-D one); ``peers``: the ring's previous and
    next rank as ranks *in* ``p2p_group``; ``index``: this rank's place in the flattened order.
    """

    size: int
    index: int
    groups: Tuple[dist.ProcessGroup, ...]
    shape: Tuple[int, ...]
    p2p_group: dist.ProcessGroup
    peers: Tuple[int, int]
    direct: bool


def topology(mesh: DeviceMesh) -> Topology:
    """The :class:`Topology` of ``mesh`` (no communication)."""
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
    if mesh.ndim == 1:
        group = groups[0]
        prev, nxt = (dist.get_group_rank(group, ranks[(me - 1) % n]), dist.get_group_rank(group, ranks[(me + 1) % n]))
    else:
        group = dist.group.WORLD
        prev, nxt = ranks[(me - 1) % n], ranks[(me + 1) % n]
    return Topology(n, me, groups, tuple(int(s) for s in mesh.shape), group, (prev, nxt), posts_direct(group))


def gather_rows(row: Sequence[int], topo: Topology, tag: str) -> List[List[int]]:
    """Every rank's integer ``row`` (all of one length), in the mesh's flattened order."""
    table = torch.tensor([int(v) for v in row], dtype=torch.int64)
    if dist.get_backend(topo.groups[0]) == "nccl":
        table = table.cuda()
    table = table.unsqueeze(0)  # (1, R)
    for group in reversed(topo.groups):
        size = dist.get_world_size(group)
        # (cur, R) -> (size * cur, R): the last mesh dim varies fastest, as in the flattened order
        table = all_gather_along_dim(table.unsqueeze(0), 0, [1] * size, group, tag).flatten(0, 1)
    return table.cpu().tolist()


def gather_padded(x: torch.Tensor, sizes: Sequence[int], topo: Topology, tag: str) -> torch.Tensor:
    """All ranks' ``x`` (rows along dim -2, rank ``r`` holds ``sizes[r]``), padded to the largest,
    stacked in flattened order: ``(size, *x.shape[:-2], max(sizes), x.shape[-1])``."""
    largest = max(sizes)
    if x.size(-2) < largest:
        pad = x.new_zeros(x.shape[:-2] + (largest - x.size(-2), x.shape[-1]))
        x = torch.cat([x, pad], -2)
    out = x.contiguous().unsqueeze(0)
    for group in reversed(topo.groups):
        size = dist.get_world_size(group)
        out = all_gather_along_dim(out.unsqueeze(0), 0, [1] * size, group, tag).flatten(0, 1)
    return out


@dataclass(frozen=True)
class Cols:
    """One rank's block of keys as columns of the global key sequence: ``start:start+length``
    when ``positions`` is None (a contiguous block), else the global indices ``positions``."""

    start: int
    length: int
    positions: Optional[torch.Tensor] = None

    def take(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The block's columns of ``t`` (last dim = global keys; a last dim of 1 broadcasts)."""
        if t is None or t.size(-1) == 1:
            return t
        if self.positions is None:
            return t.narrow(-1, self.start, self.length)
        return t.index_select(-1, self.positions.to(t.device))

    def indices(self, device) -> torch.Tensor:
        if self.positions is None:
            return torch.arange(self.start, self.start + self.length, device=device)
        return self.positions.to(device)


def contiguous_cols(sizes: Sequence[int]) -> List[Cols]:
    """Each rank's block as a contiguous range of the global sequence, in rank order."""
    return [Cols(o, s) for o, s in zip(offsets_from_sizes(sizes), sizes)]


@dataclass
class AttentionPlan:
    """Everything a call needs besides q, k, v (built by :func:`scaled_dot_product_attention`).

    ``k_sizes``: every rank's key count (flattened mesh order); ``cols``: every rank's key block as
    global columns; ``batch``: the broadcast batch shape of the attention (q, expanded k/v, mask);
    ``bias_mask``: the caller's mask as an additive float tensor (..., Lq_local | 1, Lk | 1) or
    None; ``q_pos``: this rank's query positions when causal (else None); ``keep``: this rank's
    rows of the serial dropout mask (bool, ..., Lq_local, Lk) or None, with ``drop_scale``.
    """

    topo: Optional[Topology]
    k_sizes: List[int]
    cols: List[Cols]
    batch: Tuple[int, ...]
    scale: float
    groups: int
    bias_mask: Optional[torch.Tensor]
    q_pos: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]
    drop_scale: float
    k_shape_of: object = None  # callable: rank -> shape of that rank's key block
    v_shape_of: object = None

    def block_bias(self, b: int, dtype, device) -> Optional[torch.Tensor]:
        """Additive bias of block ``b``'s scores (..., Lq_local | 1, L_b): mask columns + causal."""
        bias = self.cols[b].take(self.bias_mask)
        if self.q_pos is not None:
            kpos = self.cols[b].indices(device)
            allowed = kpos.unsqueeze(0) <= self.q_pos.to(device).unsqueeze(1)  # (Lq, L_b)
            causal = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            bias = causal if bias is None else bias + causal
        return bias

    def block_keep(self, b: int) -> Optional[torch.Tensor]:
        return self.cols[b].take(self.keep)
