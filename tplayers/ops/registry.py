"""The ``tplayers::`` custom ops, registered explicitly and once, on first use (never at import).

``torch.compile(fullgraph=True)`` needs the collectives, the conv backward's communication and
the neighbourhood-attention tables as opaque graph nodes: custom ops. Defining one registers it
with PyTorch's dispatcher for the whole process, so no module does that when it is imported.
A module that owns ops describes them as :class:`OpSpec` data and calls :func:`register` from an
``ensure_*`` function on the path that needs them (only while compiling); :func:`register` is
idempotent and thread-safe, so the first use registers and later ones find the ops in place.
The ``ensure_*`` functions are marked ``torch.compiler.assume_constant_result``: dynamo runs
them as plain Python while tracing (the registration happens before the op is looked up) and
puts nothing of them in the graph.

Example::

    >>> import torch
    >>> from tplayers.ops.registry import OpSpec, register, registered
    >>> def twice(x: torch.Tensor) -> torch.Tensor:
    ...     return 2 * x
    >>> spec = OpSpec("tplayers_doc::twice", twice, lambda x: torch.empty_like(x))
    >>> register([spec]) and register([spec])       # the second call finds it registered
    True
    >>> "tplayers_doc::twice" in registered(), torch.ops.tplayers_doc.twice(torch.ones(2)).tolist()
    (True, [2.0, 2.0])
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import torch

__all__ = ["OpSpec", "register", "registered"]


class OpSpec(NamedTuple):
    """One custom op: its qualified name, eager body (typed: the schema comes from the annotations),
    fake (shape) implementation and, optionally, ``(backward, setup_context)`` for autograd."""

    name: str
    impl: Callable
    fake: Callable
    autograd: Optional[Tuple[Callable, Callable]] = None


_LOCK = threading.Lock()
_HANDLES: Dict[str, object] = {}  # name -> torch.library CustomOpDef (kept alive: it owns the registration)


def register(specs: Iterable[OpSpec]) -> bool:
    """Register every op of ``specs`` not registered yet; returns True. Idempotent and thread-safe."""
    with _LOCK:
        for spec in specs:
            if spec.name in _HANDLES:
                continue
            op = torch.library.custom_op(spec.name, spec.impl, mutates_args=())
            op.register_fake(spec.fake)
            if spec.autograd is not None:
                backward, setup_context = spec.autograd
                op.register_autograd(backward, setup_context=setup_context)
            _HANDLES[spec.name] = op
    return True


def registered() -> Tuple[str, ...]:
    """Names of the ops :func:`register` has registered in this process, in registration order."""
    with _LOCK:
        return tuple(_HANDLES)
