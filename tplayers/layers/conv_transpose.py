"""Domain-parallel transposed convolutions 1-D / 2-D / 3-D: the adjoint of a convolution.

A transposed convolution spreads each input row over ``d(k-1)+1`` output rows,
so each rank computes the local transposed convolution of its own rows (no input
halo) and the *partial* output rows that belong to a neighbour are sent to it
and added into its rows: the adjoint of the halo exchange
(:func:`tplayers.domain.window.scatter_add_windows`, whose backward is the
gather). Output rows follow docs/design.md (the partition rule): balanced unless the
length is kept; the bias is added once, on owned rows; weight and bias are replicated
and their gradients summed over the domain in backward
(:func:`~tplayers.comm.copy_many_to_parallel_region`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import copy_many_to_parallel_region
from tplayers.comm.buckets import region_params
from tplayers.domain.window import scatter_add_windows
from tplayers.layers._common import autocast_inputs
from tplayers.layers._domain import ConvParameters, DomainLayer, ntuple
from tplayers.window_plan import out_partition, plan_ranges, transposed_needs, transposed_out_len

__all__ = ["DistributedConvTranspose1d", "DistributedConvTranspose2d", "DistributedConvTranspose3d"]

_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _DistributedConvTransposeNd(ConvParameters, DomainLayer):
    _nn: type = nn.ConvTranspose2d
    bucketed_params = True  # inside a region call, the region's gradient buckets sum weight and bias

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        groups: int = 1,
        bias: bool = True,
        dilation=1,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
    ) -> None:
        super().__init__()
        name, n = type(self).__name__, self.spatial
        for arg, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) "
                f"must be divisible by groups ({groups})"
            )
        if padding_mode != "zeros":
            raise ValueError(
                f"{name}: only padding_mode='zeros' is supported (as in {self._nn.__name__}), got {padding_mode!r}"
            )
        self.in_channels, self.out_channels, self.groups, self.padding_mode = in_channels, out_channels, groups, "zeros"
        self.kernel_size = ntuple(kernel_size, n, "kernel_size", name)
        self.stride, self.dilation = ntuple(stride, n, "stride", name), ntuple(dilation, n, "dilation", name)
        self.padding = ntuple(padding, n, "padding", name)
        self.output_padding = ntuple(output_padding, n, "output_padding", name)
        if min(self.kernel_size + self.stride + self.dilation) < 1 or min(self.padding + self.output_padding) < 0:
            raise ValueError(f"{name}: kernel_size, stride, dilation must be >= 1 and padding, output_padding >= 0")
        for op, s, d in zip(self.output_padding, self.stride, self.dilation):
            if op >= s and op >= d:
                raise ValueError(
                    f"{name}: output_padding must be smaller than either stride or dilation, got "
                    f"output_padding {self.output_padding}, stride {self.stride}, dilation {self.dilation}"
                )
        self._init_domain(mesh, shard_dims)
        self._make_parameters(
            (in_channels, out_channels // groups) + self.kernel_size, out_channels, bias, device, dtype
        )

    @classmethod
    def from_module(cls, conv: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The domain-parallel twin of ``conv``, holding a copy of its parameters (build optimizers after)."""
        if type(conv) is not cls._nn:
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls._nn.__name__}, got {type(conv).__name__}")
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.output_padding,
            conv.groups,
            conv.bias is not None,
            conv.dilation,
            conv.padding_mode,
            device="meta",
            dtype=conv.weight.dtype,
            mesh=mesh,
            shard_dims=shard_dims,
        )
        layer = layer.to_empty(device=conv.weight.device)
        layer._copy_shards_from(conv)
        return layer

    def _config(self):
        return {
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": self.kernel_size,
            "stride": self.stride,
            "padding": self.padding,
            "output_padding": self.output_padding,
            "dilation": self.dilation,
            "groups": self.groups,
            "bias": self.bias is not None,
            "dtype": str(self.weight.dtype),
        }

    def _param_dtype(self):
        return self.weight

    def _build(self, shape, sizes: Dict[int, List[int]], like: torch.Tensor):
        name = type(self).__name__
        if shape[1] != self.in_channels:
            raise ValueError(f"{name}: input must have {self.in_channels} channels, got {shape[1]}")
        plans, own, part_shape, empty = {}, {}, [shape[0], self.out_channels], False
        for i in range(self.spatial):
            d = 2 + i
            k, s, dil, p, op = (
                self.kernel_size[i],
                self.stride[i],
                self.dilation[i],
                self.padding[i],
                self.output_padding[i],
            )
            length = sum(sizes[d]) if d in sizes else shape[d]
            out_len = transposed_out_len(length, k, s, dil, p, op)
            if out_len <= 0:
                raise ValueError(f"{name}: input dim {d} of {length} rows gives an output of {out_len} rows")
            if d in sizes:
                outs = out_partition(sizes[d], out_len)
                needs = transposed_needs(sizes[d], k, s, dil, p)
                what = f"dim {d} (mesh dim {self.shard_dims.index(d)})"
                plans[d] = plan_ranges(outs, needs, outs, mode="zeros", what=what)[self._coord(d)]
                own[d] = plans[d].out_rows
                rows = shape[d]
                empty = empty or rows == 0
                part_shape.append((rows - 1) * s + dil * (k - 1) + 1 if rows else 0)
            else:
                part_shape.append(out_len)
        pads = tuple(0 if 2 + i in sizes else p for i, p in enumerate(self.padding))
        out_pads = tuple(0 if 2 + i in sizes else p for i, p in enumerate(self.output_padding))
        return {d: plans[d] for d in self.shard_dims}, own, tuple(part_shape), empty, pads, out_pads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under torch.autocast: compute and communicate in the autocast dtype, as nn.ConvTransposeNd does
        (weight, bias), reduce = region_params(self.weight, self.bias)  # a region's buckets may sum the grads
        x, weight, bias = autocast_inputs(x, weight, bias)
        plans, own, part_shape, empty, pads, out_pads = self._layout(x, weight)  # checked on every rank first
        params = [p for p in (weight, bias) if p is not None]
        for group in self._groups if reduce else ():  # identity forward; backward: one all-reduce of their gradients
            params = copy_many_to_parallel_region(params, group)
        weight, bias = params[0], (params[1] if self.bias is not None else None)
        if empty:  # no input rows here: nothing to spread, but the same collectives as every rank
            part = self._tie(x.new_zeros(part_shape), x, weight)
        else:  # (N, C_in, *local rows) -> partial rows [a, b) of the output along each sharded dim
            part = _CONVT[self.spatial](x, weight, None, self.stride, pads, out_pads, self.groups, self.dilation)
        y = scatter_add_windows(part, plans, {d: self._group_of(d) for d in plans}, own)
        if bias is not None:
            y = y + bias.view([-1] + [1] * self.spatial)
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, output_padding={self.output_padding}, dilation={self.dilation}, "
            f"groups={self.groups}, bias={self.bias is not None}, shard_dims={self.shard_dims}"
        )


def _doc(n: int, example: str, dim: int) -> str:
    return f"""``nn.ConvTranspose{n}d`` on a spatially sharded input (every argument, same defaults, plus
    ``*, mesh=None, shard_dims=(2,)``), exact against the serial layer, gradients included.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
            dilation, padding_mode, device, dtype: as ``nn.ConvTranspose{n}d`` (``padding_mode``
            "zeros" only, as there). Weight and bias are replicated, their gradients summed.
        mesh: a 1-D mesh, or a 2-D one to shard two dims (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the dims of the ``(N, C, *spatial)`` input sharded over the mesh dims.

    Returns:
        ``forward(x)`` (no ``output_size``): this rank's rows of the serial output, from this
        rank's rows of the input (any partition); balanced (``tplayers.shard_sizes``) unless the
        length is kept.

    Raises:
        ValueError: bad arguments; in ``forward``, on every rank before any halo traffic: wrong
            channels / dims / dtype, shapes that differ in unsharded dims, ranks built differently.
        TypeError: ``from_module`` of another module type.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = {example}
        up = tplayers.DistributedConvTranspose{n}d.from_module(serial, mesh=mesh, shard_dims=({dim},))
        x = torch.randn(1, 4, {", ".join(["6"] * n)})                # same on every rank
        y = tplayers.gather(up(tplayers.shard(x, {dim}, mesh)), {dim}, mesh)
        torch.testing.assert_close(y, serial(x))
    """


class DistributedConvTranspose1d(_DistributedConvTransposeNd):
    __doc__ = _doc(1, "torch.nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1, output_padding=1)", 2)
    spatial, _nn = 1, nn.ConvTranspose1d


class DistributedConvTranspose2d(_DistributedConvTransposeNd):
    __doc__ = _doc(2, "torch.nn.ConvTranspose2d(4, 2, 2, stride=2)", 2)
    spatial, _nn = 2, nn.ConvTranspose2d


class DistributedConvTranspose3d(_DistributedConvTransposeNd):
    __doc__ = _doc(3, "torch.nn.ConvTranspose3d(4, 2, 3, stride=2, padding=1)", 3)
    spatial, _nn = 3, nn.ConvTranspose3d
