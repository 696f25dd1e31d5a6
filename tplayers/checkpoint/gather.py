"""Reassemble the serial-layout state dict from every rank's shards (collective)."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

from tplayers.checkpoint.layout import (
    LocalTensor,
    allgather_json,
    describe,
    local_tensors,
    plan_layout,
    real_views,
    world_info,
)
from tplayers.checkpoint.wrapped import unwrap
from tplayers.comm import all_gather_along_dim
from tplayers.mesh import is_dtensor


def gather_state_dict(model: nn.Module, *, all_ranks: bool = False) -> Dict[str, torch.Tensor]:
    """The serial model's ``state_dict()``: same keys, global shapes, in ``state_dict`` order.

    Collective over the default process group. Returns the full dict on rank 0
    (on every rank with ``all_ranks=True``) and ``{}`` elsewhere. Sharded
    tensors are all-gathered along their shard dim; replicated ones are
    returned as this rank's tensor (detached, sharing memory with the model).

    Args:
        model: the (parallelized, possibly wrapped) model.
        all_ranks: return the dict on every rank, not only on rank 0.

    Returns:
        ``{key: tensor}`` in the serial layout (``{}`` on ranks other than 0 unless ``all_ranks``).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same serial model on every rank
        serial = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        full = gather_state_dict(model, all_ranks=True)
        assert list(full) == list(serial.state_dict())
        assert all(torch.equal(full[k], v) for k, v in serial.state_dict().items())
    """
    return _gather(local_tensors(model), all_ranks)


def gather_grads(model: nn.Module, *, all_ranks: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient in the serial layout: what ``serial.named_parameters()`` would hold
    in ``.grad`` after the same step (a collective over the default process group).

    Keys are ``named_parameters()`` names (a shared parameter once), in that order; a parameter whose
    ``.grad`` is ``None`` on every rank is left out. Sharded gradients are all-gathered along their
    parameter's shard dim; replicated ones (inside a domain region every rank holds the same, full
    gradient) are returned as this rank's tensor, detached. Compare a parallel step with a serial one
    without swapping ``.grad`` into ``.data`` by hand.

    Args:
        model: the (parallelized, possibly wrapped) model, after ``backward``.
        all_ranks: return the dict on every rank, not only on rank 0.

    Returns:
        ``{key: gradient}`` (``{}`` on ranks other than 0 unless ``all_ranks``).

    Raises:
        ValueError: on every rank, when a parameter has a gradient on some ranks and ``None`` on others.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        from tplayers.checkpoint import gather_grads
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same serial model on every rank
        serial = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8)).double()
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        x = torch.randn(4, 8, dtype=torch.float64)
        serial(x).square().sum().backward()
        model(x).square().sum().backward()
        grads = gather_grads(model, all_ranks=True)
        assert all(torch.allclose(grads[k], p.grad) for k, p in serial.named_parameters())
    """
    params = dict(unwrap(model).named_parameters())  # a shared parameter once, under its first name
    local = {k: lt for k, lt in local_tensors(model).items() if k in params}
    missing = sorted(k for k in local if params[k].grad is None)
    rows = allgather_json(missing)
    if any(r != rows[0] for r in rows):
        lines = "\n".join(f"  rank {r}: {m}" for r, m in enumerate(rows))
        raise ValueError(
            f"gather_grads: parameters without a gradient differ across ranks (expected the same set):\n{lines}"
        )
    grads = {}
    for k in sorted(set(local) - set(missing)):  # the same collective order on every rank
        g = params[k].grad
        if is_dtensor(g):  # an FSDP2 gradient: the whole tensor, as local_tensors does for its parameter
            g = g.full_tensor()
        grads[k] = replace(local[k], tensor=g)
    full = _gather(grads, all_ranks)
    return {k: full[k] for k in params if k in full}


def _gather(local: Dict[str, LocalTensor], all_ranks: bool) -> Dict[str, torch.Tensor]:
    """The serial-layout tensors of ``local`` (collective)."""
    rank, world = world_info()
    complex_keys = {k for k, lt in local.items() if lt.tensor.dtype == torch.complex128}
    local = real_views(local)  # gathered as their float64 views (the layout rows name safetensors dtypes)
    per_rank = allgather_json(describe(local))
    tensors, _ = plan_layout(per_rank)
    spans = [{row[0]: row[4] for row in rows} for rows in per_rank]  # per rank: key -> [[start, stop], ...]
    full: Dict[str, torch.Tensor] = {}
    for key in sorted(local):  # the same collective order on every rank
        lt, g = local[key], tensors[key]
        t = lt.tensor.detach()
        if g.dim is not None and (world > 1 or lt.spec.ranges):
            sizes = [sum(b - a for a, b in spans[r][key]) for r in range(world)]
            got = (
                all_gather_along_dim(t.contiguous(), g.dim, sizes, dist.group.WORLD, tag="checkpoint")
                if world > 1
                else t
            )
            t = torch.empty(g.shape, dtype=t.dtype, device=t.device)
            offset = 0  # each rank's ranges in its local order; replicas write the same values twice
            for r in range(world):
                for a, b in spans[r][key]:
                    t.narrow(g.dim, a, b - a).copy_(got.narrow(g.dim, offset, b - a))
                    offset += b - a
        full[key] = torch.view_as_complex(t) if key in complex_keys else t
    if rank != 0 and not all_ranks:
        return {}
    return {key: full[key] for key in local}
