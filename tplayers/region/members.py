"""A region's members: every module of a region's subtree, and how a region is bound to a module.

:func:`bind_region` hooks a region's root (:class:`~tplayers.region.scope.DomainRegion`'s hooks) and
every module under it (:class:`Member`): a member keeps the running module's path on the guard for
messages, and opens the region's call when it is called outside one (a model method other than
``forward``, a submodule called by hand). See docs/design.md (the region guard).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from tplayers.domain.active import active_guard, in_guarded_call
from tplayers.layers._common import RegionAware
from tplayers.region.guard import RegionGuard
from tplayers.region.recompute import enter_recompute, in_backward
from tplayers.region.saved_hooks import saved_pack
from tplayers.region.scope import DomainRegion, first_tensor

__all__ = ["Member", "bind_region", "region_of"]


class Member:
    """A module of a region's subtree: keeps the running module's path on the active guard (error
    messages), and opens the region's call where the module is called outside it (a model method
    other than ``forward``, such as ``AutoencoderKL.decode``; a submodule called by hand): its first
    tensor argument is this rank's slice, as the region's input is. Twins open it from
    ``RegionAware.__call__`` (:meth:`call`), other modules from their hooks."""

    def __init__(self, name: str, region: Optional[DomainRegion] = None) -> None:
        self.name = name
        self.region = region
        self._opened: List[bool] = []

    def _opens(self) -> bool:
        return self.region is not None and not in_guarded_call() and torch._C._current_graph_task_id() == -1

    def call(self, module, call, args, kwargs):
        """A twin of the region called outside the region's call: the call runs as a region call."""
        if torch.compiler.is_compiling():
            if self.region is not None:
                self.region.check_compilable()
            return call(*args, **kwargs)
        if not self._opens() and active_guard() is None and in_backward():  # recomputed (checkpointing)
            guard = enter_recompute(self.region, self.name, module, args, kwargs)
            if guard is not None:
                try:
                    return guard.call_twin(module, call, args, kwargs)
                finally:
                    guard.__exit__(None, None, None)
        if not self._opens():
            return call(*args, **kwargs)
        self.region.open(first_tensor(args, kwargs), scope=module)
        out = None
        try:
            out = active_guard().call_twin(module, call, args, kwargs)
        finally:
            wrapped = self.region.close(out)
        return out if wrapped is None else wrapped

    def pre(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            if self.region is not None:
                self.region.check_compilable()
            return
        g = active_guard()
        if g is None and not isinstance(module, RegionAware) and self._opens():
            self.region.open(first_tensor(args, kwargs), scope=module)
            self._opened.append(True)
            g = active_guard()
        elif g is None and in_backward() and not isinstance(module, RegionAware):
            # a region's submodule re-run during backward (activation checkpointing inside the region):
            # it runs under a guard making the forward call's decisions (tplayers.region.recompute)
            g = enter_recompute(self.region, self.name, module, args, kwargs)
            self._opened.append(g)
            return
        else:
            self._opened.append(False)
        if g is not None:
            g.where.append(self.name)
            g.packs.append(saved_pack())

    def post(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return None
        g = active_guard()
        if g is not None and len(g.where) > 1 and g.where[-1] == self.name:
            g.where.pop()
            g.packs.pop()
        opened = self._opened.pop() if self._opened else False
        if isinstance(opened, RegionGuard):  # a recomputation's guard (pre)
            opened.__exit__(None, None, None)
        elif opened:
            return self.region.close(output)
        return None


def region_of(module: nn.Module) -> Optional[DomainRegion]:
    """The domain region bound to ``module`` as its root (``None``: none)."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), DomainRegion):
            return hook.__self__
    return None


def bind_region(root: nn.Module, mesh, shard_dims: Sequence[int], name: str = "", outer: bool = False) -> DomainRegion:
    """Guard every call of ``root`` as a domain region (hooks only; the module is unchanged otherwise),
    and every call of one of its modules made outside the root's call (:class:`_Member`). ``outer``: a
    model around container regions (see :class:`DomainRegion`)."""
    region = DomainRegion(mesh, shard_dims, name, outer=outer)
    region.root = root
    root.register_forward_pre_hook(region.pre_hook, with_kwargs=True)
    root.register_forward_hook(region.post_hook, with_kwargs=True, always_call=True)
    for sub_name, sub in root.named_modules(remove_duplicate=False):
        if sub is root:
            continue
        member = Member(f"{name}.{sub_name}" if name else sub_name, region)
        sub.register_forward_pre_hook(member.pre, with_kwargs=True)
        sub.register_forward_hook(member.post, with_kwargs=True, always_call=True)
        if isinstance(sub, RegionAware) and "_tp_region_entry" not in sub.__dict__:  # the innermost region's
            sub._tp_region_entry = member
        inner = region_of(sub)
        if outer and inner is not None:
            inner.nested = True
    return region
