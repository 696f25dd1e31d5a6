"""The global gradient norm of a tensor-parallel model, and clipping by it (docs/design.md, training).

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on a tensor-parallel model sees
only this rank's shards: each rank computes a different norm, clips by a different factor, and
replicated parameters (norms, a replicated head) drift apart. :func:`clip_grad_norm_` computes the
serial model's norm instead: the gradients of tensors sharded by tplayers layers (by their
``shard_specs()``) are reduced over their layer's mesh, each serial element counted once
(``counted_ranges``: a grouped-query key/value block held by several ranks is counted on one),
and replicated tensors are counted once, since every rank holds the same gradient. Every rank gets
the same norm and scales by the same factor.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tplayers.comm.accounting import record_collective
from tplayers.layers._common import ShardedModule, get_tensor

__all__ = ["grad_norm", "clip_grad_norm_"]


def _check_norm_type(norm_type) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type must be a positive number or inf, got {type(norm_type).__name__}")
    p = float(norm_type)
    if not (p > 0):  # also rejects nan
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def _sharded_params(model: nn.Module) -> Dict[int, Tuple[object, Optional[int], Optional[tuple]]]:
    """``{id(parameter): (group, dim, counted local ranges)}`` for every parameter that a tplayers
    layer holds sharded; the groups in the order the model first meets them."""
    out = {}
    for mod in model.modules():
        if not isinstance(mod, ShardedModule):
            continue
        params = dict(mod.named_parameters())
        for name, spec in mod.shard_specs().items():
            if spec.is_replicated or name not in params:
                continue
            if mod.mesh.ndim != 1:
                raise ValueError(
                    f"grad_norm: {type(mod).__name__}.{name} is sharded on a {mod.mesh.ndim}-D mesh; "
                    f"expected a 1-D mesh"
                )
            out.setdefault(id(get_tensor(mod, name)), (mod.mesh.get_group(0), spec.dim, mod.counted_ranges(name)))
    return out


def _power(g: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|`` for ``p = inf``) as a 0-d tensor of ``dtype``."""
    if g.numel() == 0:
        return torch.zeros((), dtype=dtype, device=g.device)
    norm = torch.linalg.vector_norm(g, p, dtype=dtype)
    return norm if math.isinf(p) else norm**p


def _all_reduce(t: torch.Tensor, group, p: float) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size > 1:
        record_collective("all_reduce", t.numel() * t.element_size(), size, "grad_norm")
        dist.all_reduce(t, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=group)
    return t


def _params(model) -> List[nn.Parameter]:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be the nn.Module whose gradients to measure (pass the model, not model.parameters(): "
            f"a parameter alone does not say how it is sharded), got {type(model).__name__}"
        )
    return list(model.parameters())  # each tensor once, tied ones included


def grad_norm(model: nn.Module, norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``model``'s gradients, as the serial model's, on every rank.

    Sharded parameters of tplayers layers contribute ``sum |g|^p`` over their layer's mesh (each serial
    element once); every other parameter once (its gradient is the same on every rank). Parameters
    without a gradient are skipped. A collective: every rank of the model's meshes must call it, in
    the same order. Accumulates in float32 or wider; the result has that dtype.

    Args:
        model: the (parallelized) module; wrappers (DDP, ``torch.compile``) work as they list
            the same parameters.
        norm_type: a positive number or ``inf``.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the norm is nan or inf.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (``model.parameters()`` cannot tell what is
            sharded), or ``norm_type`` is not a number.
        ValueError: ``norm_type`` is not positive.
    """
    params = _params(model)
    p = _check_norm_type(norm_type)
    sharded = _sharded_params(model)
    grads = [q.grad for q in params if q.grad is not None]
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    combine = torch.maximum if math.isinf(p) else torch.add
    replicated = torch.zeros((), dtype=dtype, device=device)
    per_group: Dict[object, torch.Tensor] = {}
    for group, _, _ in sharded.values():  # the groups in model order, the same on every rank
        per_group.setdefault(group, torch.zeros((), dtype=dtype, device=device))
    for q in params:
        if q.grad is None:
            continue
        g = q.grad.detach()
        if id(q) not in sharded:
            replicated = combine(replicated, _power(g, p, dtype).to(device))
            continue
        group, dim, counted = sharded[id(q)]
        pieces = [g] if counted is None else [g.narrow(dim, a, b - a) for a, b in counted]
        for piece in pieces:
            per_group[group] = combine(per_group[group], _power(piece, p, dtype).to(device))
    total = replicated
    for group, part in per_group.items():
        total = combine(total, _all_reduce(part.reshape(1), group, p).reshape(()))
    norm = total if math.isinf(p) else total ** (1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `model` is non-finite, so it cannot be "
            f"clipped (the same on every rank). To disable this error and scale the gradients by the "
            f"non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return norm


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel model: scale every gradient of
    ``model`` by ``min(1, max_norm / (norm + 1e-6))`` where ``norm`` is :func:`grad_norm` (the
    serial model's global norm), the same factor on every rank. Returns the norm (before clipping).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        plan = {"0": tplayers.ColumnParallel(), "1": tplayers.RowParallel()}
        model = tplayers.parallelize_module(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)), plan, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 8)).square().sum().backward()
        norm = tplayers.clip_grad_norm_(model, 1.0)   # the model, not model.parameters()
        opt.step()

    Raises:
        TypeError / ValueError: as :func:`grad_norm`, and ``max_norm`` not a number.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
    norm = grad_norm(model, norm_type, error_if_nonfinite=error_if_nonfinite)
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for q in _params(model):
            if q.grad is not None:
                q.grad.detach().mul_(coef.to(q.grad.device, q.grad.dtype))
    return norm
