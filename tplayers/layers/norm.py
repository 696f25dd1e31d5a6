"""Batch, group and instance norms with statistics over the whole (sharded) domain.

``DistributedBatchNorm1d/2d/3d``, ``DistributedGroupNorm`` and ``DistributedInstanceNorm1d/2d/3d``
subclass their ``nn`` module: the same arguments and defaults, parameters, buffers and
``state_dict`` keys, plus ``*, mesh=None, shard_dims=(2,)``. Their input is this rank's slice of
``(N, C, *spatial)`` along ``shard_dims``; the output equals the serial module on the gathered
input, every gradient matches, and running stats / ``num_batches_tracked`` (momentum ``None``
included) end up exactly as the serial module's (unbiased variance with the global count).

All three share :class:`~tplayers.layers._norm_core.DomainNormFn`: per-rank (count, mean, M2) in
fp32 (fp64 for fp64), one all-gather per mesh dim, a Chan merge in fp64; backward one fused
all-reduce per mesh dim (statistic sums and the weight/bias gradients together). In eval mode
with running stats the norm is per-pixel: no forward communication, one all-reduce of the
affine gradients in backward.
"""

from __future__ import annotations

from itertools import chain
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import copy_many_to_parallel_region
from tplayers.layers._common import ShardedModule
from tplayers.layers._norm_core import DomainNormFn, update_running
from tplayers.sharding import ShardSpec

__all__ = [
    "DistributedBatchNorm1d",
    "DistributedBatchNorm2d",
    "DistributedBatchNorm3d",
    "DistributedGroupNorm",
    "DistributedInstanceNorm1d",
    "DistributedInstanceNorm2d",
    "DistributedInstanceNorm3d",
]


class _DomainNorm(ShardedModule):
    """Shared machinery: mesh and ``shard_dims`` binding, checks, ``from_module``, the stats call."""

    _nn: type = nn.Module
    spatial: Optional[int] = None  # spatial dims of the input; None: any

    def __init__(self, *args, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        try:
            dims = tuple(int(d) for d in shard_dims)
        except TypeError:
            raise ValueError(f"{name}: shard_dims must be a tuple of spatial dims, got {shard_dims!r}") from None
        top = 2 + self.spatial if self.spatial else None
        if (
            not dims
            or len(dims) > 2
            or len(set(dims)) != len(dims)
            or any(d < 2 for d in dims)
            or (top is not None and any(d >= top for d in dims))
        ):
            raise ValueError(
                f"{name}: shard_dims must be one or two distinct spatial dims of the input "
                f"(2..{top - 1 if top else 'ndim - 1'}), got {tuple(shard_dims)}"
            )
        self.shard_dims = dims
        mesh = self._bind_mesh(mesh, len(dims))
        self._groups = [mesh.get_group(i) for i in range(mesh.ndim)]

    def shard_specs(self):
        """Every parameter and buffer is replicated."""
        return {n: ShardSpec.replicated(t.shape) for n, t in chain(self.named_parameters(), self.named_buffers())}

    @classmethod
    def from_module(cls, m: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The twin of ``m`` (an ``nn`` module of exactly the twin's type), with ``m``'s
        parameters, buffers (running stats, ``num_batches_tracked``), ``requires_grad`` and mode."""
        if type(m) is not cls._nn:
            raise TypeError(f"{cls.__name__}.from_module expects an {cls._nn.__name__}, got {type(m).__name__}")
        like = next((t for t in chain(m.parameters(), m.buffers()) if t.is_floating_point()), None)
        kw = dict(device=like.device, dtype=like.dtype) if like is not None else {}
        if isinstance(m, nn.GroupNorm):
            new = cls(m.num_groups, m.num_channels, m.eps, m.affine, mesh=mesh, shard_dims=shard_dims, **kw)
        else:
            new = cls(
                m.num_features,
                m.eps,
                m.momentum,
                m.affine,
                m.track_running_stats,
                mesh=mesh,
                shard_dims=shard_dims,
                **kw,
            )
        new.load_state_dict(m.state_dict())
        for p, q in zip(new.parameters(), m.parameters()):
            p.requires_grad_(q.requires_grad)
        return new.train(m.training)

    def _check(self, x: torch.Tensor, channels: int) -> None:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if self.spatial is not None and x.dim() != 2 + self.spatial:
            raise ValueError(
                f"{name}: expected a {2 + self.spatial}-D input (N, C, *spatial), got shape {tuple(x.shape)}"
            )
        if x.dim() <= max(self.shard_dims):
            raise ValueError(
                f"{name}: shard_dims {self.shard_dims} need a {max(self.shard_dims) + 1}-D or larger "
                f"input, got shape {tuple(x.shape)}"
            )
        if x.size(1) != channels:
            raise ValueError(f"{name}: expected {channels} channels (dim 1), got shape {tuple(x.shape)}")

    def _stats(self, x, num_groups: int, per_channel: bool, on_stats=None):
        return DomainNormFn.apply(x, self.weight, self.bias, num_groups, per_channel, self.eps, self._groups, on_stats)

    def _per_pixel(self, x: torch.Tensor) -> torch.Tensor:
        """Eval with running stats: a per-pixel affine map; replicated parameter grads summed."""
        params = [p for p in (self.weight, self.bias) if p is not None]
        for group in self._groups:
            params = copy_many_to_parallel_region(params, group)
        w, b = params if params else (None, None)  # nn norms: affine means both weight and bias
        return F.batch_norm(x, self.running_mean, self.running_var, w, b, False, 0.0, self.eps)

    def _update(self, mean: torch.Tensor, var: torch.Tensor, factor: float) -> None:
        update_running(self.running_mean, self.running_var, mean, var, factor)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)`` (training statistics)."""
        n = len(self._groups)
        return ["all_gather (count, mean, M2)"] * n, ["all_reduce (stat sums + affine grads)"] * n

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shard_dims={self.shard_dims}"


class _DistributedBatchNorm(_DomainNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, self.num_features)
        if not (self.training or self.running_mean is None):
            return self._per_pixel(x)
        update = None
        if self.training and self.track_running_stats:

            def update(mean, var, _count):  # inside the statistics' forward (see DomainNormFn)
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self._update(mean, var, factor)

        return self._stats(x, x.size(1), True, update)[0]


class _DistributedInstanceNorm(_DomainNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, self.num_features)
        if not (self.training or not self.track_running_stats):
            return self._per_pixel(x)
        update = None
        if self.running_mean is not None:  # as F.instance_norm: the batch's instances averaged in

            def update(mean, var, _count):  # inside the statistics' forward (see DomainNormFn)
                self._update(mean.mean(0), var.mean(0), self.momentum if self.momentum is not None else 0.0)

        return self._stats(x, x.size(1), False, update)[0]


def _doc(nn_name: str, shape: str, ctor: str) -> str:
    running = (
        "\n        torch.testing.assert_close(norm.running_var, serial.running_var)  # unbiased, global count"
        if nn_name.startswith("BatchNorm")
        else ""
    )
    return f"""``nn.{nn_name}`` over a domain-sharded input: statistics over the whole domain.

    Same arguments, defaults, parameters, buffers and ``state_dict`` keys as ``nn.{nn_name}``,
    plus ``*, mesh=None, shard_dims=(2,)``. Build it directly or with ``from_module(m, mesh=...,
    shard_dims=...)`` (``DomainParallel`` does it for you).

    Args:
        ...: every argument of ``nn.{nn_name}``, same defaults.
        mesh: a 1-D mesh, or a 2-D one to shard two dims (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the dims of the ``(N, C, *spatial)`` input sharded over the mesh dims.

    Returns:
        ``forward(x)``: this rank's slice of the serial output (the input's partition); running
        stats updated exactly as the serial module's.

    Raises:
        ValueError: bad ``shard_dims``; in ``forward``, wrong dims or channels.
        TypeError: a non-tensor input; ``from_module`` of another module type.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = torch.nn.{ctor}
        norm = tplayers.Distributed{nn_name}.from_module(serial, mesh=mesh)
        x = torch.randn({shape})                                   # same on every rank
        y = tplayers.gather(norm(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x)){running}
    """


class DistributedBatchNorm1d(_DistributedBatchNorm, nn.BatchNorm1d):
    __doc__ = _doc("BatchNorm1d", "4, 3, 10", "BatchNorm1d(3)")
    spatial, _nn = 1, nn.BatchNorm1d


class DistributedBatchNorm2d(_DistributedBatchNorm, nn.BatchNorm2d):
    __doc__ = _doc("BatchNorm2d", "2, 3, 10, 6", "BatchNorm2d(3)")
    spatial, _nn = 2, nn.BatchNorm2d


class DistributedBatchNorm3d(_DistributedBatchNorm, nn.BatchNorm3d):
    __doc__ = _doc("BatchNorm3d", "2, 3, 8, 4, 4", "BatchNorm3d(3)")
    spatial, _nn = 3, nn.BatchNorm3d


class DistributedInstanceNorm1d(_DistributedInstanceNorm, nn.InstanceNorm1d):
    __doc__ = _doc("InstanceNorm1d", "2, 3, 10", "InstanceNorm1d(3, affine=True)")
    spatial, _nn = 1, nn.InstanceNorm1d


class DistributedInstanceNorm2d(_DistributedInstanceNorm, nn.InstanceNorm2d):
    __doc__ = _doc("InstanceNorm2d", "2, 3, 10, 6", "InstanceNorm2d(3, affine=True)")
    spatial, _nn = 2, nn.InstanceNorm2d


class DistributedInstanceNorm3d(_DistributedInstanceNorm, nn.InstanceNorm3d):
    __doc__ = _doc("InstanceNorm3d", "2, 3, 8, 4, 4", "InstanceNorm3d(3, affine=True)")
    spatial, _nn = 3, nn.InstanceNorm3d


class DistributedGroupNorm(_DomainNorm, nn.GroupNorm):
    __doc__ = _doc("GroupNorm", "2, 6, 10, 4", "GroupNorm(3, 6)")
    _nn = nn.GroupNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, self.num_channels)
        return self._stats(x, self.num_groups, False)[0]
