"""The shared base of the tensor-parallel linears: parameters laid out as one shard of the serial
``nn.Linear`` (initialised as its slice under the same seed), the sequence-parallel argument
checks, and ``shard_specs`` for checkpoints. :mod:`tplayers.layers.linear` builds
``ColumnParallelLinear`` and ``RowParallelLinear`` on it.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._common import ShardedModule, init_shards_like_serial
from tplayers.sharding import ShardSpec, shard_sizes

__all__ = ["ParallelLinearBase", "check_sequence_args", "check_sequence_dim"]


def _linear_weight_init(full: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(full, a=math.sqrt(5))  # nn.Linear.reset_parameters, verbatim


def _linear_bias_init(fan_in: int):
    def init(full: torch.Tensor) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(full, -bound, bound)
    return init


def check_sequence_args(layer: str, sequence_parallel, sequence_dim) -> None:
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{layer}: sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise TypeError(f"{layer}: sequence_dim must be an int, got {type(sequence_dim).__name__}")


def check_sequence_dim(x: torch.Tensor, dim: int, layer: str) -> int:
    """``dim`` normalised for ``x``; ``ValueError`` if it is out of range or the feature dim."""
    if not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1:
        raise ValueError(f"{layer}: sequence_dim={dim} must name a dim of the input other than the last "
                         f"(features), got an input of shape {tuple(x.shape)}")
    return dim % x.dim()


class ParallelLinearBase(ShardedModule):
    """Common construction of the two tensor-parallel linears."""

    #: which dim of ``weight`` (out, in) is sharded: 0 for Column, 1 for Row
    _weight_dim: int = 0

    def __init__(self, in_features, out_features, bias, mesh, device, dtype) -> None:
        super().__init__()
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {arg} must be a positive int, got {value!r}")
        mesh = self._bind_mesh(mesh)
        self._group = mesh.get_group(0)
        self.tp_rank = mesh.get_local_rank(0)
        self.tp_size = mesh.size(0)
        self.in_features = in_features
        self.out_features = out_features
        self._setup_layout()
        specs = self._specs(bias)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(specs["weight"].local_shape, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(specs["bias"].local_shape, **kw))
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _setup_layout(self) -> None:
        """Validate and store layout options (fused sections, heads) before any tensor is made."""

    def _specs(self, bias: bool) -> Dict[str, ShardSpec]:
        size, rank = self.tp_size, self.tp_rank
        specs = {"weight": ShardSpec.balanced((self.out_features, self.in_features), self._weight_dim, size, rank)}
        if bias:
            bias_dim = 0 if self._weight_dim == 0 else None
            specs["bias"] = ShardSpec.balanced((self.out_features,), bias_dim, size, rank)
        return specs

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """``{"weight": ShardSpec, "bias": ShardSpec}``: global shapes and this rank's slice."""
        return self._specs(self.bias is not None)

    @property
    def partition_sizes(self) -> list:
        """Per-rank sizes of the sharded feature dim (this rank's local width on each rank)."""
        n = self.out_features if self._weight_dim == 0 else self.in_features
        return shard_sizes(n, self.tp_size)

    def reset_parameters(self) -> None:
        """Initialise this rank's shards as exactly its slice of a serial ``nn.Linear``.

        The full ``(out_features, in_features)`` weight and ``(out_features,)``
        bias are drawn with ``nn.Linear.reset_parameters``' exact calls and RNG
        sequence, on this layer's device and dtype, and this rank keeps its slice
        (Row's replicated bias: the whole of it). So under ``torch.manual_seed(s)``
        on every rank, a model built from these layers is the serial model built
        under the same seed, shard for shard, and the generator ends in the same
        state as after the serial layer (later layers match too).

        Cost: every rank draws the full weight once (the serial layer's memory
        and RNG time, freed right after); ``device="meta"`` skips it. Ranks seeded
        differently get slices of different draws: then Row's replicated bias
        differs across ranks. Seed every rank alike, or build the serial model and
        use :func:`~tplayers.parallelize_module` (``src_rank=0``) instead.
        """
        init_shards_like_serial(self, {"weight": _linear_weight_init, "bias": _linear_bias_init(self.in_features)})

    @classmethod
    def from_module(cls, dense: nn.Linear, *, mesh: Optional[DeviceMesh] = None, **options):
        """Build the parallel twin of ``dense`` holding exactly this rank's slice of it.

        ``options`` are the layer's own keywords (``gather_output``,
        ``sections``, ``head_dim`` or ``input_is_parallel``). Build optimizers after swapping: the new
        parameters are new objects.
        """
        if not isinstance(dense, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_module expects an nn.Linear, got {type(dense).__name__}")
        layer = cls(
            dense.in_features,
            dense.out_features,
            bias=dense.bias is not None,
            mesh=mesh,
            device="meta",
            dtype=dense.weight.dtype,
            **options,
        )
        layer = layer.to_empty(device=dense.weight.device)
        layer._copy_shards_from(dense)
        return layer

    def _local_repr(self) -> str:
        w = tuple(self.weight.shape)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, local_weight={w}, rank={self.tp_rank}/{self.tp_size}"
        )
