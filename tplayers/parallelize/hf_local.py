"""Parameters the string plan leaves out but the sharding reaches (docs/huggingface.md).

A transformers plan names the linears; a module with parameters of its own beside them (Apertus'
xIELU activation with learned scalars, between ``up_proj`` and ``down_proj``) runs on this rank's
slice of the features once its sibling column-parallel linear is sharded. Its gradients are then
this rank's part of the serial ones, silently. :func:`cover_local_parameters` finds such modules
(own parameters, not linears, siblings of a non-gathered ``ColumnParallel``, not in the plan):

- all parameters scalars (one element each): an elementwise op with learned constants, so it is
  wrapped in :class:`~tplayers.ReplicatedGradSum` (its gradients summed over the ranks: exact);
- otherwise (a norm or projection over the sharded features) ``ValueError`` naming it.
"""

from __future__ import annotations

import re
from typing import Callable, Dict

from torch import nn

from tplayers.layers._linear_base import linear_dims
from tplayers.parallelize.styles import ColumnParallel, ParallelStyle

__all__ = ["cover_local_parameters", "is_experts_entry", "experts_module_key", "EXPERTS_HINT"]

#: appended to a refusal of a mixture of experts' plan entry
EXPERTS_HINT = (
    " (a mixture of experts: pass expert_parallel=True to split the experts over the ranks, whole experts "
    "per rank, or replicate_experts=True to keep them whole on every rank; both exact)"
)


def is_experts_entry(key: str) -> bool:
    """Whether a transformers plan key names a mixture of experts' ``experts`` module or its parameters."""
    return re.search(r"(^|\.)experts(\.|$)", key) is not None


def experts_module_key(key: str) -> str:
    """The plan key of the ``experts`` module an experts entry names (``layers.*.mlp.experts.down_proj``
    -> ``layers.*.mlp.experts``)."""
    match = re.search(r"(^|\.)experts(\.|$)", key)
    assert match is not None, key
    return key[: match.end()].rstrip(".")


def cover_local_parameters(model: nn.Module, plan: Dict[str, ParallelStyle], wrap: Callable[[], ParallelStyle]) -> None:
    """Add ``wrap()`` to ``plan`` for scalar-parameter modules beside a sharded column; raise for others."""
    names = [n for n, _ in model.named_modules()]
    matched = {n for n in names if any(re.fullmatch(k, n) for k in plan)}
    sharded_parents = {
        n.rpartition(".")[0]
        for n in matched
        for k, style in plan.items()
        if re.fullmatch(k, n) and isinstance(style, ColumnParallel) and not style.gather_output
    }

    def covered(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in matched)

    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own or covered(name) or name.rpartition(".")[0] not in sharded_parents:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)) or linear_dims(module) is not None:
            continue  # a linear the plan leaves whole: its shapes no longer meet (an error when it runs)
        if all(p.numel() == 1 for _, p in own):
            plan[re.escape(name)] = wrap()
            continue
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own)
        raise ValueError(
            f"plan_from_transformers: {name!r} ({type(module).__name__}, parameters {shapes}) sits beside a "
            f"column-parallel linear of the plan, so it would run on this rank's slice of the features, and "
            f"the plan does not cover it; add a plan entry for it (tp_plan=...) or keep its parent replicated"
        )
