"""Plan styles for the pieces between tensor-parallel linears: sequence-parallel norms and dropout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from tplayers.layers.dropout import ParallelDropout
from tplayers.layers.replicated import DomainReplicated
from tplayers.parallelize.styles import ParallelStyle

__all__ = ["SequenceParallel", "ShardedDropout"]

_NORMS = (nn.LayerNorm, nn.RMSNorm)


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Sequence parallelism for the per-token modules between a sequence-parallel
    ``RowParallel`` and the next ``ColumnParallel`` (Megatron-LM's SP; DESIGN §2.8).

    - ``nn.LayerNorm`` / ``nn.RMSNorm``: runs on this rank's tokens with replicated
      parameters whose gradients are summed over the tensor-parallel group (one all-reduce
      of the norm's gradients in backward; :class:`~tplayers.DomainReplicated`);
      ``state_dict`` keys unchanged.
    - ``nn.Dropout``: :class:`~tplayers.ParallelDropout` along ``sequence_dim``, drawing
      exactly this rank's slice of the serial mask.

    Example (``torchrun --nproc-per-node 2``; ``S = 7`` need not divide the world size)::

        import torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Dropout(0.1))
        plan = {"0": tplayers.SequenceParallel(), "1": tplayers.ColumnParallel(sequence_parallel=True),
                "3": tplayers.RowParallel(sequence_parallel=True), "4": tplayers.SequenceParallel()}
        model = tplayers.parallelize_module(model, plan, mesh=mesh)
        y = model(tplayers.shard(torch.randn(2, 7, 16), 1))    # (2, S_local, 16) in and out

    (A GPT-2 plan: ``docs/tensor-parallel.md``, "Sequence parallelism".)
    """

    sequence_dim: int = 1
    accepts = _NORMS + (nn.Dropout,)

    def build(self, name, module, mesh):
        if isinstance(module, nn.Dropout):
            return ParallelDropout.from_module(module, mesh=mesh, dim=self.sequence_dim)
        return DomainReplicated(module, mesh)


@dataclass(frozen=True)
class ShardedDropout(ParallelStyle):
    """Swap an ``nn.Dropout`` that sees a tensor-sharded activation for
    :class:`~tplayers.ParallelDropout` along ``dim``: each rank draws exactly its slice of
    the serial mask. ``full_size``: the serial length of ``dim`` when fixed (e.g. the
    heads of an attention-probability dropout, or the features after a ``ColumnParallel``),
    else it is exchanged per call.

    Example (dropout on the hidden features after a column-parallel ``fc1``)::

        import torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                   # the same seed on every rank
        model = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Dropout(0.2), nn.Linear(30, 8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.ShardedDropout(dim=-1, full_size=30),
                "3": tplayers.RowParallel()}
        model = tplayers.parallelize_module(model, plan, mesh=mesh)
        y = model(torch.randn(4, 8))                           # the serial model's dropout mask

    On attention probabilities ``(B, heads_local, S, S)``: ``ShardedDropout(dim=1, full_size=heads)``.
    Dropout on *replicated* activations needs no style: ``nn.Dropout`` draws the same mask
    on every rank when every rank is seeded alike.
    """

    dim: int = -1
    full_size: Optional[int] = None
    accepts = (nn.Dropout,)

    def build(self, name, module, mesh):
        return ParallelDropout.from_module(module, mesh=mesh, dim=self.dim, full_size=self.full_size)
