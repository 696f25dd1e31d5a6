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
from tplayers.comm.fused import (
    all_gather_linear,
    linear_all_reduce_input_grad,
    linear_all_reduce_output,
    linear_reduce_scatter_output,
)
from tplayers.comm.sequence import sequence_sizes
from tplayers.layers._common import (
    ShardedModule,
    autocast_inputs,
    check_features,
    check_reduce_dtype,
    init_shards_like_serial,
)
from tplayers.sharding import ShardSpec, shard_sizes

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _linear_weight_init(full: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(full, a=math.sqrt(5))  # nn.Linear.reset_parameters, verbatim


def _linear_bias_init(fan_in: int):
    def init(full: torch.Tensor) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(full, -bound, bound)
    return init


def _check_sequence_args(layer: str, sequence_parallel, sequence_dim) -> None:
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{layer}: sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
        raise TypeError(f"{layer}: sequence_dim must be an int, got {type(sequence_dim).__name__}")


def _check_sequence_dim(x: torch.Tensor, dim: int, layer: str) -> int:
    """``dim`` normalised for ``x``; ``ValueError`` if it is out of range or the feature dim."""
    if not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1:
        raise ValueError(f"{layer}: sequence_dim={dim} must name a dim of the input other than the last "
                         f"(features), got an input of shape {tuple(x.shape)}")
    return dim % x.dim()


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

    Sequence parallelism (``sequence_parallel=True``): the input is this rank's
    shard of the sequence dim ``sequence_dim`` (default 1 for ``(B, S, H)``; the
    :func:`tplayers.shard_sizes` layout, uneven allowed), all-gathered before the
    matmul (one all-gather of the per-rank lengths first, one integer each); the
    output is ``(B, S, out_local)``. Backward reduce-scatters the input gradient
    instead of all-reducing it, overlapped with the weight gradient.

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
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device=None,
        dtype=None,
        reduce_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, type(self).__name__)
        _check_sequence_args(type(self).__name__, sequence_parallel, sequence_dim)
        self.gather_output = bool(gather_output)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        super().__init__(in_features, out_features, bias, mesh, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)  # as F.linear under torch.autocast
        check_features(x, self.in_features, weight, "input", name)
        if self.tp_size == 1:
            y = F.linear(x, weight, bias)  # (..., out)
        elif self.sequence_parallel:
            # (..., s_local, ..., in) sequence shard -> all-gather -> (..., s, ..., out_local);
            # backward reduce-scatters the input gradient, overlapped with the weight gradient.
            dim = _check_sequence_dim(x, self.sequence_dim, name)
            sizes = sequence_sizes(x.size(dim), self._group, name)  # one int per rank, every call
            y = all_gather_linear(x, weight, bias, dim, sizes, self._group)
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
        gather = ["all_gather"] if self.gather_output else []
        if self.sequence_parallel:
            return ["all_gather (sizes)", "all_gather"] + gather, ["reduce_scatter"]
        return gather, ["all_reduce"]

    def extra_repr(self) -> str:
        sp = f", sequence_parallel=True, sequence_dim={self.sequence_dim}" if self.sequence_parallel else ""
        return self._local_repr() + f", gather_output={self.gather_output}" + sp


class RowParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A``'s input features split over a 1-D mesh axis.

    Shapes (``in_local`` = this rank's share of ``in_features``):

    - ``weight``: ``(out_features, in_local)``; ``bias``: ``(out_features,)``
      replicated, added exactly once (rank 0 folds it into its matmul before the
      all-reduce)
    - input: ``(..., in_local)``, or ``(..., in_features)`` with
      ``input_is_parallel=False`` (then split locally)
    - output: ``(..., out_features)``, replicated

    Forward all-reduces the partial products; backward issues nothing (or one
    all-gather of the input gradient with ``input_is_parallel=False``).

    Under ``torch.autocast`` it computes (and communicates) in the autocast dtype, as
    ``nn.Linear`` does; ``reduce_dtype=torch.float32`` sums the partial products in fp32
    (one rounding after the sum instead of one per addition).

    Sequence parallelism (``sequence_parallel=True``): the partial products are
    reduce-scattered along ``sequence_dim`` instead of all-reduced, so the output
    is this rank's balanced sequence shard ``(B, S_local, out_features)``;
    backward all-gathers the output gradient. The bias is still added once and
    its gradient is the full one on every rank.

    Example of a sequence-parallel MLP (``S`` need not divide the world size)::

        mesh = tplayers.init_mesh()
        fc1 = tplayers.ColumnParallelLinear(16, 64, mesh=mesh, sequence_parallel=True)
        fc2 = tplayers.RowParallelLinear(64, 16, mesh=mesh, sequence_parallel=True)
        x = tplayers.shard(torch.randn(2, 7, 16), 1)     # (2, S_local, 16), this rank's tokens
        y = fc2(torch.relu(fc1(x)))                       # (2, S_local, 16)

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
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device=None,
        dtype=None,
        reduce_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, type(self).__name__)
        _check_sequence_args(type(self).__name__, sequence_parallel, sequence_dim)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{type(self).__name__}: sequence_parallel=True needs input_is_parallel=True "
                             "(the input is the column-parallel activation), got input_is_parallel=False")
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        super().__init__(in_features, out_features, bias, mesh, device, dtype)

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
        if self.sequence_parallel:
            # (..., s, ..., in_local) -> partial products reduce-scattered along the sequence ->
            # (..., s_local, ..., out), bias added once (rank 0's matmul). Backward all-gathers dy.
            dim = _check_sequence_dim(x, self.sequence_dim, name)
            return linear_reduce_scatter_output(x, weight, bias, dim, self._group)
        # (..., in_local) -> partial products, summed by one all-reduce -> (..., out) replicated;
        # the bias is added once (folded into rank 0's matmul). Backward: no communication.
        return linear_all_reduce_output(x, weight, bias, self._group, self.reduce_dtype)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        if self.tp_size == 1:
            return [], []
        if self.sequence_parallel:
            return ["reduce_scatter"], ["all_gather"]
        return ["all_reduce"], ([] if self.input_is_parallel else ["all_gather"])

    def extra_repr(self) -> str:
        sp = f", sequence_parallel=True, sequence_dim={self.sequence_dim}" if self.sequence_parallel else ""
        return self._local_repr() + f", input_is_parallel={self.input_is_parallel}" + sp
