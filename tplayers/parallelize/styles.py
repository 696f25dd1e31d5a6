"""Plan styles: the base class and the tensor-parallel styles (Megatron column / row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelStyle", "ColumnParallel", "RowParallel", "PartitionFn", "PlanKey", "key_repr"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], nn.Module]
PlanKey = Union[str, type]


def key_repr(key: PlanKey) -> str:
    return key.__name__ if isinstance(key, type) else f"'{key}'"



class ParallelStyle:
    """A rule that turns one serial module into its distributed twin.

    Subclasses set :attr:`accepts` (the module types they can handle) and
    implement :meth:`build`.
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


@dataclass(frozen=True)
class ColumnParallel(ParallelStyle):
    """Swap an ``nn.Linear`` for :class:`~tplayers.ColumnParallelLinear` (output features split).

    ``sequence_parallel=True``: the input is sequence-sharded along ``sequence_dim`` and
    all-gathered (see :class:`SequenceParallel` for the norms and dropout between).

    Example::

        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        model = tplayers.parallelize_module(model, {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()})
    """

    gather_output: bool = False
    sequence_parallel: bool = False
    sequence_dim: int = 1
    accepts = (nn.Linear,)

    def build(self, name, module, mesh):
        return ColumnParallelLinear.from_module(module, mesh=mesh, gather_output=self.gather_output,
                                                sequence_parallel=self.sequence_parallel, sequence_dim=self.sequence_dim)


@dataclass(frozen=True)
class RowParallel(ParallelStyle):
    """Swap an ``nn.Linear`` for :class:`~tplayers.RowParallelLinear` (input features split).

    ``sequence_parallel=True``: the output is reduce-scattered along ``sequence_dim``.

    ``input_is_parallel=False`` makes the swapped layer take the full input and
    split it locally (a drop-in for an ``nn.Linear`` anywhere in a model)::

        head = tplayers.parallelize_module(nn.Linear(64, 10), {"": tplayers.RowParallel(input_is_parallel=False)})
    """

    input_is_parallel: bool = True
    sequence_parallel: bool = False
    sequence_dim: int = 1
    accepts = (nn.Linear,)

    def build(self, name, module, mesh):
        return RowParallelLinear.from_module(module, mesh=mesh, input_is_parallel=self.input_is_parallel,
                                             sequence_parallel=self.sequence_parallel, sequence_dim=self.sequence_dim)


