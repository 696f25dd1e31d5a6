"""Where replicated data meets sharded data inside a domain region: the two boundary Functions.

The region convention (docs/design.md (the region convention)): inside a domain region a tensor
is either **sharded** (each rank holds its slice of the global tensor; its gradient is the
gradient of those elements) or **replicated** (every rank holds the same value; its gradient is
the *full* gradient, the same on every rank). Two crossings need communication, and they are adjoint to each other:

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
    y.sum().backward()                                        # h.grad: this rank's rows of the serial one
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
    replicated value / backward: identity (each rank's partial gets the full gradient).

    ``ShardedToReplicated.apply(x, groups)``: ``x`` this rank's partial (the same shape on every
    rank), ``groups`` the process groups to sum over (one per mesh dim). Returns a new tensor,
    the sum. :func:`sharded_to_replicated` is the mesh-level call.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        part = torch.ones(3, requires_grad=True)
        total = tplayers.ShardedToReplicated.apply(part, [mesh.get_group(0)])
        torch.testing.assert_close(total, torch.full((3,), float(mesh.size())))
        total.sum().backward()
        torch.testing.assert_close(part.grad, torch.ones(3))    # identity backward
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups) -> torch.Tensor:
        ctx.groups = groups
        return _all_reduce_groups(x, groups, "sharded_to_replicated.fwd")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the identity as its adjoint's node (tplayers.comm.twice)
            return ReplicatedToSharded.apply(grad, ctx.groups), None
        return grad, None


class ReplicatedToSharded(torch.autograd.Function):
    """forward: identity (a replicated tensor used by sharded computation) / backward: all-reduce
    (sum over the domain) of the per-rank partial gradients, giving the full gradient everywhere.

    ``ReplicatedToSharded.apply(x, groups)``: ``x`` replicated, ``groups`` the process groups to
    sum the gradient over. Returns a view of ``x``. :func:`replicated_to_sharded` is the
    mesh-level call.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        w = torch.ones(3, requires_grad=True)                     # replicated
        tplayers.ReplicatedToSharded.apply(w, [mesh.get_group(0)]).sum().backward()
        torch.testing.assert_close(w.grad, torch.full((3,), float(mesh.size())))
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the sum as its adjoint's node, differentiable again
            return ShardedToReplicated.apply(grad, ctx.groups), None
        return _all_reduce_groups(grad, ctx.groups, "replicated_to_sharded.bwd"), None


def _active(groups) -> list:
    return [g for g in groups if dist.get_world_size(g) > 1]


def sharded_to_replicated(x_partial: torch.Tensor, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """Sum of every rank's ``x_partial`` (same shape on every rank), replicated; identity backward.

    See :class:`ShardedToReplicated`. Inside a guarded domain region it is the identity (values
    there are already global).

    Args:
        x_partial: this rank's partial result (e.g. ``h.sum((2, 3))`` of its slice ``h``).
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`); sums over all its dims.

    Returns:
        The sum over the domain, the same on every rank.

    Raises:
        ValueError: inside a region, ``x_partial`` is still sharded (reduce it first).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        full = torch.randn(2, 4, 10, 8, dtype=torch.float64)
        h = tplayers.shard(full, 2, mesh)
        total = tplayers.sharded_to_replicated(h.sum((2, 3)), mesh)   # the global spatial sum
        torch.testing.assert_close(total, full.sum((2, 3)))
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

    See :class:`ReplicatedToSharded`. Use it on a replicated tensor right before it meets sharded
    data; inside a guarded domain region it is the identity (the guard sums where data meets).

    Args:
        x: a replicated tensor (the same on every rank).
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).

    Returns:
        ``x`` (a view), whose gradient is the sum of every rank's.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        full = torch.randn(2, 4, 10, 8, dtype=torch.float64)
        emb = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)     # replicated
        h = tplayers.shard(full, 2, mesh) + tplayers.replicated_to_sharded(emb, mesh)[..., None, None]
        tplayers.domain_sum(h, mesh).backward()
        torch.testing.assert_close(emb.grad, torch.full((2, 4), 80.0, dtype=torch.float64))  # 10 x 8 pixels
    """
    if _guard() is not None:  # the region guard sums the gradient where the data meets the shards
        return x
    groups = _active(domain_groups(mesh))
    return ReplicatedToSharded.apply(x, groups) if groups else x


def _guard():
    return active_guard()
