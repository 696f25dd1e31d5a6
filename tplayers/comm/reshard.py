"""Move a sharded dim from one partition to another along the same dim (windows aligned with shards).

:class:`ReshardAlongDim` gives this rank's rows of the same global tensor under a new partition of one
dim over one process group: forward, an all-gather of the dim (``old`` rows per rank) and this rank's
``new`` rows of it; backward, the same move from ``new`` back to ``old`` (a change of owners is its own
adjoint's inverse). It gathers the whole dim on every rank for the time of the call (transient memory
of the full dim; a point-to-point exchange of the rows that change owner would move less).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tplayers.comm.collectives import all_gather_along_dim
from tplayers.sharding import offsets_from_sizes

__all__ = ["ReshardAlongDim"]


def _move(x: torch.Tensor, dim: int, old: Sequence[int], new: Sequence[int], group, tag: str) -> torch.Tensor:
    me = dist.get_rank(group)
    full = all_gather_along_dim(x.contiguous(), dim, list(old), group, tag)
    return full.narrow(dim, offsets_from_sizes(list(new))[me], int(new[me])).contiguous()


class ReshardAlongDim(torch.autograd.Function):
    """forward: this rank's ``new[rank]`` rows of dim ``dim`` (held as ``old[rank]`` rows before) / backward:
    the gradient moved back from ``new`` to ``old``. ``sum(old) == sum(new)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, old: Sequence[int], new: Sequence[int], group) -> torch.Tensor:
        dim = dim % x.dim()
        ctx.dim, ctx.old, ctx.new, ctx.group = dim, list(old), list(new), group
        return _move(x, dim, old, new, group, "reshard.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _move(grad, ctx.dim, ctx.new, ctx.old, ctx.group, "reshard.bwd"), None, None, None, None
