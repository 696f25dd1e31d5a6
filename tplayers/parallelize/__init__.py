"""Plans: swap ordinary ``nn`` layers for their distributed twins.

A plan is data: ``{key: value}``. A key is a regex matched with
``re.fullmatch`` against each module's dotted name (``""`` is the root), or an
``nn.Module`` subclass matching by type. A value is a style
(:class:`ColumnParallel`, :class:`RowParallel`, :class:`DomainParallel`) or a partition function
``fn(name, module, mesh) -> nn.Module``. :func:`parallelize_module` applies it;
:func:`explain` shows what it would do without changing anything.

Example (a Megatron MLP; run under ``torchrun`` or plain ``python``)::

    import torch, tplayers
    from torch import nn
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
    print(tplayers.explain(model, plan))
    model = tplayers.parallelize_module(model, plan)
    opt = torch.optim.AdamW(model.parameters())   # build optimizers AFTER swapping
"""

from tplayers.parallelize.domain_styles import DomainParallel
from tplayers.parallelize.engine import parallelize_module
from tplayers.parallelize.expert_styles import ExpertParallel
from tplayers.parallelize.explain import Explanation, explain
from tplayers.parallelize.hf import ReplicatedGradSum, causal_lm_loss, plan_from_transformers
from tplayers.parallelize.sequence_styles import SequenceParallel, ShardedDropout
from tplayers.parallelize.styles import ColumnParallel, ParallelStyle, RowParallel

__all__ = [
    "ParallelStyle",
    "ColumnParallel",
    "RowParallel",
    "DomainParallel",
    "ExpertParallel",
    "SequenceParallel",
    "ShardedDropout",
    "parallelize_module",
    "explain",
    "Explanation",
    "plan_from_transformers",
    "ReplicatedGradSum",
    "causal_lm_loss",
]
