"""Checkpoints of wrapped models: DDP, FSDP2 ``fully_shard`` and ``torch.compile``.

A checkpoint holds the serial model's keys and global shapes whatever wraps the model:

- ``DistributedDataParallel`` and ``torch.compile``'s ``OptimizedModule`` only add a
  key prefix (``module.`` / ``_orig_mod.``): :func:`unwrap` saves and loads the
  module they wrap.
- FSDP2 (``fully_shard(model, mesh=mesh["dp"])``) turns each parameter into a
  ``DTensor`` sharded over the data-parallel axis. Its "global" tensor is what
  the layer holds without FSDP: the tensor-parallel shard (or the full tensor for
  a replicated parameter), so FSDP is one more sharding composed with the
  tensor-parallel one. Saving all-gathers it over the dp axis
  (``DTensor.full_tensor()``, one collective per tensor, the same order on every
  rank) and writes it by its tensor-parallel spec (dp replicas write nothing).
  Loading reads this rank's tensor-parallel box into a staging buffer and, after
  every rank has validated, copies its dp slice into the ``DTensor``'s local shard.

Example (4 ranks, ``(dp, tp) = (2, 2)``)::

    mesh = tplayers.init_mesh((2, 2), ("dp", "tp"))
    model = tplayers.parallelize_module(build(), plan, mesh=mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])              # or DDP(model, process_group=mesh["dp"].get_group())
    tplayers.checkpoint.save_checkpoint(model, "ckpt/")   # keys and shapes of the serial model
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tplayers.mesh import is_dtensor

__all__ = ["unwrap", "is_dtensor", "full_local", "Staging"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``torch.compile`` wrappers (any nesting)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def full_local(t: torch.Tensor) -> torch.Tensor:
    """What the layer holds without FSDP: ``t`` itself, or a ``DTensor`` all-gathered over its mesh
    (collective over the DTensor's mesh: every rank must call it for the same tensors in order)."""
    if is_dtensor(t):
        return t.detach().full_tensor()
    return t


class Staging:
    """Load-side stand-ins for ``DTensor`` targets: a buffer of the full (tensor-parallel) shape is
    loaded, then :meth:`finish` copies this rank's slice into the ``DTensor``'s local shard.

    Also carries deferred actions (e.g. installing freshly created optimizer state), run by
    :meth:`finish` only after every rank validated the checkpoint.
    """

    def __init__(self) -> None:
        self._copies: List[tuple] = []
        self._actions: List[Callable[[], None]] = []

    def target(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor a load should write ``t``'s values into (``t`` itself unless it is a DTensor)."""
        if not is_dtensor(t):
            return t
        buf = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.to_local().device)
        self._copies.append((t, buf))
        return buf

    def defer(self, action: Callable[[], None]) -> None:
        self._actions.append(action)

    def finish(self) -> None:
        if self._copies:  # DTensors: their module is loaded
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        with torch.no_grad():
            for dt, buf in self._copies:
                shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
                box = buf
                for d, (n, o) in enumerate(zip(shape, offset)):
                    box = box.narrow(d, o, n)
                dt.to_local().copy_(box)
        for action in self._actions:
            action()
        self._copies.clear()
        self._actions.clear()


def staged_target(t: torch.Tensor, staging: Optional[Staging]) -> torch.Tensor:
    """``t`` as a save sees it (all-gathered when a DTensor) or, with ``staging``, as a load writes it."""
    if staging is not None:
        return staging.target(t)
    return full_local(t)
