"""The neighbours of a halo exchange, resolved once: :class:`HaloRoute` and :func:`halo_route`.

A layer computes its exchange's route when it plans a layout and keeps it with the cached
layout, so no step repeats the ``torch.distributed`` rank lookups (a measurable part of a small
exchange's cost on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist

from tplayers.comm.collectives import posts_direct

__all__ = ["HaloRoute", "halo_route"]


def _peers(group: dist.ProcessGroup, periodic: bool) -> Tuple[Optional[int], Optional[int]]:
    """Global ranks of the low and high neighbour (``None`` at a non-periodic boundary)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    lo, hi = me - 1, me + 1
    if periodic:
        lo, hi = lo % size, hi % size
    lo = dist.get_global_rank(group, lo) if 0 <= lo < size else None
    hi = dist.get_global_rank(group, hi) if 0 <= hi < size else None
    return lo, hi


@dataclass(frozen=True)
class HaloRoute:
    """An exchange's neighbours, resolved once (a layer keeps it with its cached layout).

    ``peers``: the low / high neighbour's global rank (``None`` at a non-periodic boundary);
    ``local``: the same as ranks in ``group``; ``size``: the group's size; ``direct``: whether
    messages are posted on the group object itself (gloo, see
    :func:`~tplayers.comm.collectives.exchange_p2p`).
    """

    group: dist.ProcessGroup
    size: int
    peers: Tuple[Optional[int], Optional[int]]
    local: Tuple[Optional[int], Optional[int]]
    direct: bool


def halo_route(
    group: dist.ProcessGroup, periodic: bool = False, peers: Optional[Tuple[Optional[int], Optional[int]]] = None
) -> HaloRoute:
    """The :class:`HaloRoute` of exchanging along ``group`` (``peers``: global ranks already known).

    Example (2 ranks, non-periodic: rank 0 has only a high neighbour)::

        import tplayers
        from tplayers.comm.halo_route import halo_route
        mesh = tplayers.init_mesh()
        route = halo_route(mesh.get_group(0))
        # rank 0: route.peers == (None, 1); rank 1: route.peers == (0, None)
    """
    lo, hi = _peers(group, periodic) if peers is None else peers
    local = tuple(None if p is None else dist.get_group_rank(group, p) for p in (lo, hi))
    return HaloRoute(group, dist.get_world_size(group), (lo, hi), local, posts_direct(group))
