"""The domain (spatial) parallel style: swap spatial layers for their twins, sum replicated gradients.

:data:`DOMAIN_TWINS` is the one table from ``nn`` module types to their domain-parallel twins
(each with ``from_module(m, mesh=..., shard_dims=...)``). :data:`SPATIAL_MIXERS_WITHOUT_TWIN`
lists the module types that mix spatial positions and have no twin: inside a domain region
they raise ``ValueError`` (all of them listed), never run silently local.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers.layers as L
from tplayers.layers._common import ShardedModule
from tplayers.layers.neighborhood_attention import NeighborhoodAttention
from tplayers.parallelize.conv_subclasses import same_padding_twin
from tplayers.parallelize.reparam import base_type, is_reparametrized, swap_reparametrized
from tplayers.parallelize.styles import ParallelStyle
from tplayers.region.members import bind_region, region_of

__all__ = ["DomainParallel", "DOMAIN_TWINS", "SPATIAL_MIXERS_WITHOUT_TWIN"]

#: nn type -> domain-parallel twin (matched by exact type; nn.Upsample also covers its subclasses)
DOMAIN_TWINS: Dict[type, type] = {
    nn.Conv1d: L.DistributedConv1d,
    nn.Conv2d: L.DistributedConv2d,
    nn.Conv3d: L.DistributedConv3d,
    nn.ConvTranspose1d: L.DistributedConvTranspose1d,
    nn.ConvTranspose2d: L.DistributedConvTranspose2d,
    nn.ConvTranspose3d: L.DistributedConvTranspose3d,
    nn.MaxPool1d: L.DistributedMaxPool1d,
    nn.MaxPool2d: L.DistributedMaxPool2d,
    nn.MaxPool3d: L.DistributedMaxPool3d,
    nn.AvgPool1d: L.DistributedAvgPool1d,
    nn.AvgPool2d: L.DistributedAvgPool2d,
    nn.AvgPool3d: L.DistributedAvgPool3d,
    nn.AdaptiveAvgPool1d: L.DistributedAdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d: L.DistributedAdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d: L.DistributedAdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d: L.DistributedAdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d: L.DistributedAdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d: L.DistributedAdaptiveMaxPool3d,
    nn.Upsample: L.DistributedUpsample,
    nn.UpsamplingNearest2d: L.DistributedUpsample,
    nn.UpsamplingBilinear2d: L.DistributedUpsample,
    nn.BatchNorm1d: L.DistributedBatchNorm1d,
    nn.BatchNorm2d: L.DistributedBatchNorm2d,
    nn.BatchNorm3d: L.DistributedBatchNorm3d,
    nn.GroupNorm: L.DistributedGroupNorm,
    nn.InstanceNorm1d: L.DistributedInstanceNorm1d,
    nn.InstanceNorm2d: L.DistributedInstanceNorm2d,
    nn.InstanceNorm3d: L.DistributedInstanceNorm3d,
}

#: modules that mix spatial positions and have no twin (yet): an error inside a domain region
SPATIAL_MIXERS_WITHOUT_TWIN: Tuple[type, ...] = (
    nn.FractionalMaxPool2d,
    nn.FractionalMaxPool3d,
    nn.LPPool1d,
    nn.LPPool2d,
    getattr(nn, "LPPool3d", nn.LPPool2d),
    nn.MaxUnpool1d,
    nn.MaxUnpool2d,
    nn.MaxUnpool3d,
    nn.LocalResponseNorm,
    nn.CrossMapLRN2d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.LazyConv1d,
    nn.LazyConv2d,
    nn.LazyConv3d,
    nn.LazyConvTranspose1d,
    nn.LazyConvTranspose2d,
    nn.LazyConvTranspose3d,
    nn.Fold,
    nn.Unfold,
)  # padding layers (every mode) and pixel (un)shuffle are run by the region guard (tplayers.region)


def _twin_of(module: nn.Module):
    twin = DOMAIN_TWINS.get(base_type(module))
    if twin is None and isinstance(module, nn.Upsample):
        twin = L.DistributedUpsample
    return twin


@dataclass(frozen=True)
class DomainParallel(ParallelStyle):
    """Domain (spatial) parallelism: every module of the matched subtree that has a twin in
    :data:`DOMAIN_TWINS` (Conv, ConvTranspose, MaxPool, AvgPool, AdaptiveAvgPool, AdaptiveMaxPool
    1-3d, Upsample, BatchNorm, GroupNorm, InstanceNorm) is swapped for it, sharding ``shard_dims``;
    a single-device :class:`~tplayers.NeighborhoodAttention` becomes its domain-parallel twin over
    the same axes (in its ``(B, H, W, C)`` input H is dim 1, W dim 2).

    Every call of the region then runs under the region guard (:mod:`tplayers.region.guard`): ops
    a ``forward`` applies to sharded data outside the twins (``F.interpolate``, ``x.mean((2, 3))``,
    attention over pixels, a per-pixel ``Linear``) are run locally where that is exact, routed to
    their distributed form, or refused with a ``ValueError``; replicated parameters get their
    gradients summed where they meet sharded data. Matched on a container, the region is that
    subtree; the model's own ``forward`` around it is watched too. See docs/design.md (the region
    guard).

    Args:
        shard_dims: dims of the ``(N, C, *spatial)`` input sharded over the mesh dims: ``(2,)`` =
            L / H / D over a 1-D mesh, ``(2, 3)`` over a 2-D mesh.
        input_dims: the sharded dims of the region's first tensor argument, if not ``shard_dims``
            (default: ``shard_dims``, or ``shard_dims - 1`` when the region's only twins are
            neighborhood attentions, whose models take ``(B, H, W, C)``).

    Raises:
        ValueError: (from :func:`~tplayers.parallelize_module`, before anything is swapped) the
            subtree holds modules that mix spatial positions and have no twin
            (:data:`SPATIAL_MIXERS_WITHOUT_TWIN`: FractionalMaxPool, LPPool, MaxUnpool,
            SyncBatchNorm, lazy norms and convolutions, LocalResponseNorm, Fold, Unfold), all of them listed; at call
            time, on every rank, an op the guard can neither prove exact nor route.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(8, 4, 3, padding=1))
        model = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))},
                                            mesh=mesh)
        x = torch.randn(2, 3, 16, 12)
        y = model(tplayers.shard(x, 2, mesh))             # this rank's rows in, this rank's rows out
        torch.testing.assert_close(tplayers.gather(y, 2, mesh), serial(x))
    """

    shard_dims: Tuple[int, ...] = (2,)
    #: dims of the region's first tensor argument that are sharded (mesh dim i shards input_dims[i]);
    #: None: ``shard_dims`` (NCHW), or ``shard_dims - 1`` when the region's only twins are
    #: NeighborhoodAttention, whose models take ``(B, H, W, C)``
    input_dims: Optional[Tuple[int, ...]] = None
    accepts = (nn.Module,)
    # region roots built by this plan (container matches), consumed by finalize
    _regions: List[nn.Module] = field(default_factory=list, compare=False, repr=False)

    def build(self, name, module, mesh):
        mixers = [
            f"{name + '.' if name else ''}{n} ({type(m).__name__})"
            for n, m in module.named_modules(remove_duplicate=False)
            if isinstance(m, SPATIAL_MIXERS_WITHOUT_TWIN) and _twin_of(m) is None
        ]
        if mixers:
            raise ValueError(
                "DomainParallel: these modules mix spatial positions and have no domain-parallel twin, so "
                "they would run on each shard alone and differ from the serial model: "
                + ", ".join(mixers)
                + ". Replace them (or keep them outside the DomainParallel region)"
            )
        new = self._swap(module, mesh)
        if new is module:  # a container: the region is exactly this subtree, guarded on every call
            bind_region(new, mesh, self._input_dims(new), name)
            self._regions.append(new)
        return new

    def _swap(self, module: nn.Module, mesh: DeviceMesh, done=None) -> nn.Module:
        # done: {id(child): (child, its replacement)}, so a module reachable under several names in
        # the region (``self.up2 = self.up1``, a reused block) gets one twin under all of them
        done = {} if done is None else done
        if isinstance(module, L.ReplicatedBranch):  # a declared replicated branch: bound, contents untouched
            return module if module.mesh is not None else L.ReplicatedBranch(module.module, mesh)
        twin = _twin_of(module)
        spatial = getattr(twin, "spatial", None)
        if (
            twin is not None
            and spatial is not None
            and (max(self.shard_dims) >= 2 + spatial or min(self.shard_dims) < 2)
        ):
            # cannot hold these sharded dims (a BatchNorm1d in a 2-D head, a channels-last region's
            # (N, X, Y, C) input): the guard checks its ops (a 1x1 conv is per pixel, a wider one refused)
            return module
        if twin is not None and is_reparametrized(module):  # spectral / weight norm: the same machinery on the twin
            return swap_reparametrized(
                module, lambda plain: twin.from_module(plain, mesh=mesh, shard_dims=self.shard_dims)
            )
        if twin is None and not is_reparametrized(module):  # a conv subclass padding to TF "SAME" (timm Conv2dSame)
            twin = same_padding_twin(module)
        if twin is not None:
            new = twin.from_module(module, mesh=mesh, shard_dims=self.shard_dims)
            new.attach_serial(module)  # runs the serial module where the data is replicated (a pooled SE branch)
            return new
        if isinstance(module, NeighborhoodAttention) and module.shard_dims is None:
            # same spatial axes, in its (B, *spatial, C) layout: NC* dim 2 -> 1, dim 3 -> 2 (1-D, 2-D, 3-D)
            return type(module).from_module(module, mesh=mesh, shard_dims=tuple(d - 1 for d in self.shard_dims))
        for child_name, child in list(module._modules.items()):  # every name (named_children lists an alias once)
            if child is None:
                continue
            if id(child) not in done:
                done[id(child)] = (child, self._swap(child, mesh, done))
            new = done[id(child)][1]
            if new is not child:
                setattr(module, child_name, new)
        return module

    def finalize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        regions, self._regions[:] = list(self._regions), []
        if any(any(m is r for m in model.modules()) for r in regions):
            # container regions were bound in build; the model around them is a region too (its input is
            # this rank's slice when it has the sharded dims): modules outside the containers stay serial,
            # and every op on sharded data there (a leaf twin, a per-pixel conv, the head's pooling) is
            # exact, routed or refused as inside
            if not any(r is model for r in regions) and region_of(model) is None:
                bind_region(model, mesh, self._input_dims(model), "", outer=True)
            return model
        # only leaf layers matched (e.g. a type key {nn.Conv2d: ...}): the whole model is the region,
        # unless the model is itself one twin (exact by itself)
        if not isinstance(model, ShardedModule):
            bind_region(model, mesh, self._input_dims(model), "")
        return model

    def _input_dims(self, region: nn.Module) -> Tuple[int, ...]:
        if self.input_dims is not None:
            return tuple(self.input_dims)
        twins = [m for m in region.modules() if isinstance(m, ShardedModule)]
        if twins and all(isinstance(m, NeighborhoodAttention) for m in twins):
            return tuple(d - 1 for d in self.shard_dims)
        return tuple(self.shard_dims)
