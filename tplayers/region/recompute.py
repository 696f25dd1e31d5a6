"""Activation checkpointing inside a domain region: the recomputation re-enters the region's guard.

``torch.utils.checkpoint`` runs a checkpointed function a second time during backward, after the
region's call has ended, where no guard is active: routed ops would run on each rank's slice alone
and replicated tensors meeting sharded data would not have their gradients summed. The packages
switch checkpointing on per block (diffusers ``enable_gradient_checkpointing()``, timm
``set_grad_checkpointing()``, MONAI ``use_checkpoint``) by checkpointing a module's call. So a
region's member module called during backward with no
guard active (:class:`~tplayers.region.members.Member`) runs under a *recomputation guard*
(:func:`enter_recompute`): a :class:`~tplayers.region.guard.RegionGuard` of the same region, with

* the forward call's token, so its tensors' tags (which dims are sharded) are valid again. With
  ``use_reentrant=False`` the checkpointed module receives the forward's own tensors, tags and all;
  with ``use_reentrant=True`` it receives detached copies, whose layouts are those of the tensors
  the checkpoint node saved (``torch._C._current_autograd_node()``: the same storage, offset,
  shape and strides);
* the region's routed twins (the same per call-site routes), the local lengths the forward's code
  read (:class:`~tplayers.region.guard.CallToken`), the forward's partition agreement (no entry
  collective, and no re-agreement of decisions: the forward agreed on them);
* no gradient buckets: the twins sum their own parameter gradients, which is what a reentrant
  recomputation's own backward needs; a non-reentrant one only hands its saved tensors to the
  forward's graph, whose twins deposit into the forward call's buckets as before.

So the recomputation makes the forward's decisions on the same data: the same layouts, the same
routed ops, the same gradient sums, and it is exact. Collectives in a recomputation (halo exchanges,
routed reductions) run in backward on every rank in the same order, as the whole model's
backward does.

A checkpointed function *body* (transformers v5's ``GradientCheckpointingLayer`` checkpoints
``partial(forward, self)`` from inside the layer's call; any plain function) is re-guarded as a
whole by :func:`region_context_fn`, passed as the checkpoint's ``context_fn`` (``use_reentrant=False``):
its recomputation context pushes the forward call's guard around the recomputed function. Without
it, what is re-guarded is module calls, so the checkpointed function's own ops must be inside them:

* ``use_reentrant=False``: an op on sharded data in a checkpointed plain function's body, outside
  the modules it calls, is refused in forward, naming ``region_context_fn`` (the guard sees the
  checkpoint's saved-tensor hooks, :mod:`tplayers.region.saved_hooks`); a function that only calls
  modules (timm's ``checkpoint_seq``) is exact;
* ``use_reentrant=True``: the checkpointed function must be a module's call (the module, its
  ``__call__``, or a ``functools.partial`` of it); anything else raises ``ValueError`` in
  backward, on every rank (every rank recomputes the same blocks in the same order).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from tplayers.domain.active import active_guard
from tplayers.region.guard import CallToken, RegionGuard, tag_of
from tplayers.region.saved_hooks import saved_pack

__all__ = ["enter_recompute", "in_backward", "region_context_fn"]


def in_backward() -> bool:
    """Whether the code now running belongs to a backward pass (the autograd engine runs it)."""
    return torch._C._current_graph_task_id() != -1


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, torch.Tensor))


def _signature(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _calls(fn: Any, module: Any) -> bool:
    """Whether ``fn`` is a call of ``module``: the module, its bound ``__call__`` (the class's, or
    ``nn.Module``'s that an overriding ``__call__`` reaches with ``super().__call__``), or a partial of them."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    call = getattr(fn, "__func__", None)  # a bound __call__: the module class's, or nn.Module's it wraps
    return fn is module or (
        getattr(fn, "__self__", None) is module and call in (type(module).__call__, nn.Module.__call__)
    )


def _from_saved(name: str, module: Any, tensors) -> list:
    """``use_reentrant=True``: the checkpoint node running now saved the forward's tensors; their detached
    copies among ``tensors`` as ``(copy, (token, layout))`` (empty: no checkpoint node running, or it
    saved nothing sharded). The checkpointed function must be ``module``'s call: its body is then all
    inside the recomputation guard."""
    node = torch._C._current_autograd_node()
    if node is None or getattr(node, "_forward_cls", None) is not CheckpointFunction:
        return []
    if not _calls(getattr(node, "run_function", None), module):
        raise ValueError(
            f"domain region: module {name!r} is recomputed for activation checkpointing (use_reentrant=True) "
            f"inside a checkpointed function that is not its call ({getattr(node, 'run_function', None)!r}): "
            "that function's own ops on sharded data would run without the region guard. Checkpoint a "
            "module's call, checkpoint(module, x) or checkpoint(module.__call__, x), as diffusers does, or "
            "use use_reentrant=False with context_fn=tplayers.region_context_fn"
        )
    saved = {}
    for s in node.saved_tensors:
        tag = tag_of(s)
        if tag is not None and isinstance(tag[0], CallToken):
            saved[_signature(s)] = tag
    return [(t, saved[_signature(t)]) for t in tensors if _signature(t) in saved]


def enter_recompute(region: Any, name: str, module: Any, args, kwargs) -> Optional[RegionGuard]:
    """Push the recomputation guard of ``region`` for a call of its member ``name`` running during backward
    with no guard active (see the module docstring); ``None`` when no argument is sharded (the module
    then runs as it did in forward: on replicated data, where the guard steps aside). The caller pops
    it with ``guard.__exit__(None, None, None)`` after the call."""
    if region is None:
        return None
    tensors = list(_tensors(args, kwargs))
    token = next((tag[0] for tag in map(tag_of, tensors) if tag is not None and isinstance(tag[0], CallToken)), None)
    copies = [] if token is not None else _from_saved(name, module, tensors)
    if copies:
        token = copies[0][1][0]
    if token is None:  # a nested checkpoint's detached copies of tensors its parent's recomputation tagged
        token = next(filter(None, map(region.aliases.token_of, tensors)), None)
    if token is None:
        return None
    guard = RegionGuard(region.mesh, region.shard_dims, name, token=token)
    guard.aliases, guard.recomputing = region.aliases, True
    for t, (_, layout) in copies:
        guard.mark(t, layout)  # the detached copy of a tagged tensor: the same slice, the same layout
    guard.routes = region.routes
    guard.reads = token.reads
    guard.agreed = True  # the forward's entry agreement covers this call's partition
    guard.__enter__()
    return guard


class _Body:
    """The forward context of :func:`region_context_fn`: ops in the checkpointed function's own body are
    allowed (the guard refuses them in other checkpoints: their recomputation would run unguarded)."""

    def __init__(self, guard: RegionGuard) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        self.guard.where.append(self.guard.where[-1])
        self.guard.packs.append(saved_pack())  # the checkpoint's own hooks: its body counts as a module's

    def __exit__(self, *exc) -> bool:
        self.guard.where.pop()
        self.guard.packs.pop()
        return False


class _Recompute:
    """The recomputation context of :func:`region_context_fn`: the forward call's guard again (its token,
    routes, read sizes, agreement) around the whole recomputed function."""

    def __init__(self, guard: RegionGuard) -> None:
        self.args = (guard.mesh, guard.shard_dims, guard.where[-1], guard.token, guard.routes, guard.reads)
        self.aliases = guard.aliases
        self.pushed: list = []

    def __enter__(self) -> None:
        mesh, shard_dims, name, token, routes, reads = self.args
        guard = RegionGuard(mesh, shard_dims, name, token=token)
        guard.aliases, guard.recomputing = self.aliases, self.aliases is not None  # nested checkpoints
        guard.routes, guard.reads, guard.agreed = routes, reads, True
        guard.__enter__()
        self.pushed.append(guard)

    def __exit__(self, *exc) -> bool:
        self.pushed.pop().__exit__(None, None, None)
        return False


def region_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` inside a domain
    region: the whole recomputed function, not only the modules it calls, runs under the region's guard
    with the forward call's layouts and routes, so a checkpointed plain function (or a module's
    ``forward`` body, as transformers' ``GradientCheckpointingLayer`` checkpoints) is exact.

    Outside a region call it changes nothing (two null contexts).

    Example (transformers, a model under ``{"": DomainParallel(...)}``)::

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": tplayers.region_context_fn}
        )

    Returns:
        ``(forward context, recomputation context)``, as ``torch.utils.checkpoint`` expects.
    """
    guard = active_guard()
    if not isinstance(guard, RegionGuard):
        return contextlib.nullcontext(), contextlib.nullcontext()
    return _Body(guard), _Recompute(guard)
