"""Sequence parallelism for transformers' attention modules.

A transformers attention ``forward`` reads the sequence length from its input
(``input_shape = hidden_states.shape[:-1]``) before its projections, so the
projections cannot all-gather the sequence themselves (Megatron's fused
all-gather + matmul): the attention must see the whole sequence. Here it does:
:class:`SequenceGathered` all-gathers the attention's input along the sequence,
the q/k/v projections are ordinary column-parallel linears (their input-gradient
all-reduce makes the gradient of the gathered input whole on every rank, so the
gather's adjoint is this rank's slice), and the output projection
reduce-scatters back to this rank's tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import gather_along_dim
from tplayers.comm.sequence import sequence_sizes
from tplayers.layers._common import adopt_tensors
from tplayers.layers._copy import MeshBound
from tplayers.mesh import resolve_mesh
from tplayers.parallelize.styles import ParallelStyle, key_repr

__all__ = [
    "add_sequence_parallel_modules",
    "SequenceGathered",
    "SequenceGatheredAttention",
    "check_sequence_parallel_style",
    "check_sequence_parallel_model",
]


class SequenceGathered(MeshBound, nn.Module):
    """Run ``module`` on the whole sequence from this rank's shard of it.

    forward: the first argument, ``(B, S_local, H)`` (this rank's balanced shard of the
    sequence dim ``sequence_dim``), is all-gathered to ``(B, S, H)`` (after one exchange of
    the per-rank lengths) / backward: this rank's slice of the gradient, which must be
    replicated (the module's first ops are column-parallel linears, whose backward all-reduces
    it). Other arguments pass through unchanged. ``module``'s children and own tensors are
    registered here under their own names, so ``state_dict`` keys do not change.

    Example (the attention of a transformers decoder layer; ``plan_from_transformers`` builds it)::

        attn = tplayers.parallelize.hf_sequence.SequenceGathered(layer.self_attn, mesh)
    """

    def __init__(self, module: nn.Module, mesh: Optional[DeviceMesh] = None, sequence_dim: int = 1) -> None:
        super().__init__()
        self.mesh = resolve_mesh(mesh, 1)
        self._group = self.mesh.get_group(0)
        self.sequence_dim = sequence_dim
        self._wrapped = (module,)  # a tuple: not a registered child, so no extra key prefix
        adopt_tensors(self, module)
        for name, child in module.named_children():
            self.add_module(name, child)

    @property
    def module(self) -> nn.Module:
        return self._wrapped[0]

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        name = type(self.module).__name__
        dim = self.sequence_dim % hidden_states.dim()
        sizes = sequence_sizes(hidden_states.size(dim), self._group, f"SequenceGathered({name})")
        full = gather_along_dim(hidden_states, dim, self._group, sizes)  # (B, S, H); backward: my slice
        return self.module(full, *args, **kwargs)

    def collectives(self):
        """Collectives per step of the gather itself: ``(forward list, backward list)``."""
        return ["all_gather (sizes)", "all_gather"], []


@dataclass(frozen=True)
class SequenceGatheredAttention(ParallelStyle):
    """A transformers attention module under sequence parallelism: its projections swapped by
    ``children`` (``{child name: style}``; q/k/v column-parallel without sequence parallelism,
    the output projection ``RowParallel(sequence_parallel=True)``), the whole wrapped in
    :class:`SequenceGathered`. ``finalize`` runs each child style's ``finalize`` (head counts).
    """

    children: Dict[str, ParallelStyle] = field(default_factory=dict)
    sequence_dim: int = 1
    accepts = (nn.Module,)

    def check(self, key, name, module):
        kids = dict(module.named_children())
        for child, style in self.children.items():
            if child not in kids:
                raise ValueError(
                    f"plan key {key_repr(key)}: SequenceGatheredAttention expects a child {child!r} of "
                    f"{name!r} ({type(module).__name__}); it has {sorted(kids)}"
                )
            style.check(key, f"{name}.{child}", kids[child])

    def build(self, name, module, mesh):
        twins = {
            child: style.build(f"{name}.{child}", getattr(module, child), mesh)
            for child, style in self.children.items()
        }
        for child, twin in twins.items():  # undone by parallelize_module if the plan fails later
            setattr(module, child, twin)
        return SequenceGathered(module, mesh, self.sequence_dim)

    def finalize(self, model, mesh):
        for style in {id(s): s for s in self.children.values()}.values():
            model = style.finalize(model, mesh)
        return model

    def __hash__(self):  # a dict field: hash by identity
        return id(self)


def check_sequence_parallel_style(key: str, style: str) -> None:
    """``ValueError`` for a transformers style that works on the whole sequence (a gathered output
    or a locally split input, Phi3's attention and MLP) under ``sequence_parallel=True``."""
    if style in ("colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep"):
        raise ValueError(
            f"plan_from_transformers: sequence_parallel=True is not supported with style {style!r} of tp_plan "
            f"key {key!r} (a gathered output or a locally split input works on the whole sequence); "
            "use sequence_parallel=False for this model"
        )


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def check_sequence_parallel_model(model: nn.Module, config) -> None:
    """``ValueError`` (before anything changes) for a model that sequence parallelism would break:
    attention other than SDPA (eager builds its mask from this rank's tokens only, a crash), or
    absolute position embeddings (GPT-2's ``wpe``: looked up from this rank's token count, so
    either a crash with full ``position_ids`` or silently wrong positions without them)."""
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(
            f"plan_from_transformers: sequence_parallel=True needs config._attn_implementation='sdpa' (the "
            f"attention masks are built from this rank's tokens otherwise), got {impl!r}"
        )
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rpartition(".")[2] in _POSITION_TABLES:
            raise ValueError(
                f"plan_from_transformers: sequence_parallel=True is not supported with absolute position "
                f"embeddings ({name!r}, {type(module).__name__}({module.num_embeddings}, {module.embedding_dim})): "
                f"the model would look up positions for this rank's tokens only"
            )


def add_sequence_parallel_modules(
    model: nn.Module, plan: Dict[str, ParallelStyle], wrap: Callable[[], ParallelStyle]
) -> None:
    """Add ``wrap()`` for the residual stream's modules with parameters (norms) between the swapped linears."""
    swapped = [n for n, _ in model.named_modules() if any(re.fullmatch(k, n) for k in plan)]

    def inside(name):
        return any(name == s or name.startswith(s + ".") or s.startswith(name + ".") or s == "" for s in swapped)

    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ValueError(
                f"plan_from_transformers: sequence_parallel=True: {name!r} is nn.Dropout(p={module.p}) "
                "and would draw another mask on the sequence shards; set its p to 0"
            )
        own = list(module.named_parameters(recurse=False))
        if own and not inside(name) and not any(True for _ in module.children()):
            plan[re.escape(name)] = wrap()
