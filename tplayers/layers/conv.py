"""Domain-parallel convolutions 1-D / 2-D / 3-D: the input is split spatially, the result is exact.

``DistributedConv1d/2d/3d`` take every ``nn.ConvNd`` argument (same defaults) plus
``mesh``, ``shard_dims`` (dims of the ``(N, C, *spatial)`` input; one per mesh
dim, e.g. ``(2,)`` = L / H / D, ``(2, 3)`` over a 2-D mesh) and
``memory_format`` (the local convolution's layout; the output keeps ``nn.ConvNd``'s, see
:func:`serial_format`). Input and output are plain local tensors, this rank's slice
along the sharded dims; gathering the outputs gives ``nn.ConvNd`` on the
gathered input, and every gradient matches.

Each is a thin twin over the window-op core: the axis plan
(:func:`tplayers.window_plan.plan_windows`, output rows partitioned by the
The partition rule (docs/design.md, the partition rule): "same" convolutions keep the input's partition, others give the
balanced one), the N-d halo exchange (:mod:`tplayers.domain.window`) for all but
the last sharded dim, and :func:`~tplayers.layers.conv.halo_conv` fusing the last dim's
exchange with the convolution by one of two strategies, chosen per layout here. Main-plus-strips
(the convolution of the local input itself, padded by the halo width, while the halo flies, plus
thin strips for the halo rows; no halo-padded copy, the same messages) where every shard's plan is
a zero-padded "same"-like one (:func:`~tplayers.window_plan.uniform_geometry`, so every rank agrees)
and either the slab is large (:data:`EDGE_MIN_ELEMENTS`), ``overlap_halo=True``, or no halo is
needed at all (padding 0 along the last sharded dim and every window inside its shard: a one-pixel
convolution, patches aligned with the shards; the local input is convolved and saved as it is); else
halo-padded (exchange, then one convolution; its backward overlaps the parameter-gradient sum with
the adjoint halo messages), which is faster on small slabs on the CPU with gloo, where the strips'
extra calls cost more than the copy saves (``benchmarks/conv_halo.py`` times both).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.buckets import region_params
from tplayers.domain.window import gather_rows
from tplayers.layers._common import autocast_inputs
from tplayers.layers._conv_fn import ConvSpec, conv_order
from tplayers.layers._conv_run import _CL, _prepare, halo_conv, serial_format
from tplayers.layers._domain import ConvParameters, DomainLayer, ntuple
from tplayers.window_plan import PADDING_MODES, conv_out_len, conv_window, plan_windows, uniform_geometry

__all__ = ["DistributedConv1d", "DistributedConv2d", "DistributedConv3d"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# The main-plus-strips strategy's fixed cost is four to six thin convolution calls per step (the strips);
# its gain, the halo-padded copy of the slab not made and the exchange hidden, grows with the slab.
# Slabs (elements per rank, on average) at least this large take it by default (``overlap_halo=True``:
# at any size); the measurements behind the threshold are in benchmarks/RESULTS.md (conv_halo).
EDGE_MIN_ELEMENTS = 1 << 21


class _DistributedConvNd(ConvParameters, DomainLayer):
    """Shared body of ``DistributedConv1d/2d/3d`` (see the module doc)."""

    _nn: type = nn.Conv2d
    bucketed_params = True  # inside a region call, the region's gradient buckets sum weight and bias

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
        memory_format: Optional[torch.memory_format] = None,
        overlap_halo: bool = False,
    ) -> None:
        super().__init__()
        self.overlap_halo = bool(overlap_halo)
        name, n = type(self).__name__, self.spatial
        for arg, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) "
                f"must be divisible by groups ({groups})"
            )
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"{name}: padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = ntuple(kernel_size, n, "kernel_size", name)
        self.stride, self.dilation = ntuple(stride, n, "stride", name), ntuple(dilation, n, "dilation", name)
        if min(self.kernel_size + self.stride + self.dilation) < 1:
            raise ValueError(
                f"{name}: kernel_size, stride and dilation must be >= 1, got "
                f"{self.kernel_size}, {self.stride}, {self.dilation}"
            )
        self.padding, self.padding_mode = padding, padding_mode
        self._pads = self._resolve_padding(padding)
        if memory_format not in (None, torch.channels_last, torch.contiguous_format, torch.channels_last_3d):
            raise ValueError(
                f"{name}: memory_format must be None, torch.channels_last or torch.contiguous_format, "
                f"got {memory_format}"
            )
        # None: per call, the layout nn.ConvNd would give the output (no layout conversion at all)
        self.memory_format = (
            memory_format if memory_format in (None, torch.contiguous_format) else _CL.get(n, torch.contiguous_format)
        )
        self._init_domain(mesh, shard_dims)
        self._make_parameters(
            (out_channels, in_channels // groups) + self.kernel_size, out_channels, bias, device, dtype
        )

    def _resolve_padding(self, padding) -> Tuple[Tuple[int, int], ...]:
        """(lo, hi) input padding per spatial dim, as ``nn.ConvNd`` applies it."""
        name, n = type(self).__name__, self.spatial
        if isinstance(padding, str):
            if padding == "valid":
                return ((0, 0),) * n
            if padding != "same":
                raise ValueError(f"{name}: padding must be 'same', 'valid', an int or a tuple, got {padding!r}")
            if any(s != 1 for s in self.stride):
                raise ValueError(f"{name}: padding='same' needs stride 1, got {self.stride}")
            totals = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
            return tuple((t // 2, t - t // 2) for t in totals)
        pads = ntuple(padding, n, "padding", name)
        if min(pads) < 0:
            raise ValueError(f"{name}: padding must be >= 0, got {padding!r}")
        return tuple((p, p) for p in pads)

    @classmethod
    def from_module(
        cls,
        conv: nn.Module,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
        memory_format: Optional[torch.memory_format] = None,
        overlap_halo: bool = False,
    ):
        """The domain-parallel twin of ``conv``, holding a copy of its parameters.

        Build optimizers after swapping: the new parameters are new objects.
        """
        if type(conv) is not cls._nn:
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls._nn.__name__}, got {type(conv).__name__}")
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
            conv.bias is not None,
            conv.padding_mode,
            device="meta",
            dtype=conv.weight.dtype,
            mesh=mesh,
            shard_dims=shard_dims,
            memory_format=memory_format,
            overlap_halo=overlap_halo,
        )
        layer = layer.to_empty(device=conv.weight.device)
        layer._copy_shards_from(conv)
        return layer

    # ------------------------------------------------------------------ layout
    def _config(self):
        return {
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": self.kernel_size,
            "stride": self.stride,
            "padding": self._pads,
            "dilation": self.dilation,
            "groups": self.groups,
            "bias": self.bias is not None,
            "padding_mode": self.padding_mode,
            "memory_format": str(self.memory_format),
            "dtype": str(self.weight.dtype),
            "overlap_halo": self.overlap_halo,
        }

    def _param_dtype(self):
        return self.weight

    def _build(self, shape, sizes: Dict[int, List[int]], like: torch.Tensor):
        name = type(self).__name__
        if shape[1] != self.in_channels:
            raise ValueError(f"{name}: input must have {self.in_channels} channels, got {shape[1]}")
        plans, every, out_shape = {}, {}, [shape[0], self.out_channels]
        for i in range(self.spatial):
            d = 2 + i
            k, s, dil, pad = self.kernel_size[i], self.stride[i], self.dilation[i], self._pads[i]
            length = sum(sizes[d]) if d in sizes else shape[d]
            what = f"dim {d}" + (f" (mesh dim {self.shard_dims.index(d)})" if d in sizes else "")
            if self.padding_mode != "zeros" and max(pad) > length - (self.padding_mode == "reflect"):
                raise ValueError(
                    f"{name}: padding {pad} along {what} is too large for {self.padding_mode!r} "
                    f"padding of {length} rows"
                )
            out_len = conv_out_len(length, k, s, dil, pad)
            if out_len <= 0:
                raise ValueError(
                    f"{name}: input {what} of {length} rows is smaller than the (dilated) kernel "
                    f"extent {dil * (k - 1) + 1} with padding {pad}"
                )
            if d in sizes:
                every[d] = plan_windows(
                    sizes[d], out_len, conv_window(k, s, dil, pad[0]), mode=self.padding_mode, what=what
                )
                plans[d] = every[d][self._coord(d)]
                out_shape.append(plans[d].out_rows)
            else:
                out_shape.append(out_len)
        last = self.shard_dims[-1]
        conv_pad, extra = [], []
        for i in range(self.spatial):
            lo, hi = self._pads[i]
            if 2 + i in sizes or (self.padding_mode == "zeros" and lo == hi):
                conv_pad.append(0 if 2 + i in sizes else lo)  # sharded: padded by the plan
            else:
                conv_pad.append(0)
                extra.append((2 + i, lo, hi))
        # the main-plus-strips strategy where every shard's plan allows it and the slab is large (or overlap_halo);
        # with no halo at all (padding 0 and windows inside every shard: no strips) on any slab, as it copies nothing
        i = last - 2
        slab = math.prod(shape[:2]) * math.prod(sum(sizes[d]) if d in sizes else shape[d] for d in range(2, len(shape)))
        strips, zero_padded = None, self.padding_mode == "zeros" and not extra and self._pads[i][0] == self._pads[i][1]
        no_halo = tuple(self._pads[i]) == (0, 0)
        if self.overlap_halo or no_halo or slab // math.prod(len(sizes[d]) for d in sizes) >= EDGE_MIN_ELEMENTS:
            strips = uniform_geometry(
                every[last],
                sizes[last],
                self._coord(last),
                self._pads[i][0],
                self.dilation[i] * (self.kernel_size[i] - 1) + 1,
                self.stride[i],
                zero_padded,
            )
        spec = ConvSpec(
            halo_dim=last,
            halo_group=self._group_of(last),
            plan=plans[last],
            periodic=self.padding_mode == "circular",
            memory_format=torch.contiguous_format,
            out_format=torch.contiguous_format,
            pad_and_trim=functools.partial(
                _prepare, dim=last, plan=plans[last], mode=self.padding_mode, extra=tuple(extra)
            ),
            skip_pad_and_trim=not extra and plans[last].boundary == (0, 0) and plans[last].trim == (0, 0),
            conv_fn=_CONV[self.spatial],
            stride=self.stride,
            padding=tuple(conv_pad),
            dilation=self.dilation,
            groups=self.groups,
            out_shape=tuple(out_shape),
            reduce_groups=tuple(self._groups),
            spatial_order=conv_order(tuple(shape), like),
            strips=strips,
        )
        # one spec per (convolution layout, output layout): the layout is chosen per call from the input
        formats = (torch.contiguous_format,) + ((_CL[self.spatial],) if self.spatial > 1 else ())
        specs = {(f, o): dataclasses.replace(spec, memory_format=f, out_format=o) for f in formats for o in formats}
        return {d: plans[d] for d in self.shard_dims[:-1]}, spec, specs  # spec: the plain-layout one

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (weight, bias), reduce = region_params(self.weight, self.bias)  # a region's buckets may sum the grads
        return self.convolve(x, weight, bias, reduce)

    def convolve(self, x: torch.Tensor, weight, bias, reduce: bool = True) -> torch.Tensor:
        """This layer's convolution of ``x`` by ``weight`` / ``bias`` of its shapes (a computed weight:
        the region guard's functional ``F.conv*d``); ``reduce=False`` leaves their gradients partial."""
        # under torch.autocast: compute (and exchange halos) in the autocast dtype, as nn.ConvNd does
        x, weight, bias = autocast_inputs(x, weight, bias)
        first, _, specs = self._layout(x, weight)  # validated on every rank before any halo traffic
        out_format = serial_format(x, weight, self.spatial, self.padding_mode)  # the output's layout is nn.ConvNd's
        spec = specs[(out_format if self.memory_format is None else self.memory_format, out_format)]
        for d, plan in first.items():  # a 2-D mesh: the first dim's exchange, corners ride on the next
            x = gather_rows(x, d, self._group_of(d), plan, self.padding_mode, memory_format=spec.memory_format)
        # (N, C_in, *local rows) -> (N, C_out, *owned output rows), by the spec's strategy
        return halo_conv(x, weight, bias, spec, reduce)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)`` (the same for both strategies)."""
        halo = [f"halo send/recv (dim {d})" for d in self.shard_dims]
        return halo, halo + ["all_reduce (weight+bias grads)"] * len(self.shard_dims)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding!r}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None}, padding_mode={self.padding_mode!r}, shard_dims={self.shard_dims}"
        )


class DistributedConv1d(_DistributedConvNd):
    """``nn.Conv1d`` on an input sharded along L (``shard_dims=(2,)``), exact against the serial layer.

    Args, shapes, returns and raises as :class:`DistributedConv2d`, with ``nn.Conv1d``'s arguments
    and a (N, C_in, L_local) input whose sharded dims are local.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = torch.nn.Conv1d(3, 8, 5, padding=2, padding_mode="reflect")
        conv = tplayers.DistributedConv1d.from_module(serial, mesh=mesh)
        x = torch.randn(2, 3, 40)                            # same on every rank
        y = tplayers.gather(conv(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x))
    """

    spatial, _nn = 1, nn.Conv1d


class DistributedConv2d(_DistributedConvNd):
    """``nn.Conv2d`` on a spatially sharded input (H, W or both), exact against the serial layer.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode, device, dtype: as ``nn.Conv2d`` (``padding_mode``: "zeros", "circular"
            for a periodic domain, "reflect", "replicate").
        mesh: a 1-D mesh, or a 2-D one for two sharded dims (default: ``tplayers.default_mesh``).
        shard_dims: the sharded tensor dims, one per mesh dim (``(2,)``: H; ``(2, 3)``: H and W).
        memory_format: keyword; the layout the local convolution runs in. ``None`` (default)
            convolves in the input's layout; ``torch.channels_last`` / ``torch.contiguous_format``
            force it and convert the output back when it differs (one copy).
        overlap_halo: keyword, default ``False``; overlap the halo exchange with compute wherever
            possible: the main-plus-strips strategy (the messages in flight while the local input
            itself is convolved, then thin strips holding the halo rows added into the edge rows;
            backward likewise) for every zero-padded "same"-like plan (any stride, dilation, groups,
            uneven partitions; decided from every shard's plan, so every rank agrees), the halo-padded
            one elsewhere and while compiling. By default only slabs of at least
            ``EDGE_MIN_ELEMENTS`` elements per rank take main-plus-strips, and convolutions that need
            no halo (a one-pixel kernel, patches aligned with the shards), which then convolve and
            save the local input itself, no padded copy. Same values either way.

    Shapes: ``weight`` ``(out_channels, in_channels // groups, kH, kW)`` and ``bias`` are replicated,
    their gradients summed over the domain; input ``(N, C_in, H_local, W_local)`` (this rank's slice
    of the sharded dims, any partition whose shards can supply the halos).

    Returns:
        This rank's rows of the serial output: partitioned like the input when the length is kept,
        else balanced (``tplayers.shard_sizes``); in the layout ``nn.Conv2d`` gives for the same input
        (contiguous in, contiguous out; channels_last in, channels_last out). Under ``torch.autocast``
        it computes in the autocast dtype, as ``nn.Conv2d`` does.

    Raises:
        ValueError: bad arguments (``padding="same"`` with a stride other than 1, a padding too
            large for a non-zero ``padding_mode``, bad ``shard_dims``); on every rank, before any
            halo traffic: a partition whose shards cannot supply their neighbours' halos, ranks whose
            layers or inputs differ (the field and the ranks are named).
        TypeError: ``from_module`` of a module that is not an ``nn.Conv2d``.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular")
        conv = tplayers.DistributedConv2d.from_module(serial, mesh=mesh, shard_dims=(2,))
        x = torch.randn(2, 3, 32, 16)                        # same on every rank
        y = tplayers.gather(conv(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x))
    """

    spatial, _nn = 2, nn.Conv2d


class DistributedConv3d(_DistributedConvNd):
    """``nn.Conv3d`` on an input sharded along D, H or W (or two of them on a 2-D mesh).

    Args, shapes, returns and raises as :class:`DistributedConv2d`, with ``nn.Conv3d``'s arguments
    and a (N, C_in, D, H, W) input whose sharded dims are local.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = torch.nn.Conv3d(2, 4, 3, stride=2, padding=1)
        conv = tplayers.DistributedConv3d.from_module(serial, mesh=mesh, shard_dims=(3,))   # H
        x = torch.randn(1, 2, 8, 12, 10)                     # same on every rank
        y = tplayers.gather(conv(tplayers.shard(x, 3, mesh)), 3, mesh)
        torch.testing.assert_close(y, serial(x))
    """

    spatial, _nn = 3, nn.Conv3d
