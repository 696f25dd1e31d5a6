"""Domain-parallel adaptive pooling, 1-D / 2-D / 3-D: average and max.

Average (``DistributedAdaptiveAvgPoolNd``): a band resampling, as ``DistributedUpsample``
(:mod:`tplayers.layers.upsample`): the serial pool's weights applied to the rows the N-d halo exchange
brings; size 1 along a sharded dim is a global mean (one all-reduce forward, identity backward).

Max (``DistributedAdaptiveMaxPoolNd``):

Along a sharded dim of length ``L`` pooled to ``o`` outputs, output ``i`` reads
the window ``[floor(i*L/o), ceil((i+1)*L/o))`` (PyTorch's adaptive rule): a
window op of the core. The rows a shard's outputs read arrive by the N-d halo
exchange; each output is the max over its window (a gather of the window's
rows, padded by repeating its last row, which a max ignores). Max is separable,
so sharded dims are reduced one after the other and the unsharded dims are left
to ``F.adaptive_max_poolNd`` (an exact identity along the sharded ones).

Output size 1 along a sharded dim is a global maximum: :class:`GlobalMax`
(forward: local max, then an all-reduce MAX; the output is replicated along that
dim / backward: the gradient goes to the one rank holding the maximum).
Gradients follow the serial module except at exact ties between different
elements (the serial kernel picks the first in row-major order; here dims are
reduced one at a time).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import record_collective
from tplayers.domain.window import gather_rows
from tplayers.layers._domain import DomainLayer
from tplayers.layers.upsample import _BandResample
from tplayers.sharding import offsets_from_sizes
from tplayers.window_plan import out_partition, plan_ranges

__all__ = [
    "DistributedAdaptiveAvgPool1d",
    "DistributedAdaptiveAvgPool2d",
    "DistributedAdaptiveAvgPool3d",
    "DistributedAdaptiveMaxPool1d",
    "DistributedAdaptiveMaxPool2d",
    "DistributedAdaptiveMaxPool3d",
    "GlobalMax",
]

_ADAPTIVE_AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}


class GlobalMax(torch.autograd.Function):
    """forward: max of ``x`` over ``dim`` (keepdim) on every rank, then an all-reduce MAX over
    ``group``: the global maximum, replicated / backward: the gradient goes to the element holding
    the maximum on the lowest rank that holds it; every other rank gets zeros."""

    @staticmethod
    def forward(ctx, x, dim, group):
        shape = list(x.shape)
        shape[dim] = 1
        if x.size(dim):
            local, idx = x.max(dim=dim, keepdim=True)
        else:
            local, idx = x.new_full(shape, float("-inf")), None
        glob = local.clone(memory_format=torch.contiguous_format)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        record_collective("all_reduce", glob.numel() * glob.element_size(), size, "global_max.fwd")
        dist.all_reduce(glob, op=dist.ReduceOp.MAX, group=group)
        owner = torch.where(local == glob, me, size).to(torch.int64)  # ties: the lowest rank wins
        record_collective("all_reduce", owner.numel() * owner.element_size(), size, "global_max.fwd")
        dist.all_reduce(owner, op=dist.ReduceOp.MIN, group=group)
        ctx.dim, ctx.shape = dim, tuple(x.shape)
        ctx.save_for_backward(*([idx, owner == me] if idx is not None else [owner == me]))
        return glob

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        gx = grad.new_zeros(ctx.shape)
        if len(saved) == 2:
            idx, mine = saved
            gx.scatter_(ctx.dim, idx, grad * mine)
        return gx, None, None


class _AdaptiveMaxPoolNd(DomainLayer):
    _nn: type = nn.AdaptiveMaxPool2d

    def __init__(
        self,
        output_size,
        return_indices: bool = False,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
    ) -> None:
        super().__init__()
        name, n = type(self).__name__, self.spatial
        if return_indices:
            raise ValueError(
                f"{name}: return_indices=True is not supported (indices would be positions in the "
                "local slab); use return_indices=False"
            )
        sizes = list(output_size) if isinstance(output_size, (tuple, list)) else [output_size] * n
        if len(sizes) != n or any(s is not None and (isinstance(s, bool) or int(s) < 1) for s in sizes):
            raise ValueError(
                f"{name}: output_size must be a positive int, None or a tuple of {n} of them, got {output_size!r}"
            )
        self.output_size, self.return_indices = output_size, False
        self._sizes = [None if s is None else int(s) for s in sizes]
        self._init_domain(mesh, shard_dims)

    @classmethod
    def from_module(cls, m: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The domain-parallel twin of an ``nn.AdaptiveMaxPoolNd``."""
        if type(m) is not cls._nn:
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls._nn.__name__}, got {type(m).__name__}")
        return cls(m.output_size, m.return_indices, mesh=mesh, shard_dims=shard_dims)

    def _config(self):
        return {"output_size": tuple(self._sizes)}

    def _build(self, shape, sizes: Dict[int, List[int]], like: torch.Tensor):
        steps, out_shape = [], list(shape)
        for d in self.shard_dims:  # mesh order
            length, c = sum(sizes[d]), self._coord(d)
            out = self._sizes[d - 2] or length
            if out == 1:
                steps.append((d, None, None))
                out_shape[d] = 1
                continue
            outs = out_partition(sizes[d], out)
            first = lambda i: (i * length) // out  # noqa: E731 - PyTorch's adaptive window
            stop = lambda i: -(-((i + 1) * length) // out)  # noqa: E731
            needs = [
                (first(o0), stop(o0 + rows - 1)) if rows else None for o0, rows in zip(offsets_from_sizes(outs), outs)
            ]
            what = f"dim {d} (mesh dim {self.shard_dims.index(d)})"
            plan = plan_ranges(sizes[d], needs, outs, mode="zeros", what=what)[c]
            width = max((stop(i) - first(i) for i in range(out)), default=1)
            rows = [
                [min(first(i) + j, stop(i) - 1) - plan.in_start for j in range(width)]
                for i in range(plan.out_start, plan.out_start + plan.out_rows)
            ]
            index = torch.tensor(rows, dtype=torch.int64, device=like.device).reshape(-1, width)
            steps.append((d, plan, index))
            out_shape[d] = plan.out_rows
        for d in range(2, len(shape)):
            if d not in self.shard_dims:
                out_shape[d] = self._sizes[d - 2] or shape[d]
        return steps, tuple(out_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, out_shape = self._layout(x)  # validated on every rank before any halo traffic
        for d, plan, index in steps:
            group = self._group_of(d)
            if plan is None:  # output size 1: the global maximum, replicated along d
                x = GlobalMax.apply(x, d, group)
                continue
            x = gather_rows(x, d, group, plan, "zeros")
            rows, width = index.shape
            picked = x.index_select(d, index.reshape(-1))  # (..., rows * width, ...) along d
            x = picked.unflatten(d, (rows, width)).max(dim=d + 1).values
        if all(x.size(d) == out_shape[d] for d in range(2, x.dim())):
            return x
        if 0 in x.shape:
            return self._tie(x.new_zeros(out_shape), x)
        keep = [x.size(d) if d in self.shard_dims else out_shape[d] for d in range(2, x.dim())]
        return _ADAPTIVE_MAX[self.spatial](x, keep)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}, shard_dims={self.shard_dims}"


def _doc(n: int) -> str:
    return f"""``nn.AdaptiveMaxPool{n}d`` on a spatially sharded input, exact against the serial module.

    Any output size whose windows the adjacent shards can supply; size 1 along a sharded dim is a
    global maximum (:class:`GlobalMax`), that dim of the output then replicated on every rank.

    Args:
        output_size: as ``nn.AdaptiveMaxPool{n}d`` (global sizes; ``None`` keeps a dim).
        return_indices: must be ``False`` (indices would be positions in the local slab).
        mesh: a 1-D mesh, or a 2-D one to shard two dims (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the dims of the ``(N, C, *spatial)`` input sharded over the mesh dims.

    Returns:
        ``forward(x)``: this rank's rows of the serial output (balanced), replicated along the
        sharded dims pooled to size 1.

    Raises:
        ValueError: ``return_indices=True`` or a bad ``output_size``; in ``forward``, on every rank
            before any halo traffic: a partition whose shards cannot supply the windows.
        TypeError: ``from_module`` of another module type.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = torch.nn.AdaptiveMaxPool{n}d(3)
        pool = tplayers.DistributedAdaptiveMaxPool{n}d.from_module(serial, mesh=mesh)
        x = torch.randn(2, 3, {", ".join(["9"] * n)})                  # same on every rank
        y = tplayers.gather(pool(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x))
    """


class DistributedAdaptiveMaxPool1d(_AdaptiveMaxPoolNd):
    __doc__ = _doc(1)
    spatial, _nn = 1, nn.AdaptiveMaxPool1d


class DistributedAdaptiveMaxPool2d(_AdaptiveMaxPoolNd):
    __doc__ = _doc(2)
    spatial, _nn = 2, nn.AdaptiveMaxPool2d


class DistributedAdaptiveMaxPool3d(_AdaptiveMaxPoolNd):
    __doc__ = _doc(3)
    spatial, _nn = 3, nn.AdaptiveMaxPool3d


class _AdaptiveAvgPoolNd(_BandResample):
    _reduce_to_one = True

    def __init__(self, output_size, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)) -> None:
        super().__init__()
        n = self.spatial
        sizes = list(output_size) if isinstance(output_size, (tuple, list)) else [output_size] * n
        if len(sizes) != n or any(s is not None and (isinstance(s, bool) or int(s) < 1) for s in sizes):
            raise ValueError(
                f"{type(self).__name__}: output_size must be a positive int, None or a tuple of "
                f"{n} of them, got {output_size!r}"
            )
        self.output_size = output_size
        self._sizes = [None if s is None else int(s) for s in sizes]
        self._init_domain(mesh, shard_dims)

    @classmethod
    def from_module(cls, m: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The domain-parallel twin of an ``nn.AdaptiveAvgPoolNd``."""
        if type(m) is not cls._nn:
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls._nn.__name__}, got {type(m).__name__}")
        return cls(m.output_size, mesh=mesh, shard_dims=shard_dims)

    def _config(self):
        return {"output_size": tuple(self._sizes)}

    def _pool(self, x: torch.Tensor, keep: Dict[int, int]) -> torch.Tensor:
        size = [keep.get(2 + i, s) for i, s in enumerate(self._sizes)]
        return _ADAPTIVE_AVG[self.spatial](x, size)

    def _probe(self, eye: torch.Tensor, n_sp: int, d: int) -> torch.Tensor:
        keep = {2 + i: 1 for i in range(n_sp) if 2 + i != d}
        return self._pool(eye, keep).reshape(eye.size(1), -1)

    def _out_len(self, d: int, length: int, n_sp: int) -> int:
        s = self._sizes[d - 2]
        return length if s is None else s

    def _rest(self, x, out_shape):
        return self._pool(x, {d: x.size(d) for d in self.shard_dims})

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}, shard_dims={self.shard_dims}"


def _adaptive_doc(n: int) -> str:
    return f"""``nn.AdaptiveAvgPool{n}d`` on a spatially sharded input, exact against the serial module.

    Any output size whose windows the adjacent shards can supply; size 1 along a sharded dim is a
    global mean (one all-reduce forward, identity backward): that dim of the output is then
    replicated (size 1 on every rank), not sharded.

    Args:
        output_size: as ``nn.AdaptiveAvgPool{n}d`` (global sizes; ``None`` keeps a dim).
        mesh: a 1-D mesh, or a 2-D one to shard two dims (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the dims of the ``(N, C, *spatial)`` input sharded over the mesh dims.

    Returns:
        ``forward(x)``: this rank's rows of the serial output (balanced), replicated along the
        sharded dims pooled to size 1.

    Raises:
        ValueError: a bad ``output_size``; in ``forward``, on every rank before any halo traffic:
            a partition whose shards cannot supply the windows, mismatched shapes.
        TypeError: ``from_module`` of another module type.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = torch.nn.AdaptiveAvgPool{n}d(1)
        pool = tplayers.DistributedAdaptiveAvgPool{n}d.from_module(serial, mesh=mesh)
        x = torch.randn(2, 3, {", ".join(["8"] * n)})                  # same on every rank
        torch.testing.assert_close(pool(tplayers.shard(x, 2, mesh)), serial(x))   # replicated
    """


class DistributedAdaptiveAvgPool1d(_AdaptiveAvgPoolNd):
    __doc__ = _adaptive_doc(1)
    spatial, _nn = 1, nn.AdaptiveAvgPool1d


class DistributedAdaptiveAvgPool2d(_AdaptiveAvgPoolNd):
    __doc__ = _adaptive_doc(2)
    spatial, _nn = 2, nn.AdaptiveAvgPool2d


class DistributedAdaptiveAvgPool3d(_AdaptiveAvgPoolNd):
    __doc__ = _adaptive_doc(3)
    spatial, _nn = 3, nn.AdaptiveAvgPool3d
