"""The active region guard, as seen from below it.

A domain region's guard (:class:`tplayers.region.guard.RegionGuard`) is a ``TorchFunctionMode``
pushed while the region runs. Code below the region package (the twins' ``__call__``, the
boundary ops, the reductions) asks this module whether one is active and steps it aside; it
never imports the guard. A mode counts as a region guard when its class sets
``is_region_guard = True``. See ``docs/design.md`` (the region guard).
"""

from __future__ import annotations

import contextvars
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["active_guard", "stepped_aside", "partition_agreed", "partition_checked", "in_guarded_call"]

# The guards stepped aside for the code now running, innermost last: per thread and context, as the
# torch-function mode stack it mirrors is.
_ASIDE: contextvars.ContextVar[Tuple[Any, ...]] = contextvars.ContextVar("tplayers_guards_aside", default=())


def _is_guard(mode: Any) -> bool:
    return getattr(type(mode), "is_region_guard", False) is True


def active_guard() -> Optional[Any]:
    """The innermost active region guard (``None`` outside regions, while compiling, inside twins,
    and inside the guard's own handlers, where it is popped).

    >>> from tplayers.domain.active import active_guard
    >>> active_guard() is None
    True
    """
    if torch.compiler.is_compiling():
        return None
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if _is_guard(mode):
            return mode
    return None


def partition_agreed() -> bool:
    """Whether the code now running is inside a call of a ``DomainParallel`` region, whose entry
    agreement already compared every rank's partition this call (its guard is active, or stepped
    aside for the twin now running). Twins called anywhere else agree on their partition per call."""
    guard = active_guard()
    if guard is None:
        guard = next((g for g in reversed(_ASIDE.get()) if g is not None), None)
    return bool(getattr(guard, "agreed", False))


def partition_checked() -> bool:
    """Whether the code now running is inside a ``DomainParallel`` region call whose partition a
    previous call already ran through (not the partition's first, checking call): only then may a
    twin reuse a layout it cached by its local shape (see ``tplayers.layers._common.layout_cached``)."""
    guard = active_guard()
    if guard is None:
        guard = next((g for g in reversed(_ASIDE.get()) if g is not None), None)
    return bool(getattr(guard, "agreed", False)) and not getattr(guard, "check", True)


def in_guarded_call() -> bool:
    """Whether the code now running belongs to a guarded call: a region guard is active, or stepped
    aside for the twin or routed implementation now running. A region's member module called where
    this is ``False`` (a model method other than ``forward``, a submodule called by hand) opens its
    region's call itself (:mod:`tplayers.region.scope`)."""
    return active_guard() is not None or any(g is not None for g in _ASIDE.get())


class stepped_aside:
    """Context: pop the region guards (and any mode above them) from the torch-function mode stack
    for a block; push them back after it (twins and routed implementations run unguarded).

    ``settle`` (default): the block may communicate, so first the guard settles the decisions it
    made from local shapes since its last collective (``guard.settle()``, see
    :mod:`tplayers.region.guard`); the guard's own local handlers pass ``settle=False``."""

    def __init__(self, guard: Any = None, settle: bool = True) -> None:
        self.guard = guard
        self.settle = settle
        self.popped: List[Any] = []

    def __enter__(self) -> "stepped_aside":
        while any(_is_guard(torch._C._get_function_stack_at(i)) for i in range(torch._C._len_torch_function_stack())):
            self.popped.append(torch._C._pop_torch_function_stack())
        self._token = _ASIDE.set(_ASIDE.get() + (self.guard,))
        if self.settle and self.guard is not None and hasattr(self.guard, "settle"):
            try:
                self.guard.settle()
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc) -> bool:
        _ASIDE.reset(self._token)
        while self.popped:
            torch._C._push_on_torch_function_stack(self.popped.pop())
        return False
