"""What a domain region does under ``torch.compile``, whose tracing the region guard does not run in.

A region that needed the guard in an eager call (routed ops, summed replicated gradients), or that no
eager call has run through and that is not plainly made of twins and parameter-free local modules
(:func:`plainly_local`), is refused at trace time: :func:`refuse_routed` / :func:`refuse_unchecked`
raise ``ValueError`` on every rank (under ``fullgraph=True`` Dynamo's error carries the same reason).
See docs/design.md (the region guard).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from tplayers.domain.tensor import _refuse_compiled
from tplayers.layers._common import RegionAware
from tplayers.ops.registry import GraphBreak

__all__ = ["plainly_local", "prepare_refusals", "refuse_routed", "refuse_unchecked"]

# modules whose forward is one op exact on local data, with no parameter: a region made of these and twins
# needs no guard, whether or not an eager call checked it
_LOCAL_MODULES = (
    nn.Sequential, nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Softsign,
    nn.LogSigmoid, nn.Tanhshrink,
)  # fmt: skip


def plainly_local(root: Optional[nn.Module]) -> bool:
    """Whether every module of ``root`` is a twin or one of :data:`_LOCAL_MODULES` (exactly that type)."""
    return root is not None and all(isinstance(m, RegionAware) or type(m) in _LOCAL_MODULES for m in root.modules())


_ROUTED = (
    "its eager calls route ops through the region guard (functional interpolation / pooling / reductions / "
    "attention on sharded data, or replicated gradients summed where they meet the shards), which "
    "torch.compile does not trace: run this region eagerly (compile only regions made of twins and local ops)"
)
_UNCHECKED = (
    "torch.compile traces it without the region guard, so nothing would check its ops on sharded data: run "
    "one eager call of the model first (the guard then knows whether the region needs it), then compile"
)


def _routed(name: str) -> None:
    raise ValueError(f"domain region {name}: {_ROUTED}")


def _unchecked(name: str) -> None:
    raise ValueError(f"domain region {name}: {_UNCHECKED}")


# Called from code being traced by torch.compile: run eagerly (a graph break), so the ValueError reaches
# the caller instead of sending the traced frame back to eager; under fullgraph=True, Dynamo's error
# names the reason. Built when a region scope is made (prepare_refusals), not at import.
refuse_routed = GraphBreak(_routed, f"tplayers domain region: {_ROUTED}")
refuse_unchecked = GraphBreak(_unchecked, f"tplayers domain region: {_UNCHECKED}")


def prepare_refusals() -> None:
    """Build the trace-time refusals' graph breaks now, eagerly (importing Dynamo): a region calls this
    when it is made, so that a ``fullgraph=True`` error names the refusal's reason."""
    for refusal in (refuse_routed, refuse_unchecked, _refuse_compiled):
        refusal.prepare()
