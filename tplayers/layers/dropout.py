"""Dropout that equals the serial model's on tensor-parallel activations.

Under ``torch.manual_seed(s)`` on every rank, :class:`ParallelDropout` makes each rank's
mask exactly its slice of the mask ``nn.Dropout`` draws on the serial model's full
activation, on CPU and CUDA (see :func:`tplayers.ops.dropout.dropout_slice` for how, and
what it costs). On replicated activations (``dim=None``) it is ``F.dropout``: the same mask
on every rank because every rank's generator is in the same state, which tplayers keeps
(sharded dropout and directly built layers advance the generator exactly as the serial model
does). That needs every rank seeded alike: ``parallelize_module(src_rank=...)`` makes the
*parameters* agree, not the generators.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import exchange_sizes
from tplayers.mesh import resolve_mesh
from tplayers.ops.dropout import dropout_slice
from tplayers.sharding import offsets_from_sizes, shard_sizes

__all__ = ["ParallelDropout"]


class ParallelDropout(nn.Module):
    """``nn.Dropout(p)`` on this rank's balanced shard of dim ``dim`` of the serial activation.

    - ``dim=None``: the input is replicated; the mask is the serial one on every rank.
    - ``dim=d``: the input is this rank's shard of dim ``d`` (:func:`tplayers.shard_sizes`
      layout: feature dim ``-1`` after a :class:`~tplayers.ColumnParallelLinear`, sequence dim
      ``1`` under sequence parallelism); the mask is exactly the serial mask's slice.
      ``full_size`` is the serial length of ``d`` when it is fixed (features); ``None`` finds
      it by exchanging the local lengths, one all-gather of one integer per rank per call in
      training (the sequence length may change from batch to batch).

    Args:
        p: the drop probability, in ``[0, 1]``.
        dim: the sharded dim of the input, or ``None`` (replicated input).
        full_size: the serial length of ``dim`` when fixed; ``None``: exchanged per call.
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).

    Returns:
        ``forward(x)``: ``x`` with this rank's slice of the serial mask applied (scaled by
        ``1 / (1 - p)``); ``x`` itself in eval mode.

    Raises:
        ValueError: a bad ``p`` or ``full_size``; in ``forward``, a ``dim`` out of range or a
            local length that is not this rank's ``shard_sizes`` share.
        TypeError: a non-int ``dim``, a non-tensor input.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``; the same seed on every rank)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        fc1 = tplayers.ColumnParallelLinear(16, 64, mesh=mesh)
        drop = tplayers.ParallelDropout(0.5, dim=-1, full_size=64, mesh=mesh)
        state = torch.get_rng_state()
        h = drop(torch.ones(4, fc1.weight.shape[0]))    # this rank's 64 / world features
        torch.set_rng_state(state)                      # the serial model's draw, from the same state
        start, stop = fc1.weight_ranges[0]
        torch.testing.assert_close(h, torch.nn.functional.dropout(torch.ones(4, 64), 0.5)[:, start:stop])
    """

    def __init__(
        self,
        p: float = 0.5,
        *,
        dim: Optional[int] = None,
        full_size: Optional[int] = None,
        mesh: Optional[DeviceMesh] = None,
    ) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"ParallelDropout: p must be a probability in [0, 1], got {p!r}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"ParallelDropout: dim must be an int or None, got {type(dim).__name__}")
        if full_size is not None and (
            dim is None or isinstance(full_size, bool) or not isinstance(full_size, int) or full_size < 0
        ):
            raise ValueError(f"ParallelDropout: full_size must be a non-negative int with dim set, got {full_size!r}")
        self.mesh = resolve_mesh(mesh)
        self._group = self.mesh.get_group(0)
        self.tp_rank, self.tp_size = self.mesh.get_local_rank(0), self.mesh.size(0)
        self.p, self.dim, self.full_size = float(p), dim, full_size

    @classmethod
    def from_module(cls, dropout: nn.Dropout, *, mesh: Optional[DeviceMesh] = None, **options) -> "ParallelDropout":
        """The parallel twin of ``dropout`` (same ``p``); ``options``: ``dim``, ``full_size``."""
        if type(dropout) is not nn.Dropout:
            raise TypeError(f"ParallelDropout.from_module expects an nn.Dropout, got {type(dropout).__name__}")
        if dropout.inplace:
            raise ValueError("ParallelDropout.from_module: inplace=True dropout is not supported; use inplace=False")
        layer = cls(dropout.p, mesh=mesh, **options)
        layer.train(dropout.training)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ParallelDropout: input must be a torch.Tensor, got {type(x).__name__}")
        if self.dim is None or not self.training or self.p == 0:
            return nn.functional.dropout(x, self.p, self.training)
        if not -x.dim() <= self.dim < x.dim():
            raise ValueError(f"ParallelDropout: dim {self.dim} is out of range for an input of shape {tuple(x.shape)}")
        dim = self.dim % x.dim()
        local = x.size(dim)
        if self.full_size is None:
            sizes = exchange_sizes(local, self._group)
            full = sum(sizes)
            if sizes != shard_sizes(full, self.tp_size):  # the same table on every rank: all raise
                raise ValueError(
                    f"ParallelDropout: dim {self.dim} must be sharded as shard_sizes({full}, "
                    f"{self.tp_size}) = {shard_sizes(full, self.tp_size)}, got local lengths {sizes}"
                )
        else:
            full, sizes = self.full_size, shard_sizes(self.full_size, self.tp_size)
            if local != sizes[self.tp_rank]:
                raise ValueError(
                    f"ParallelDropout: rank {self.tp_rank} must hold {sizes[self.tp_rank]} of "
                    f"full_size={full} along dim {self.dim}, got shape {tuple(x.shape)}"
                )
        shape = list(x.shape)
        shape[dim] = full
        return dropout_slice(x, self.p, True, shape, dim, offsets_from_sizes(sizes)[self.tp_rank])

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        exchange = self.dim is not None and self.full_size is None and self.tp_size > 1 and 0 < self.p
        return (["all_gather (sizes)"] if exchange else []), []

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}, full_size={self.full_size}, rank={self.tp_rank}/{self.tp_size}"
