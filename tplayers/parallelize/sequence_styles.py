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
    ``RowParallel`` and the next ``ColumnParallel`` (Megatron-LM's SP; docs/design.md (tensor-parallel linears)).

    - ``nn.LayerNorm`` / ``nn.RMSNorm``: runs on this rank's tokens with replicated
      parameters whose gradients are summed over the tensor-parallel group (one all-reduce
      of the norm's gradients in backward; :class:`~tplayers.DomainReplicated`);
      ``state_dict`` keys unchanged.
    - ``nn.Dropout``: :class:`~tplayers.ParallelDropout` along ``sequence_dim``, drawing
      exactly this rank's slice of the serial mask.

    Args:
        sequence_dim: the sharded sequence dim of the activations (1 for ``(B, S, H)``).

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`) a matched module that is not a
            ``LayerNorm``, ``RMSNorm`` or ``Dropout``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``; ``S = 7`` need not divide the
    world size)::

        import copy, torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Dropout(0.1))
        plan = {"0": tplayers.SequenceParallel(), "1": tplayers.ColumnParallel(sequence_parallel=True),
                "3": tplayers.RowParallel(sequence_parallel=True), "4": tplayers.SequenceParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        x = torch.randn(2, 7, 16)
        torch.manual_seed(1)
        y = model(tplayers.shard(x, 1, mesh))             # (2, S_local, 16) in and out
        torch.manual_seed(1)                              # the serial model's dropout mask, sliced
        torch.testing.assert_close(tplayers.gather(y, 1, mesh), serial(x))

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

    Args:
        dim: the sharded dim of the dropout's input.
        full_size: its serial length, or ``None`` (exchanged per call).

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`) a matched module that is not an
            ``nn.Dropout``, or an in-place one.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``; dropout on the hidden features
    after a column-parallel ``fc1``)::

        import copy, torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                   # the same seed on every rank
        serial = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Dropout(0.2), nn.Linear(30, 8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.ShardedDropout(dim=-1, full_size=30),
                "3": tplayers.RowParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        x = torch.randn(4, 8)
        torch.manual_seed(1)
        y = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(y, serial(x))               # the serial model's dropout mask

    On attention probabilities ``(B, heads_local, S, S)``: ``ShardedDropout(dim=1, full_size=heads)``.
    Dropout on *replicated* activations needs no style: ``nn.Dropout`` draws the same mask
    on every rank when every rank is seeded alike.
    """

    dim: int = -1
    full_size: Optional[int] = None
    accepts = (nn.Dropout,)

    def build(self, name, module, mesh):
        return ParallelDropout.from_module(module, mesh=mesh, dim=self.dim, full_size=self.full_size)
