"""Tensor-parallel embeddings: the vocabulary split (Megatron) or the embedding dim split.

``VocabParallelEmbedding`` splits the rows of the table (token ids) over a 1-D
mesh axis with :func:`tplayers.shard_sizes`; each rank looks up the ids it
owns, zeroes the others, and one all-reduce sums the partial lookups. Its
weight is sharded exactly like a column-parallel ``lm_head``'s, so the two can
share one Parameter (tied embeddings). ``ColumnParallelEmbedding`` splits the
embedding dim (PyTorch's ``ColwiseParallel`` on ``nn.Embedding``).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import gather_along_dim, reduce_from_parallel_region
from tplayers.comm.sequence import reduce_scatter_to_sequence_region
from tplayers.layers._common import ShardedModule, init_shards_like_serial
from tplayers.sharding import ShardSpec, shard_sizes

__all__ = ["VocabParallelEmbedding", "ColumnParallelEmbedding"]


class _ParallelEmbedding(ShardedModule):
    _weight_dim = 0

    def __init__(self, num_embeddings, embedding_dim, padding_idx, mesh, device, dtype) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"{name}: padding_idx must be in [-{num_embeddings}, {num_embeddings}), got {padding_idx}"
                )
            padding_idx %= num_embeddings
        mesh = self._bind_mesh(mesh)
        self._group = mesh.get_group(0)
        self.tp_rank, self.tp_size = mesh.get_local_rank(0), mesh.size(0)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        spec = self.shard_specs()["weight"]
        self._rows = (spec.start, spec.stop)  # this rank's rows of the table (vocab-parallel)
        self.weight = nn.Parameter(torch.empty(spec.local_shape, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """``{"weight": ShardSpec}``: the global table ``(num_embeddings, embedding_dim)`` and this rank's slice."""
        shape = (self.num_embeddings, self.embedding_dim)
        return {"weight": ShardSpec.balanced(shape, self._weight_dim, self.tp_size, self.tp_rank)}

    def reset_parameters(self) -> None:
        """This rank's slice of the table ``nn.Embedding`` draws under the same seed (standard
        normal, the padding row zero): the full table is drawn with its calls, the slice kept."""
        pad = self.padding_idx

        def serial_init(full: torch.Tensor) -> None:
            nn.init.normal_(full)
            if pad is not None:
                full[pad].zero_()

        init_shards_like_serial(self, {"weight": serial_init})

    @classmethod
    def from_module(cls, dense: nn.Embedding, *, mesh: Optional[DeviceMesh] = None, **options):
        """The twin of ``dense`` holding exactly this rank's slice of its table.

        ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not supported
        (ValueError). Build optimizers after swapping.
        """
        if not isinstance(dense, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_module expects an nn.Embedding, got {type(dense).__name__}")
        for opt in ("max_norm", "scale_grad_by_freq", "sparse"):
            if getattr(dense, opt):
                raise ValueError(
                    f"{cls.__name__}.from_module: nn.Embedding({opt}={getattr(dense, opt)!r}) is not supported"
                )
        layer = cls(
            dense.num_embeddings,
            dense.embedding_dim,
            padding_idx=dense.padding_idx,
            mesh=mesh,
            device="meta",
            dtype=dense.weight.dtype,
            **options,
        )
        layer = layer.to_empty(device=dense.weight.device)
        layer._copy_shards_from(dense)
        return layer

    def scale_output(self, scale) -> "_ParallelEmbedding":
        """Multiply every output by ``scale`` after the lookup, as transformers'
        ``*ScaledWordEmbedding`` (Gemma) do: a 0-d floating tensor is kept as the non-persistent
        buffer ``embed_scale`` (no ``state_dict`` key; cast to the weight's dtype when used), a
        number as the attribute ``embed_scale``; ``None`` leaves the layer unscaled. Returns ``self``."""
        if scale is None:
            return self
        if isinstance(scale, torch.Tensor):
            if scale.dim() != 0 or not scale.is_floating_point():
                raise ValueError(
                    f"{type(self).__name__}: scale must be a 0-d floating tensor, got {tuple(scale.shape)} {scale.dtype}"
                )
            self.register_buffer("embed_scale", scale.detach().clone().to(self.weight.device), persistent=False)
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(
                f"{type(self).__name__}: scale must be a number or a 0-d tensor, got {type(scale).__name__}"
            )
        else:
            self.embed_scale = float(scale)
        return self

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        scale = getattr(self, "embed_scale", None)
        if scale is None:
            return y
        return y * (scale.to(self.weight.dtype) if isinstance(scale, torch.Tensor) else scale)

    def _check_ids(self, ids: torch.Tensor) -> None:
        name = type(self).__name__
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: input must hold int64 or int32 token ids, got {ids.dtype}")
        if ids.device != self.weight.device:
            raise ValueError(f"{name}: input device must match the weight's {self.weight.device}, got {ids.device}")
        if ids.numel() and torch.compiler.is_compiling():  # no host sync in a graph: checked on the device
            torch._assert_async(
                ((ids >= 0) & (ids < self.num_embeddings)).all(),
                f"{name}: a token id is out of range [0, {self.num_embeddings})",
            )
        elif ids.numel():
            lo, hi = torch.aminmax(ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{name}: token id {bad} is out of range [0, {self.num_embeddings})")

    def _local_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, local_weight={tuple(self.weight.shape)}, "
            f"rank={self.tp_rank}/{self.tp_size}"
            + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
            + (f", embed_scale={float(self.embed_scale):g}" if getattr(self, "embed_scale", None) is not None else "")
        )


class VocabParallelEmbedding(_ParallelEmbedding):
    """``nn.Embedding`` with the rows of the table (the vocabulary) split over a 1-D mesh axis.

    Shapes (``vocab_local`` = this rank's share of ``num_embeddings``, balanced):

    - ``weight``: ``(vocab_local, embedding_dim)``, rows ``[start, stop)`` of the serial table
    - input: token ids ``(...)``, replicated; output ``(..., embedding_dim)``, replicated

    Each rank looks up the ids in its range (the others give zeros); forward
    issues one all-reduce, backward nothing. ``RowParallel()`` on an
    ``nn.Embedding`` in a plan builds this layer. Its weight is laid out like a
    column-parallel ``lm_head``'s, so tied embeddings stay one Parameter.

    Sequence parallelism (``sequence_parallel=True``): the partial lookups are
    reduce-scattered along ``sequence_dim`` of the output (default 1 for ids ``(B, S)``)
    instead of all-reduced, so the output is this rank's balanced sequence shard
    ``(B, S_local, embedding_dim)`` (Megatron-LM's embedding under sequence parallelism);
    backward all-gathers the output gradient.

    Args:
        num_embeddings, embedding_dim, padding_idx: as ``nn.Embedding`` (``max_norm``,
            ``scale_grad_by_freq`` and ``sparse`` are not supported).
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).
        device, dtype: as ``nn.Embedding``.
        sequence_parallel, sequence_dim: reduce-scatter the output along ``sequence_dim`` (above).

    Returns:
        ``forward(ids)``: ``(..., embedding_dim)``, replicated (or this rank's sequence shard).

    Raises:
        ValueError: non-positive sizes, ``padding_idx`` out of range; in ``forward``, ids that are
            not int32/int64 on the weight's device, or out of ``[0, num_embeddings)``.
        TypeError: non-tensor ids, a non-bool ``sequence_parallel`` or non-int ``sequence_dim``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        dense = torch.nn.Embedding(50, 8)
        emb = tplayers.VocabParallelEmbedding.from_module(dense, mesh=mesh)
        ids = torch.tensor([[0, 7, 49]])
        torch.testing.assert_close(emb(ids), dense(ids))
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        *,
        mesh: Optional[DeviceMesh] = None,
        device=None,
        dtype=None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> None:
        name = type(self).__name__
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"{name}: sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"{name}: sequence_dim must be an int, got {type(sequence_dim).__name__}")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        super().__init__(num_embeddings, embedding_dim, padding_idx, mesh, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        if self.sequence_parallel and not -ids.dim() <= self.sequence_dim < ids.dim():
            raise ValueError(
                f"{type(self).__name__}: sequence_dim={self.sequence_dim} must name a dim of the ids, "
                f"got ids of shape {tuple(ids.shape)}"
            )
        if self.tp_size == 1:
            return self._scaled(F.embedding(ids, self.weight, self.padding_idx))
        start, stop = self._rows
        outside = (ids < start) | (ids >= stop)  # ids another rank owns
        local = (ids - start).masked_fill(outside, 0)
        pad = self.padding_idx - start if self.padding_idx is not None and start <= self.padding_idx < stop else None
        if self.weight.shape[0] == 0:  # this rank owns no row: its partial is zero
            part = self.weight.new_zeros(ids.shape + (self.embedding_dim,)) + self.weight.sum() * 0
        else:
            part = F.embedding(local, self.weight, pad).masked_fill(outside.unsqueeze(-1), 0)  # (..., dim) partial
        if self.sequence_parallel:  # (B, S, dim) partial -> (B, S_local, dim) summed; backward all-gather
            return self._scaled(reduce_scatter_to_sequence_region(part, self.sequence_dim % ids.dim(), self._group))
        return self._scaled(reduce_from_parallel_region(part, self._group))  # one all-reduce: (..., dim) replicated

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        if self.tp_size == 1:
            return [], []
        return (["reduce_scatter"], ["all_gather"]) if self.sequence_parallel else (["all_reduce"], [])

    @property
    def partition_sizes(self) -> list:
        return shard_sizes(self.num_embeddings, self.tp_size)

    def extra_repr(self) -> str:
        extra = f", sequence_parallel=True, sequence_dim={self.sequence_dim}" if self.sequence_parallel else ""
        return self._local_repr() + extra


class ColumnParallelEmbedding(_ParallelEmbedding):
    """``nn.Embedding`` with the embedding dim split over a 1-D mesh axis.

    - ``weight``: ``(num_embeddings, dim_local)``
    - input: token ids ``(...)``, replicated; output ``(..., dim_local)``, or
      ``(..., embedding_dim)`` with ``gather_output=True`` (one all-gather)

    ``ColumnParallel()`` on an ``nn.Embedding`` in a plan builds this layer.
    No collective in backward (token ids have no gradient).

    Args:
        num_embeddings, embedding_dim, padding_idx: as ``nn.Embedding``.
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).
        gather_output: all-gather the output to ``(..., embedding_dim)``.
        device, dtype: as ``nn.Embedding``.

    Returns:
        ``forward(ids)``: ``(..., dim_local)``, or ``(..., embedding_dim)`` with ``gather_output``.

    Raises:
        ValueError: non-positive sizes, ``padding_idx`` out of range; in ``forward``, ids that are
            not int32/int64 on the weight's device, or out of ``[0, num_embeddings)``.
        TypeError: non-tensor ids.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        dense = torch.nn.Embedding(50, 8)
        emb = tplayers.ColumnParallelEmbedding.from_module(dense, mesh=mesh, gather_output=True)
        ids = torch.tensor([[0, 7, 49]])
        torch.testing.assert_close(emb(ids), dense(ids))
    """

    _weight_dim = 1

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        *,
        mesh: Optional[DeviceMesh] = None,
        gather_output: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        self.gather_output = bool(gather_output)
        super().__init__(num_embeddings, embedding_dim, padding_idx, mesh, device, dtype)

    @property
    def partition_sizes(self) -> list:
        return shard_sizes(self.embedding_dim, self.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        y = self._scaled(F.embedding(ids, self.weight, self.padding_idx))  # (..., dim_local)
        if self.gather_output and self.tp_size > 1:
            y = gather_along_dim(y, -1, self._group, self.partition_sizes)  # (..., embedding_dim)
        return y

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        return (["all_gather"] if self.gather_output and self.tp_size > 1 else []), []

    def extra_repr(self) -> str:
        return self._local_repr() + f", gather_output={self.gather_output}"
