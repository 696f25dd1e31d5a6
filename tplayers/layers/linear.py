"""Tensor-parallel linear layers with Megatron semantics and uneven feature counts.

``ColumnParallelLinear`` splits the output features over a 1-D mesh axis,
``RowParallelLinear`` the input features. A Column -> Row pair computes an MLP
with one all-reduce forward (after Row) and one backward (before Column).
Feature counts need not divide the world size: shard sizes follow
:func:`tplayers.shard_sizes` (the first ``n % world`` ranks get one more).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import gather_along_dim, split_along_dim
from tplayers.comm.fused import (
    all_gather_linear,
    linear_all_reduce_input_grad,
    linear_all_reduce_output,
    linear_reduce_scatter_output,
)
from tplayers.comm.replicas import sum_replica_grads
from tplayers.comm.sequence import sequence_sizes
from tplayers.layers._common import autocast_inputs, check_features, check_reduce_dtype
from tplayers.layers._linear_base import ParallelLinearBase, check_sequence_args, check_sequence_dim
from tplayers.layers._sections import SectionLayout, check_head_dim, check_sections, row_head_ranges
from tplayers.sharding import ShardSpec, shard_sizes
from tplayers.sharding import shard_range as shard_range_of

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class ColumnParallelLinear(ParallelLinearBase):
    """``y = x A^T + b`` with ``A``'s output features split over a 1-D mesh axis (Megatron).

    Forward issues nothing (or one all-gather with ``gather_output=True``); backward all-reduces
    the input gradient, overlapped with the weight-gradient matmul. Built under
    ``torch.manual_seed(s)`` on every rank, its shards are the serial ``nn.Linear``'s slices.

    Fused and head-aware layouts (docs/design.md (tensor-parallel linears)): ``sections`` lists the
    sizes of fused blocks of the output features (``(d, d, d)`` for GPT-2's ``c_attn``,
    ``(heads*hd, kv_heads*hd, kv_heads*hd)`` for a GQA projection). Each block is sharded on its
    own and the local output is this rank's slices in block order, of sizes :attr:`local_sections`
    (``y.split(layer.local_sections, -1)`` gives the local q, k, v). With ``head_dim`` every rank
    holds whole heads; a block with fewer heads than ranks is replicated in groups (rank ``r``
    holds head ``r * heads // tp``) and its gradients are summed over the replicas (one more
    all-reduce in backward). Checkpoints and ``gather_state_dict`` keep the serial layout.

    Args:
        in_features, out_features, bias: as ``nn.Linear`` (features need not divide the mesh size:
            shards follow :func:`tplayers.shard_sizes`).
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).
        gather_output: all-gather the output to ``(..., out_features)`` in serial order.
        sections, head_dim: the fused / head-aware layout above.
        sequence_parallel, sequence_dim: the input is this rank's shard of ``sequence_dim``
            (default 1 of ``(B, S, H)``, uneven allowed), all-gathered before the matmul (after one
            all-gather of the per-rank lengths); backward reduce-scatters the input gradient.
        device, dtype: as ``nn.Linear``.
        reduce_dtype: all-reduce the input gradient in this dtype (e.g. fp32 under bf16 autocast).
        transposed: store ``weight`` as ``(in_features, out_local)``, the layout of transformers'
            ``Conv1D`` (``from_module`` of a ``Conv1D`` sets it).

    Returns:
        ``forward(x)``: ``x`` is ``(..., in_features)``, replicated; the output is
        ``(..., out_local)`` (``weight`` ``(out_local, in_features)``), or ``(..., out_features)``
        with ``gather_output=True``. Under ``torch.autocast`` it computes and communicates in the
        autocast dtype, as ``nn.Linear`` does.

    Raises:
        ValueError: non-positive feature counts, bad ``sections`` / ``head_dim``; in ``forward``,
            an input whose last dim, dtype or device does not match (before any collective).
        TypeError: a non-bool ``sequence_parallel`` / ``transposed``, a non-float ``reduce_dtype``.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        dense = torch.nn.Linear(16, 30)
        col = tplayers.ColumnParallelLinear.from_module(dense, mesh=mesh, gather_output=True)
        x = torch.randn(4, 16)
        torch.testing.assert_close(col(x), dense(x))

        qkv = torch.nn.Linear(16, 3 * 16)               # fused q, k, v of 4 heads of 4
        col = tplayers.ColumnParallelLinear.from_module(qkv, mesh=mesh, sections=(16, 16, 16), head_dim=4)
        q, k, v = col(x).split(col.local_sections, -1)  # this rank's heads of each
        start, stop = col.weight_ranges[0]              # the q heads this rank holds
        torch.testing.assert_close(q, qkv(x)[:, start:stop])
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
        sections=None,
        head_dim: Optional[int] = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device=None,
        dtype=None,
        reduce_dtype: Optional[torch.dtype] = None,
        transposed: bool = False,
    ) -> None:
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, type(self).__name__)
        check_sequence_args(type(self).__name__, sequence_parallel, sequence_dim)
        self.gather_output = bool(gather_output)
        self._options = (sections, head_dim)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        super().__init__(in_features, out_features, bias, mesh, device, dtype, transposed)

    def _setup_layout(self) -> None:
        sections, head_dim = self._options
        del self._options
        name = type(self).__name__
        self.sections = check_sections(name, sections, self.out_features, head_dim)
        self.head_dim = head_dim
        self._layout = None
        if self.sections is not None or head_dim is not None:
            self._layout = SectionLayout.build(name, self.sections or (self.out_features,), self.tp_size, head_dim)
            self._replicas = self._layout.replica_slots(self.tp_rank)
            self._gather_index = None  # built on first use (a device tensor)

    def _specs(self, bias: bool) -> Dict[str, ShardSpec]:
        if self._layout is None:
            return super()._specs(bias)
        specs = {"weight": self._layout.spec((self.out_features, self.in_features), self.tp_rank)}
        if bias:
            specs["bias"] = self._layout.spec((self.out_features,), self.tp_rank)
        return specs

    def counted_ranges(self, name: str):
        """With blocks replicated in groups (GQA key/value heads), each block range is counted on the
        lowest rank holding it; otherwise ``None`` (the whole local tensor)."""
        if self._layout is None or not any(self._layout.replicated):
            return None
        table, out, local = self._layout.table, [], 0
        for j, (a, b) in enumerate(table[self.tp_rank]):
            if b > a and min(r for r, row in enumerate(table) if row[j] == (a, b)) == self.tp_rank:
                out.append((local, local + b - a))
            local += b - a
        return tuple(out)

    @property
    def local_sections(self) -> tuple:
        """This rank's width of each fused block, in order (``(out_local,)`` without ``sections``)."""
        if self._layout is None:
            return (self.dense_weight().shape[0],)
        return self._layout.local_sections(self.tp_rank)

    @property
    def weight_ranges(self) -> tuple:
        """The global ``(start, stop)`` output features of each block this rank holds."""
        if self._layout is None:
            return (shard_range_of(self.out_features, self.tp_size, self.tp_rank),)
        return tuple(self._layout.ranges(self.tp_rank))

    @property
    def partition_sizes(self) -> list:
        if self._layout is None:  # (no super() here: torch.compile breaks the graph on it)
            return shard_sizes(self.out_features, self.tp_size)
        return [self._layout.local_total(r) for r in range(self.tp_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        # as F.linear under torch.autocast; weight (out_local, in) or (out, in_local), a view if transposed
        x, weight, bias = autocast_inputs(x, self.dense_weight(), self.bias)
        check_features(x, self.in_features, weight, "input", name)
        if self.tp_size > 1 and self._layout is not None and self._replicas[1]:
            # Blocks replicated in groups (GQA kv heads): identity now, gradient summed over replicas.
            weight, bias = sum_replica_grads(weight, bias, self._replicas[0], self._replicas[1], self._group)
        if self.tp_size == 1:
            y = F.linear(x, weight, bias)  # (..., out)
        elif self.sequence_parallel:
            # (..., s_local, ..., in) sequence shard -> all-gather -> (..., s, ..., out_local);
            # backward reduce-scatters the input gradient, overlapped with the weight gradient.
            dim = check_sequence_dim(x, self.sequence_dim, name)
            sizes = sequence_sizes(x.size(dim), self._group, name)  # one int per rank, every call
            y = all_gather_linear(x, weight, bias, dim, sizes, self._group)
        else:
            # (..., in) replicated -> (..., out_local); backward all-reduces the input gradient,
            # overlapped with the weight-gradient matmul (CopyToParallelRegion fused with F.linear).
            y = linear_all_reduce_input_grad(x, weight, bias, self._group, self.reduce_dtype)
        if self.gather_output:
            y = gather_along_dim(y, -1, self._group, self.partition_sizes)  # (..., sum of local widths)
            if self._layout is not None and self.tp_size > 1:
                y = y.index_select(-1, self._serial_order(y.device))  # (..., out) in serial order
        return y

    def _serial_order(self, device) -> torch.Tensor:
        if self._gather_index is None or self._gather_index.device != device:
            self._gather_index = torch.tensor(self._layout.gather_index(), dtype=torch.long, device=device)
        return self._gather_index

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        if self.tp_size == 1:
            return [], []
        gather = ["all_gather"] if self.gather_output else []
        replicas = ["all_reduce"] if self._layout is not None and self._replicas[1] else []  # replica gradient sum
        if self.sequence_parallel:
            return ["all_gather (sizes)", "all_gather"] + gather, ["reduce_scatter"] + replicas
        return gather, ["all_reduce"] + replicas

    def extra_repr(self) -> str:
        extra = f", gather_output={self.gather_output}"
        if self.sections is not None:
            extra += f", sections={self.sections}, local_sections={self.local_sections}"
        if self.head_dim is not None:
            extra += f", head_dim={self.head_dim}"
        if self.sequence_parallel:
            extra += f", sequence_parallel=True, sequence_dim={self.sequence_dim}"
        return self._local_repr() + extra


class RowParallelLinear(ParallelLinearBase):
    """``y = x A^T + b`` with ``A``'s input features split over a 1-D mesh axis (Megatron).

    Forward all-reduces the partial products (the replicated bias folded into rank 0's matmul, so
    added once); backward issues nothing (or one all-gather of the input gradient with
    ``input_is_parallel=False``). A Column -> Row pair costs one all-reduce each way.

    Args:
        in_features, out_features, bias: as ``nn.Linear`` (uneven shards of ``in_features``).
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).
        input_is_parallel: the input is this rank's ``(..., in_local)`` shard (the output of a
            ``ColumnParallelLinear``); ``False``: the full ``(..., in_features)``, split locally.
        head_dim: split the input features in whole heads (the attention output of a
            column-parallel ``q`` with the same ``head_dim``); needs ``input_is_parallel=True``.
        sequence_parallel, sequence_dim: reduce-scatter the partial products along
            ``sequence_dim`` instead of all-reducing them, so the output is this rank's balanced
            sequence shard ``(B, S_local, out_features)``; backward all-gathers its gradient.
        device, dtype: as ``nn.Linear``.
        reduce_dtype: sum the partial products in this dtype (one rounding after the sum).
        transposed: store ``weight`` as ``(in_local, out_features)`` (transformers' ``Conv1D``).

    Returns:
        ``forward(x)``: ``(..., out_features)``, replicated (``weight`` ``(out_features, in_local)``,
        ``bias`` ``(out_features,)`` replicated). Under ``torch.autocast`` it computes and
        communicates in the autocast dtype.

    Raises:
        ValueError: non-positive feature counts, ``head_dim`` or ``sequence_parallel`` without
            ``input_is_parallel``; in ``forward``, an input of the wrong width, dtype or device.
        TypeError: a non-bool ``sequence_parallel`` / ``transposed``, a non-float ``reduce_dtype``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        dense = torch.nn.Linear(30, 16)
        row = tplayers.RowParallelLinear.from_module(dense, mesh=mesh, input_is_parallel=False)
        x = torch.randn(4, 30)
        torch.testing.assert_close(row(x), dense(x))

    A sequence-parallel MLP (``S`` need not divide the world size)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                              # the same layers on every rank
        fc1 = tplayers.ColumnParallelLinear(16, 64, mesh=mesh, sequence_parallel=True)
        fc2 = tplayers.RowParallelLinear(64, 16, mesh=mesh, sequence_parallel=True)
        x = torch.randn(2, 7, 16)
        y = fc2(torch.relu(fc1(tplayers.shard(x, 1, mesh))))   # (2, S_local, 16): this rank's tokens
        serial = torch.relu(x @ tplayers.gather(fc1.weight, 0, mesh).T + tplayers.gather(fc1.bias, 0, mesh))
        serial = serial @ tplayers.gather(fc2.weight, 1, mesh).T + fc2.bias
        torch.testing.assert_close(tplayers.gather(y, 1, mesh), serial)
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
        head_dim: Optional[int] = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device=None,
        dtype=None,
        reduce_dtype: Optional[torch.dtype] = None,
        transposed: bool = False,
    ) -> None:
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, type(self).__name__)
        check_sequence_args(type(self).__name__, sequence_parallel, sequence_dim)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                f"{type(self).__name__}: sequence_parallel=True needs input_is_parallel=True "
                "(the input is the column-parallel activation), got input_is_parallel=False"
            )
        self.input_is_parallel = bool(input_is_parallel)
        self.head_dim = head_dim
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        super().__init__(in_features, out_features, bias, mesh, device, dtype, transposed)

    def _setup_layout(self) -> None:
        name = type(self).__name__
        check_head_dim(name, self.head_dim, self.in_features, "in_features")
        if self.head_dim is not None and not self.input_is_parallel:
            raise ValueError(f"{name}: head_dim needs input_is_parallel=True (the input already split in heads)")

    def _specs(self, bias: bool) -> Dict[str, ShardSpec]:
        specs = super()._specs(bias)
        if self.head_dim is not None:
            a, b = row_head_ranges(self.in_features, self.tp_size, self.tp_rank, self.head_dim)
            specs["weight"] = ShardSpec.from_ranges(
                (self.out_features, self.in_features), 1, [(a, b)], self.tp_size, self.tp_rank
            )
        return specs

    @property
    def partition_sizes(self) -> list:
        if self.head_dim is None:
            return shard_sizes(self.in_features, self.tp_size)
        return [
            b - a
            for a, b in (row_head_ranges(self.in_features, self.tp_size, r, self.head_dim) for r in range(self.tp_size))
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        # as F.linear under torch.autocast; weight (out_local, in) or (out, in_local), a view if transposed
        x, weight, bias = autocast_inputs(x, self.dense_weight(), self.bias)
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
            dim = check_sequence_dim(x, self.sequence_dim, name)
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
        extra = f", input_is_parallel={self.input_is_parallel}"
        if self.head_dim is not None:
            extra += f", head_dim={self.head_dim}"
        if self.sequence_parallel:
            extra += f", sequence_parallel=True, sequence_dim={self.sequence_dim}"
        return self._local_repr() + extra
