"""Swaps keep what a subclass adds, or refuse it (docs/design.md, plans).

A tensor-parallel style swaps an ``nn.Linear``, an ``nn.Embedding`` or a transformers ``Conv1D``
for a twin that computes the *base* class's function. A subclass whose class defines its own
``forward`` (a scale, a bias trick, a cast) would silently lose it, so:

- a subclass the library knows keeps its behaviour on the twin: transformers'
  ``*ScaledWordEmbedding`` (Gemma, Gemma2, Gemma3, ...: ``super().forward(ids) * embed_scale``)
  becomes a twin that multiplies by the same ``embed_scale`` after the lookup (:func:`embedding_scale`);
- any other subclass with its own ``forward`` is refused with a ``ValueError`` naming its class
  (:func:`check_no_forward_override`), before anything changes.

A known subclass is recognised by its class name and attribute and then confirmed by running its
forward on two ids against the base lookup times the scale (bit for bit), so a class that only
borrows the name is refused too.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["forward_owner", "embedding_scale", "check_no_forward_override"]

Scale = Union[torch.Tensor, float]


def _defining_class(cls: type, attr: str) -> type:
    return next(c for c in cls.__mro__ if attr in c.__dict__)


def forward_owner(module: nn.Module) -> Optional[type]:
    """The class whose own ``forward`` replaces the swapped base's (``nn.Linear``, ``nn.Embedding``,
    or a class named ``Conv1D`` in the MRO), or ``None`` when ``module`` runs the base's forward.
    Structural ``Conv1D``-likes with no ``Conv1D`` class in their MRO are taken as they are."""
    cls = type(module)
    for base in (nn.Linear, nn.Embedding):
        if isinstance(module, base):
            return None if cls.forward is base.forward else _defining_class(cls, "forward")
    conv = next((c for c in cls.__mro__ if c.__name__ == "Conv1D"), None)
    if conv is not None and "forward" in conv.__dict__ and cls.forward is not conv.forward:
        return _defining_class(cls, "forward")
    return None


def embedding_scale(module: nn.Module) -> Optional[Scale]:
    """The ``embed_scale`` of a transformers ``*ScaledWordEmbedding`` (``forward(ids) =
    nn.Embedding.forward(ids) * embed_scale``), confirmed by running its forward on two ids; ``None``
    for any other module."""
    if not isinstance(module, nn.Embedding) or not type(module).__name__.endswith("ScaledWordEmbedding"):
        return None
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or not scale.is_floating_point():
            return None
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return None
    weight = module.weight
    if weight.device.type != "meta":
        ids = torch.tensor([0, module.num_embeddings - 1], device=weight.device)
        with torch.no_grad():
            got = module(ids)
            base = F.embedding(ids, weight, module.padding_idx)
            want = base * (scale.to(weight.dtype) if isinstance(scale, torch.Tensor) else scale)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
            return None
    return scale


def check_no_forward_override(key_text: str, style: str, name: str, module: nn.Module) -> None:
    """``ValueError`` naming the class when ``module``'s class overrides the base ``forward`` and is
    not a subclass the library knows (:func:`embedding_scale`)."""
    owner = forward_owner(module)
    if owner is None or embedding_scale(module) is not None:
        return
    base = (
        "nn.Linear"
        if isinstance(module, nn.Linear)
        else "nn.Embedding"
        if isinstance(module, nn.Embedding)
        else "Conv1D"
    )
    raise ValueError(
        f"plan key {key_text}: {style} would swap module {name or '<root>'!r} of class "
        f"{type(module).__module__}.{type(module).__qualname__}, whose forward (defined by "
        f"{owner.__qualname__}) replaces {base}'s; its twin computes {base}'s function only, so what that "
        f"forward adds would be lost. Leave the module out of the plan (or shard it with a style or "
        f"partition function of your own that keeps its behaviour)"
    )
