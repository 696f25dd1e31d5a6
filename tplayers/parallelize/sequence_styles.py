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

    Example (a GPT-2 block; ``S`` need not divide the world size)::

        plan = {
            r"h\\.\\d+\\.ln_\\d": tplayers.SequenceParallel(),
            r"h\\.\\d+\\.(attn\\.c_attn|mlp\\.c_fc)": tplayers.ColumnParallel(sequence_parallel=True),
            r"h\\.\\d+\\.(attn|mlp)\\.c_proj": tplayers.RowParallel(sequence_parallel=True),
            r"h\\.\\d+\\.(attn|mlp)\\.resid_dropout": tplayers.SequenceParallel(),
        }
        model = tplayers.parallelize_module(model, plan)
        y = model(tplayers.shard(x, 1))          # (B, S_local, H) in and out
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

    Example (dropout on attention probabilities ``(B, heads_local, S, S)``, 12 heads)::

        plan = {r"h\\.\\d+\\.attn\\.attn_dropout": tplayers.ShardedDropout(dim=1, full_size=12)}

    Dropout on *replicated* activations needs no style: ``nn.Dropout`` draws the same mask
    on every rank when every rank is seeded alike.
    """

    dim: int = -1
    full_size: Optional[int] = None
    accepts = (nn.Dropout,)

    def build(self, name, module, mesh):
        return ParallelDropout.from_module(module, mesh=mesh, dim=self.dim, full_size=self.full_size)
