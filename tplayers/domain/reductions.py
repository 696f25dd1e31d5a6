"""Global reductions over a domain-sharded tensor, for losses and metrics.

``domain_sum`` / ``domain_mean`` return the value over the *whole* domain (every rank's
elements) as the same scalar on every rank; the gradient each rank receives for its own
elements is exactly the serial one, on any partition (uneven, empty shards), 1-D or 2-D mesh.
They cross the sharded -> replicated boundary with one fused all-reduce per mesh dim
(:class:`tplayers.domain.boundary.ShardedToReplicated`: all-reduce forward, identity backward).

Per-pixel losses::

    loss = tplayers.domain_mean(F.mse_loss(y, t, reduction="none"), mesh)
    ce = F.cross_entropy(logits, labels, reduction="none", ignore_index=-1)
    loss = tplayers.domain_mean(ce, mesh, mask=labels != -1)   # == serial ignore_index mean
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from tplayers.domain.boundary import sharded_to_replicated

__all__ = ["domain_sum", "domain_mean"]


def _unguarded():
    """Inside a domain region these functions read local slices and reduce them themselves: the
    region guard steps aside for them (their result is replicated)."""
    from tplayers.domain.guard import active_guard, stepped_aside

    guard = active_guard()
    return stepped_aside(guard) if guard is not None else contextlib.nullcontext()


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def domain_sum(x_local: torch.Tensor, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """Sum of every element of the domain-sharded tensor, a 0-d tensor equal on every rank.

    Accumulated in fp32 (fp64 for fp64 input), returned in ``x_local``'s dtype.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        full = torch.arange(10.0)
        assert tplayers.domain_sum(tplayers.shard(full, 0, mesh), mesh) == 45.0
    """
    if not x_local.is_floating_point():
        raise TypeError(f"domain_sum: x_local must be a floating-point tensor, got {x_local.dtype}")
    with _unguarded():
        total = sharded_to_replicated(x_local.sum(dtype=_acc_dtype(x_local)), mesh)
        return total.to(x_local.dtype)


def domain_mean(x_local: torch.Tensor, mesh: Optional[DeviceMesh] = None, *,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over every element of the domain (or over those where ``mask`` is true), equal on every rank.

    ``mask`` is a bool tensor of ``x_local``'s shape (this rank's slice of the global mask);
    masked-out elements get a zero gradient and may hold anything (NaN included). The sum and
    the count travel in one all-reduce per mesh dim; the count is exact (fp64), so uneven
    and empty shards weigh every element as the serial ``mean`` does. No valid element at all
    gives NaN, as ``torch.mean`` of an empty tensor.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        y, t = torch.randn(2, 1, 10, 6), torch.randn(2, 1, 10, 6)
        loss = tplayers.domain_mean(F.mse_loss(tplayers.shard(y, 2, mesh), tplayers.shard(t, 2, mesh),
                                               reduction="none"), mesh)
        torch.testing.assert_close(loss, F.mse_loss(y, t))
    """
    if not x_local.is_floating_point():
        raise TypeError(f"domain_mean: x_local must be a floating-point tensor, got {x_local.dtype}")
    with _unguarded():
        return _domain_mean(x_local, mesh, mask)


def _domain_mean(x_local, mesh, mask):
    acc = _acc_dtype(x_local)
    if mask is None:
        local = x_local.sum(dtype=acc)
        count = float(x_local.numel())
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"domain_mean: mask must be a bool tensor, got "
                            f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}")
        if mask.shape != x_local.shape:
            raise ValueError(f"domain_mean: mask must have x_local's shape {tuple(x_local.shape)}, "
                             f"got {tuple(mask.shape)}")
        local = torch.where(mask, x_local, torch.zeros((), dtype=x_local.dtype, device=x_local.device)).sum(dtype=acc)
        count = mask.sum(dtype=torch.float64)
    count = torch.as_tensor(count, dtype=torch.float64, device=x_local.device)
    both = sharded_to_replicated(torch.stack([local.to(torch.float64), count]), mesh)  # one fused all-reduce
    return (both[0] / both[1]).to(x_local.dtype)
