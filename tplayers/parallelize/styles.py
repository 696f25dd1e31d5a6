"""Plan styles: the base class and the tensor-parallel styles (Megatron column / row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._linear_base import transposed_linear_dims
from tplayers.layers.embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from tplayers.layers.linear import ColumnParallelLinear, RowParallelLinear
from tplayers.layers.replicated import DomainReplicated
from tplayers.parallelize.subclasses import check_no_forward_override, embedding_scale

__all__ = ["ParallelStyle", "ColumnParallel", "RowParallel", "ReplicatedGradSum", "PartitionFn", "PlanKey", "key_repr"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], nn.Module]
PlanKey = Union[str, type]


def key_repr(key: PlanKey) -> str:
    return key.__name__ if isinstance(key, type) else f"'{key}'"


class ParallelStyle:
    """A rule that turns one serial module into its distributed twin (a plan's value).

    Subclasses set :attr:`accepts` (the module types they can handle) and implement
    :meth:`build` ``(name, module, mesh) -> nn.Module``; :meth:`check` (called for every match
    before anything changes) raises ``ValueError`` for a module of another type, and
    :meth:`finalize` runs once per style after every swap. :func:`tplayers.parallelize_module`
    calls them; a plain function ``fn(name, module, mesh)`` is the lighter alternative.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        class Frozen(tplayers.ParallelStyle):             # a style of your own: freeze the match
            accepts = (torch.nn.Linear,)
            def build(self, name, module, mesh):
                return module.requires_grad_(False)
        model = tplayers.parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"0": Frozen()})
        assert not model[0].weight.requires_grad
    """

    accepts: Tuple[type, ...] = ()

    def build(self, name: str, module: nn.Module, mesh: DeviceMesh) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def finalize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Called once per style after every swap of the plan; returns the (possibly new) model."""
        return model

    def check(self, key: PlanKey, name: str, module: nn.Module) -> None:
        """Raise ``ValueError`` if this style cannot handle ``module``."""
        if not isinstance(module, self.accepts):
            want = " or ".join(t.__name__ for t in self.accepts)
            raise ValueError(
                f"plan key {key_repr(key)}: {type(self).__name__} expects {want}, but module "
                f"{name or '<root>'!r} is {type(module).__name__}"
            )


def _check_role(key: PlanKey, style: "ParallelStyle", roles: Tuple[str, ...]) -> None:
    if style.head_role is not None and style.head_role not in roles:
        raise ValueError(
            f"plan key {key_repr(key)}: {type(style).__name__}(head_role=...) must be one of "
            f"{', '.join(map(repr, roles))} or None, got {style.head_role!r}"
        )


def _check_linear_or_embedding(style: ParallelStyle, key, name: str, module: nn.Module) -> None:
    """``ValueError`` unless ``module`` is an ``nn.Linear``, an ``nn.Embedding`` or a Conv1D-like linear."""
    if isinstance(module, style.accepts) or transposed_linear_dims(module) is not None:
        check_no_forward_override(key_repr(key), type(style).__name__, name, module)
        return
    raise ValueError(
        f"plan key {key_repr(key)}: {type(style).__name__} expects Linear or Embedding (or a Conv1D-like "
        f"linear: weight (in, out) and nf), but module {name or '<root>'!r} is {type(module).__name__}"
    )


@dataclass(frozen=True)
class ColumnParallel(ParallelStyle):
    r"""Swap an ``nn.Linear`` for :class:`~tplayers.ColumnParallelLinear` (output features split),
    or an ``nn.Embedding`` for :class:`~tplayers.ColumnParallelEmbedding` (embedding dim split).
    A transformers ``Conv1D`` (a linear stored ``(in, out)``) is a linear here: its twin keeps
    the ``(in, out)`` storage (``transposed=True``).

    ``sections`` / ``head_dim``: fused blocks and whole heads (see ColumnParallelLinear),
    linears only. ``sequence_parallel=True``: the input is sequence-sharded along
    ``sequence_dim`` and all-gathered (see :class:`SequenceParallel` for the norms and
    dropout between).

    ``head_role`` (``"q"``, ``"k"`` or ``"v"``): this linear is that projection of an
    attention whose q / k / v / o are separate linears; siblings under one parent are then
    checked together (query heads with their key/value heads on every rank, whole heads;
    see :mod:`tplayers.parallelize.attention_groups`). Modules named ``q_proj``, ``k_proj``,
    ``v_proj``, ``query``, ``wq``, ... are read as such without it.

    Args:
        gather_output, sections, head_dim, sequence_parallel, sequence_dim: the twin's keywords
            (:class:`~tplayers.ColumnParallelLinear`; an embedding takes ``gather_output`` only).
            GPT-2's fused attention: ``ColumnParallel(sections=(d, d, d), head_dim=d // n_head)``
            on ``r"h\.\d+\.attn\.c_attn"``.
        head_role: ``"q"``, ``"k"``, ``"v"`` or ``None`` (above).

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`, before anything changes) a
            matched module that is not a linear or an embedding, linear-only options on an
            embedding, a bad ``head_role``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        model = tplayers.parallelize_module(copy.deepcopy(serial), plan)
        assert isinstance(model[0], tplayers.ColumnParallelLinear)
        x = torch.randn(4, 8)
        torch.testing.assert_close(model(x), serial(x))
    """

    gather_output: bool = False
    sections: Optional[Tuple[int, ...]] = None
    head_dim: Optional[int] = None
    sequence_parallel: bool = False
    sequence_dim: int = 1
    head_role: Optional[str] = None
    accepts = (nn.Linear, nn.Embedding)

    def check(self, key, name, module):
        _check_linear_or_embedding(self, key, name, module)
        _check_role(key, self, ("q", "k", "v"))
        if isinstance(module, nn.Embedding) and (
            self.sections is not None
            or self.head_dim is not None
            or self.sequence_parallel
            or self.head_role is not None
        ):
            raise ValueError(
                f"plan key {key_repr(key)}: ColumnParallel(sections=, head_dim=, sequence_parallel=, "
                f"head_role=) applies to nn.Linear, but module {name!r} is nn.Embedding"
            )

    def build(self, name, module, mesh):
        if isinstance(module, nn.Embedding):
            twin = ColumnParallelEmbedding.from_module(module, mesh=mesh, gather_output=self.gather_output)
            return twin.scale_output(embedding_scale(module))
        return ColumnParallelLinear.from_module(
            module,
            mesh=mesh,
            gather_output=self.gather_output,
            sections=self.sections,
            head_dim=self.head_dim,
            sequence_parallel=self.sequence_parallel,
            sequence_dim=self.sequence_dim,
        )


@dataclass(frozen=True)
class RowParallel(ParallelStyle):
    """Swap an ``nn.Linear`` (or a transformers ``Conv1D``, kept ``(in, out)``) for
    :class:`~tplayers.RowParallelLinear` (input features split), or an ``nn.Embedding`` for
    :class:`~tplayers.VocabParallelEmbedding` (rows of the table split).

    ``sequence_parallel=True``: the output is reduce-scattered along ``sequence_dim`` (on an
    embedding too: its output is then this rank's sequence shard).

    ``input_is_parallel=False`` makes the swapped linear take the full input and
    split it locally (a drop-in for an ``nn.Linear`` anywhere in a model);
    ``head_dim`` splits its input in whole heads (an attention output projection);
    ``head_role="o"`` marks it as the output projection of separate q / k / v linears
    (read from names such as ``o_proj``, ``out_proj``, ``wo`` without it), checked to read
    exactly each rank's query heads. A tied ``lm_head`` stays tied with
    ``{"wte": RowParallel(), "lm_head": ColumnParallel()}`` (one Parameter).

    Args:
        input_is_parallel, head_dim, sequence_parallel, sequence_dim: the twin's keywords
            (:class:`~tplayers.RowParallelLinear`; an embedding takes the sequence ones only).
        head_role: ``"o"`` or ``None`` (above).

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`, before anything changes) a
            matched module that is not a linear or an embedding, linear-only options on an
            embedding, a bad ``head_role``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        torch.manual_seed(0)
        serial = nn.Linear(64, 10)
        head = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.RowParallel(input_is_parallel=False)})
        x = torch.randn(4, 64)                            # full input, split locally
        torch.testing.assert_close(head(x), serial(x))
    """

    input_is_parallel: bool = True
    head_dim: Optional[int] = None
    sequence_parallel: bool = False
    sequence_dim: int = 1
    head_role: Optional[str] = None
    accepts = (nn.Linear, nn.Embedding)

    def check(self, key, name, module):
        _check_linear_or_embedding(self, key, name, module)
        _check_role(key, self, ("o",))
        if isinstance(module, nn.Embedding) and (
            self.head_dim is not None or not self.input_is_parallel or self.head_role is not None
        ):
            raise ValueError(
                f"plan key {key_repr(key)}: RowParallel(head_dim=, input_is_parallel=, head_role=) "
                f"applies to nn.Linear, but module {name!r} is nn.Embedding"
            )

    def build(self, name, module, mesh):
        if isinstance(module, nn.Embedding):
            twin = VocabParallelEmbedding.from_module(
                module, mesh=mesh, sequence_parallel=self.sequence_parallel, sequence_dim=self.sequence_dim
            )
            return twin.scale_output(embedding_scale(module))  # Gemma's scaled embedding keeps its scale
        return RowParallelLinear.from_module(
            module,
            mesh=mesh,
            input_is_parallel=self.input_is_parallel,
            head_dim=self.head_dim,
            sequence_parallel=self.sequence_parallel,
            sequence_dim=self.sequence_dim,
        )


@dataclass(frozen=True)
class ReplicatedGradSum(ParallelStyle):
    """A module with replicated parameters whose gradients are summed over the mesh
    (:class:`~tplayers.DomainReplicated`): transformers' ``sequence_parallel`` (a norm on this
    rank's tokens) and ``replicated_with_grad_allreduce`` (a norm on this rank's heads).
    Any module whose parameters are all its own (an ``RMSNorm`` class of a model) qualifies,
    e.g. ``{r"model\\.layers\\.\\d+\\.input_layernorm": tplayers.ReplicatedGradSum()}``.

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`) a matched module whose children
            hold parameters.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = torch.nn.Sequential(torch.nn.LayerNorm(8))
        model = tplayers.parallelize_module(copy.deepcopy(serial), {"0": tplayers.ReplicatedGradSum()}, mesh=mesh)
        x = torch.randn(6, 8)
        model(tplayers.shard(x, 0, mesh)).sum().backward()   # this rank's tokens
        serial(x).sum().backward()
        torch.testing.assert_close(model[0].weight.grad, serial[0].weight.grad)   # summed over ranks
    """

    accepts = (nn.Module,)

    def check(self, key, name, module):
        if len(list(module.parameters())) != len(list(module.parameters(recurse=False))):
            raise ValueError(
                f"plan key {key_repr(key)}: ReplicatedGradSum wraps a module's own parameters, but "
                f"module {name!r} ({type(module).__name__}) has parameters in its children"
            )

    def build(self, name, module, mesh):
        return DomainReplicated(module, mesh)
