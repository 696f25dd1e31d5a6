"""Tensor-parallel linear layers with Megatron semantics and uneven feature counts.

``ColumnParallelLinear`` splits the output features over a 1-D mesh axis,
``RowParallelLinear`` the input features. A Column -> Row pair computes an MLP
with one all-reduce forward (after Row) and one backward (before Column).
Feature counts need not divide the world size: shard sizes follow
:func:`tplayers.shard_sizes` (the first ``n % world`` ranks get one more).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import (
    gather_along_dim,
    split_along_dim,
)
from tplayers.comm.fused import linear_all_reduce_input_grad, linear_all_reduce_output
from tplayers.layers._common import ShardedModule, autocast_inputs, check_features, check_reduce_dtype
from tplayers.sharding import ShardSpec, shard_sizes

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class _ParallelLinear(ShardedModule):
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
        specs = self._specs(bias)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(specs["weight"].local_shape, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(specs["bias"].local_shape, **kw))
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

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
        """Per-rank sizes of the sharded feature dim."""
        n = self.out_features if self._weight_dim == 0 else self.in_features
        return shard_sizes(n, self.tp_size)

    def reset_parameters(self) -> None:
        """Initialise this rank's shard with ``nn.Linear``'s distribution (bound 1/sqrt(in_features)).

        The values differ from a serial ``nn.Linear`` with the same seed; use
        ``from_module`` to shard an existing layer exactly.
        """
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self._init_bias(bound)

    def _init_bias(self, bound: float) -> None:
        self.bias.uniform_(-bound, bound)

    @classmethod
    def from_module(cls, dense: nn.Linear, *, mesh: Optional[DeviceMesh] = None, **options):
        """Build the parallel twin of ``dense`` holding exactly this rank's slice of it.

        ``options`` are the layer's own keywords (``gather_output`` or
        ``input_is_parallel``). Build optimizers after swapping: the new
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


class ColumnParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A``'s output features split over a 1-D mesh axis.

    Shapes (``out_local`` = this rank's share of ``out_features``):

    - ``weight``: ``(out_local, in_features)``, ``bias``: ``(out_local,)``
    - input: ``(..., in_features)``, replicated on every rank
    - output: ``(..., out_local)``, or ``(..., out_features)`` with ``gather_output=True``

    Forward issues nothing (or one all-gather with ``gather_output=True``);
    backward all-reduces the input gradient.

    Under ``torch.autocast`` it computes (and communicates) in the autocast dtype, as
    ``nn.Linear`` does; ``reduce_dtype=torch.float32`` all-reduces the gradient in fp32
    instead (one rounding after the sum).

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        dense = torch.nn.Linear(16, 30)
        col = tplayers.ColumnParallelLinear.from_module(dense, mesh=mesh, gather_output=True)
        x = torch.randn(4, 16)
        torch.testing.assert_close(col(x), dense(x))
    """

    _weight_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mesh: Optional[DeviceMesh] = None,
        gather_output: bool = False,
        device=None,
        dtype=None,
        reduce_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.gather_output = bool(gather_output)
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, type(self).__name__)
        super().__init__(in_features, out_features, bias, mesh, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)  # as F.linear under torch.autocast
        check_features(x, self.in_features, weight, "input", type(self).__name__)
        if self.tp_size == 1:
            y = F.linear(x, weight, bias)  # (..., out)
        else:
            # (..., in) replicated -> (..., out_local); backward all-reduces the input gradient,
            # overlapped with the weight-gradient matmul (CopyToParallelRegion fused with F.linear).
            y = linear_all_reduce_input_grad(x, weight, bias, self._group, self.reduce_dtype)
        if self.gather_output:
            y = gather_along_dim(y, -1, self._group, self.partition_sizes)  # (..., out)
        return y

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        if self.tp_size == 1:
            return [], []
        return (["all_gather"] if self.gather_output else []), ["all_reduce"]

    def extra_repr(self) -> str:
        return self._local_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A``'s input features split over a 1-D mesh axis.

    Shapes (``in_local`` = this rank's share of ``in_features``):

    - ``weight``: ``(out_features, in_local)``; ``bias``: ``(out_features,)``
      replicated, added exactly once (rank 0 folds it into its matmul before the
      all-reduce; initialised to zeros)
    - input: ``(..., in_local)``, or ``(..., in_features)`` with
      ``input_is_parallel=False`` (then split locally)
    - output: ``(..., out_features)``, replicated

    Forward all-reduces the partial products; backward issues nothing (or one
    all-gather of the input gradient with ``input_is_parallel=False``).

    Under ``torch.autocast`` it computes (and communicates) in the autocast dtype, as
    ``nn.Linear`` does; ``reduce_dtype=torch.float32`` sums the partial products in fp32
    (one rounding after the sum instead of one per addition).

    Example::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        dense = torch.nn.Linear(30, 16)
        row = tplayers.RowParallelLinear.from_module(dense, mesh=mesh, input_is_parallel=False)
        x = torch.randn(4, 30)
        torch.testing.assert_close(row(x), dense(x))
    """

    _weight_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mesh: Optional[DeviceMesh] = None,
        input_is_parallel: bool = True,
        device=None,
        dtype=None,
        reduce_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.input_is_parallel = bool(input_is_parallel)
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, type(self).__name__)
        super().__init__(in_features, out_features, bias, mesh, device, dtype)

    def _init_bias(self, bound: float) -> None:
        # Replicated: zeros keep every rank identical without communication.
        self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)  # as F.linear under torch.autocast
        if self.input_is_parallel:
            check_features(x, weight.shape[1], weight, "input (this rank's in_features shard)", name)
        else:
            check_features(x, self.in_features, weight, "input", name)
            x = split_along_dim(x, -1, self._group)  # (..., in_local); bwd all-gather
        if self.tp_size == 1:
            return F.linear(x, weight, bias)  # (..., out)
        # (..., in_local) -> partial products, summed by one all-reduce -> (..., out) replicated;
        # the bias is added once (folded into rank 0's matmul). Backward: no communication.
        return linear_all_reduce_output(x, weight, bias, self._group, self.reduce_dtype)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        if self.tp_size == 1:
            return [], []
        return ["all_reduce"], ([] if self.input_is_parallel else ["all_gather"])

    def extra_repr(self) -> str:
        return self._local_repr() + f", input_is_parallel={self.input_is_parallel}"
