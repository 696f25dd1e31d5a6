"""Gradients that a double backward may read (``create_graph=True``: gradient penalties, R1 / WGAN-GP).

Where a backward is run with ``create_graph=True``, autograd records what the backward computes so it
can be differentiated again. The library's collectives run their backward as their adjoint's
autograd node there (``ReplicatedToSharded`` <-> ``ShardedToReplicated``, ``CopyToParallelRegion`` <->
``ReduceFromParallelRegion``, ``SplitAlongDim`` <-> ``GatherAlongDim``, the halo exchange <-> its
adjoint), so a second differentiation is exact. What a backward computes that cannot be
differentiated again (a convolution twin's parameter gradients, fused and summed outside autograd)
is handed back through :func:`once_only`: using it is fine, differentiating it raises a
``RuntimeError`` that says what, instead of a silently missing term. See docs/design.md (double
backward).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["once_only"]


def once_only(what: str, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """``grads`` (from a backward run with ``create_graph=True``) as tensors whose differentiation raises
    ``RuntimeError`` naming ``what``; ``None`` stays ``None``.

    >>> import torch
    >>> g, none = once_only("an example gradient", torch.ones(2), None)
    >>> g.requires_grad, none is None
    (True, True)
    """
    live = [g for g in grads if g is not None]
    if not live:
        return grads
    err = torch._C._functions.DelayedError(
        f"tplayers: {what} cannot be differentiated a second time (double backward); see docs/design.md "
        "(double backward)".encode(),
        len(live),
    )
    outs = err(*[g.detach().requires_grad_() for g in live])
    it = iter(outs if isinstance(outs, tuple) else (outs,))
    return tuple(None if g is None else next(it) for g in grads)
