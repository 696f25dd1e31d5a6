"""The ``tplayers::`` custom ops, registered explicitly and once, on first use (never at import).

``torch.compile(fullgraph=True)`` needs the collectives, the conv backward's communication and
the neighbourhood-attention tables as opaque graph nodes: custom ops. Defining one registers it
with PyTorch's dispatcher for the whole process, so no module does that when it is imported.
A module that owns ops describes them as :class:`OpSpec` data and calls :func:`register` from an
``ensure_*`` function on the path that needs them (only while compiling); :func:`register` is
idempotent and thread-safe, so the first use registers and later ones find the ops in place.
The ``ensure_*`` functions are marked :func:`constant_result` (``torch.compiler.assume_constant_result``
without importing Dynamo): dynamo runs them as plain Python while tracing (the registration happens
before the op is looked up) and puts nothing of them in the graph.

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

__all__ = ["GraphBreak", "OpSpec", "constant_result", "register", "registered"]


class OpSpec(NamedTuple):
    """One custom op: its qualified name, eager body (typed: the schema comes from the annotations),
    fake (shape) implementation and, optionally, ``(backward, setup_context)`` for autograd."""

    name: str
    impl: Callable
    fake: Callable
    autograd: Optional[Tuple[Callable, Callable]] = None


def constant_result(fn: Callable) -> Callable:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` does, without importing Dynamo.

    Dynamo runs a function so marked as plain Python while it traces and puts its result in the
    graph as a constant (the ``ensure_*`` functions here, the domain layers' layout priming). The
    public decorator imports ``torch._dynamo`` (about 1.2 s on a 2-vCPU Xeon) only to set the
    mark ``fn._dynamo_marked_constant``, which Dynamo reads when it meets ``fn``; applied when the
    modules were imported it made ``import tplayers`` load Dynamo in every process, compiling or
    not. This sets the same mark (tests/unit/test_op_registration.py checks it against the public
    decorator, and that ``import tplayers`` leaves Dynamo unloaded).

    Example::

        >>> import torch
        >>> from tplayers.ops.registry import constant_result
        >>> @constant_result
        ... def world() -> int:
        ...     return 2
        >>> torch.compile(lambda x: x * world(), fullgraph=True, backend="eager")(torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    fn._dynamo_marked_constant = True
    return fn


class GraphBreak:
    """``fn`` as ``torch.compiler.disable(fn, reason=reason)`` runs it (under ``torch.compile``, a graph
    break: ``fn`` runs eagerly; a ``ValueError`` it raises reaches the caller), the wrapper built by
    :meth:`prepare` or on the first call instead of when the module is imported (building it imports
    Dynamo, about 1.2 s). A wrapper first built while Dynamo traces is a graph break of its own, and a
    ``fullgraph=True`` error then names ``torch.compiler.disable`` instead of ``reason``: the owner calls
    :meth:`prepare` eagerly, ahead of any tracing (the region guard's scopes, when they are made).

    Example::

        >>> import torch
        >>> from tplayers.ops.registry import GraphBreak
        >>> def refuse(name):
        ...     raise ValueError(f"{name}: run it eagerly")
        >>> refuse_now = GraphBreak(refuse, "tplayers doc: run it eagerly").prepare()
        >>> def f(x):
        ...     refuse_now("f")
        ...     return x
        >>> try:
        ...     torch.compile(f, backend="eager")(torch.ones(1))
        ... except ValueError as e:
        ...     print(e)
        f: run it eagerly
    """

    def __init__(self, fn: Callable, reason: str) -> None:
        self.fn, self.reason, self._disabled = fn, reason, None

    def prepare(self) -> "GraphBreak":
        """Build the disabled wrapper now (idempotent); returns self."""
        if self._disabled is None:
            self._disabled = torch.compiler.disable(self.fn, reason=self.reason)
        return self

    def __call__(self, *args, **kwargs):
        return self.prepare()._disabled(*args, **kwargs)


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
