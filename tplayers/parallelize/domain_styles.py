"""The domain (spatial) parallel style: swap spatial layers for their twins, sum replicated gradients."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._common import ShardedModule
from tplayers.layers.attention import NeighborhoodAttention
from tplayers.layers.conv import DistributedConv2d
from tplayers.layers.replicated import DomainReplicated
from tplayers.parallelize.styles import ParallelStyle

__all__ = ["DomainParallel"]


# Spatial layers that DomainParallel leaves alone: each would need a halo (or a global
# reduction) to be exact on a shard. Listed so a plan says so instead of silently differing.
_SPATIAL_MIXERS = (
    nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.LPPool2d,
    nn.ConvTranspose2d, nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d, nn.LocalResponseNorm,
)


@dataclass(frozen=True)
class DomainParallel(ParallelStyle):
    """Domain (spatial) parallelism: swap ``nn.Conv2d`` for :class:`~tplayers.DistributedConv2d`
    sharding ``shard_dims`` ((2,) = H over a 1-D mesh, (2, 3) = H and W over a 2-D mesh), and a
    single-device :class:`~tplayers.NeighborhoodAttention` for its domain-parallel twin over the
    same spatial axes (``shard_dims`` name NCHW dims; in its ``(B, H, W, C)`` input H is dim 1,
    W dim 2).

    Matched on an ``nn.Conv2d`` (type key or regex) it swaps that layer; matched on
    any other module (e.g. the root ``""``) it swaps every ``nn.Conv2d`` inside.
    Then, once per plan, every other module that owns replicated parameters
    (``nn.Linear``, channel norms, custom ``nn.Parameter``s; not the sharded twins) is
    wrapped in :class:`~tplayers.DomainReplicated`, whose forward routes those
    parameters through an all-reduce-in-backward Function. So every ``.grad`` of
    the swapped model equals the serial model's, and ``state_dict`` keys are
    unchanged. Only per-pixel layers are exact: norms over H/W see one shard.

    Example (``torchrun --nproc-per-node 2``)::

        model = tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2,))})
        y = model(tplayers.shard(x, 2))        # this rank's rows in, this rank's rows out
    """

    shard_dims: Tuple[int, ...] = (2,)
    accepts = (nn.Module,)

    def build(self, name, module, mesh):
        mixers = [f"{name + '.' if name else ''}{n} ({type(m).__name__})"
                  for n, m in module.named_modules() if isinstance(m, _SPATIAL_MIXERS)]
        if mixers:
            warnings.warn(
                "DomainParallel swaps nn.Conv2d and NeighborhoodAttention only; these layers mix "
                "neighbouring pixels or pool over H/W and run on each shard alone, exact only where "
                "their windows never cross a shard boundary: " + ", ".join(mixers),
                stacklevel=3,
            )
        return self._swap(module, mesh)

    def _swap(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Conv2d):
            return DistributedConv2d.from_module(module, mesh=mesh, shard_dims=self.shard_dims)
        if isinstance(module, NeighborhoodAttention) and module.shard_dims is None:
            # same spatial axes, in its (B, H, W, C) layout: NCHW dim 2 (H) -> 1, dim 3 (W) -> 2
            return NeighborhoodAttention.from_module(module, mesh=mesh, shard_dims=tuple(d - 1 for d in self.shard_dims))
        for child_name, child in list(module.named_children()):
            new = self._swap(child, mesh)
            if new is not child:
                setattr(module, child_name, new)
        return module

    def finalize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return _wrap_replicated(model, mesh)


def _wrap_replicated(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Wrap (bottom-up) every module owning direct parameters that no layer shards or sums."""
    if isinstance(module, (ShardedModule, DomainReplicated)):
        return module
    for child_name, child in list(module.named_children()):
        new = _wrap_replicated(child, mesh)
        if new is not child:
            setattr(module, child_name, new)
    if next(module.parameters(recurse=False), None) is not None:
        return DomainReplicated(module, mesh)
    return module


