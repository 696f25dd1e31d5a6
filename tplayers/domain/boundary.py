"""Where replicated data meets sharded data inside a domain region: the two boundary Functions.

The convention (DESIGN §2.4): inside a domain region a tensor is either **sharded** (each rank
holds its slice of the global tensor; its gradient is the gradient of those elements) or
**replicated** (every rank holds the same value; its gradient is the *full* gradient, the same on
every rank). Two crossings need communication, and they are adjoint to each other:

* sharded -> replicated (:class:`ShardedToReplicated`): each rank holds a partial result over
  its own elements (a local sum for a global pool, a loss or a statistic) and the replicated
  value is the sum over the domain. forward: all-reduce / backward: identity (every element of
  every shard receives the full gradient of the replicated value).
* replicated -> sharded (:class:`ReplicatedToSharded`): a replicated tensor (a time embedding,
  a FiLM scale, a squeeze-excitation gate, a replicated parameter) is used by computation on
  the shards. Each rank's gradient only covers its own elements. forward: identity / backward:
  all-reduce (the full gradient, on every rank).

Rule for hand-written code: call :func:`sharded_to_replicated` on a partial sum over shards
(or use :func:`tplayers.domain_sum` / :func:`tplayers.domain_mean`), and
:func:`replicated_to_sharded` on a replicated tensor right before it is combined with sharded
features (``h + replicated_to_sharded(emb, mesh)``) unless its gradient is summed elsewhere
(a replicated parameter of a module wrapped in :class:`tplayers.DomainReplicated` is summed by
the wrapper). Replicated computation on replicated data (a head after a global pool, an MLP on
a replicated time step) needs nothing. A 2-D mesh reduces over both of its dims.

Example (``torchrun --nproc-per-node 2``)::

    import torch, tplayers
    from tplayers.domain.boundary import replicated_to_sharded, sharded_to_replicated
    mesh = tplayers.init_mesh()
    h = torch.randn(2, 4, 5, 8, requires_grad=True)           # this rank's rows of (2, 4, 10, 8)
    pooled = sharded_to_replicated(h.sum((2, 3)), mesh) / 80  # global average pool, replicated
    gate = torch.sigmoid(pooled)                              # replicated computation
    y = h * replicated_to_sharded(gate, mesh)[..., None, None]
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.collectives import all_reduce_sum
from tplayers.domain.active import active_guard
from tplayers.mesh import resolve_mesh

__all__ = [
    "ShardedToReplicated",
    "ReplicatedToSharded",
    "sharded_to_replicated",
    "replicated_to_sharded",
    "domain_groups",
]


def domain_groups(mesh: Optional[DeviceMesh]) -> List[dist.ProcessGroup]:
    """The process groups of a 1-D or 2-D domain mesh (``None`` -> the default mesh)."""
    mesh = resolve_mesh(mesh, (1, 2))
    return [mesh.get_group(i) for i in range(mesh.ndim)]


def _all_reduce_groups(x: torch.Tensor, groups, tag: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # fresh buffer: never reduce a caller's tensor
    for group in groups:
        out = all_reduce_sum(out, group, tag)
    return out


class ShardedToReplicated(torch.autograd.Function):
    """forward: all-reduce (sum over the domain) of each rank's partial result, giving the
    replicated value / backward: identity (each rank's partial gets the full gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups) -> torch.Tensor:
        return _all_reduce_groups(x, groups, "sharded_to_replicated.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ReplicatedToSharded(torch.autograd.Function):
    """forward: identity (a replicated tensor used by sharded computation) / backward: all-reduce
    (sum over the domain) of the per-rank partial gradients, giving the full gradient everywhere."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_groups(grad, ctx.groups, "replicated_to_sharded.bwd"), None


def _active(groups) -> list:
    return [g for g in groups if dist.get_world_size(g) > 1]


def sharded_to_replicated(x_partial: torch.Tensor, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """Sum of every rank's ``x_partial`` (same shape on every rank), replicated; identity backward.

    See :class:`ShardedToReplicated`. Example: ``sharded_to_replicated(h.sum((2, 3)), mesh)``
    is the global spatial sum of a sharded ``h``.
    """
    guard = _guard()
    if guard is not None:  # inside a guarded region every replicated value is already global
        if guard.layout(x_partial) is not None:
            raise guard.error(
                "sharded_to_replicated of a tensor that is still sharded",
                guard.layout(x_partial),
                "Reduce it first (x.sum(dim) over the sharded dims is global inside a region).",
            )
        return x_partial
    groups = _active(domain_groups(mesh))
    return ShardedToReplicated.apply(x_partial, groups) if groups else x_partial


def replicated_to_sharded(x: torch.Tensor, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over the domain in backward.

    See :class:`ReplicatedToSharded`. Example: ``h + replicated_to_sharded(emb, mesh)[..., None, None]``.
    """
    if _guard() is not None:  # the region guard sums the gradient where the data meets the shards
        return x
    groups = _active(domain_groups(mesh))
    return ReplicatedToSharded.apply(x, groups) if groups else x


def _guard():
    return active_guard()
