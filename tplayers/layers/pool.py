"""Domain-parallel max and average pooling, 1-D / 2-D / 3-D, exact against the serial modules.

Thin twins over the window-op core: each sharded dim's plan (window
``o*s - p + [0, d(k-1)]``, output rows balanced unless the length is kept), the
N-d halo exchange with boundary rows padded locally (``-inf`` for max pooling,
zeros for average pooling), then the local pooling with no padding along the
sharded dims. Average pooling sums windows (``divisor_override=1``) and divides
by the serial divisor of each output position (``count_include_pad``,
``ceil_mode`` windows clipped at ``L + padding``, ``divisor_override``), computed
once per layout from global positions.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.domain.window import gather_windows
from tplayers.layers._domain import DomainLayer, ntuple
from tplayers.window_plan import conv_window, plan_windows, pool_out_len

__all__ = [
    "DistributedMaxPool1d",
    "DistributedMaxPool2d",
    "DistributedMaxPool3d",
    "DistributedAvgPool1d",
    "DistributedAvgPool2d",
    "DistributedAvgPool3d",
]

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


class _PoolNd(DomainLayer):
    """Shared layout of the pooling twins."""

    _nn: type = nn.MaxPool2d
    _fill, _mode, _dilated = float("-inf"), "fill", True

    def _setup(self, kernel_size, stride, padding, dilation, ceil_mode, mesh, shard_dims) -> None:
        name, n = type(self).__name__, self.spatial
        self.kernel_size = ntuple(kernel_size, n, "kernel_size", name)
        self.stride = ntuple(stride if stride is not None else kernel_size, n, "stride", name)
        self.padding, self.dilation = ntuple(padding, n, "padding", name), ntuple(dilation, n, "dilation", name)
        if min(self.kernel_size + self.stride + self.dilation) < 1 or min(self.padding) < 0:
            raise ValueError(
                f"{name}: kernel_size, stride, dilation must be >= 1 and padding >= 0, got "
                f"{self.kernel_size}, {self.stride}, {self.dilation}, {self.padding}"
            )
        for k, p, d in zip(self.kernel_size, self.padding, self.dilation):
            half = ((k - 1) * d + 1) // 2 if self._dilated else k // 2
            if p > half:
                raise ValueError(
                    f"{name}: padding should be at most half of the (effective) kernel size, got "
                    f"padding {self.padding} for kernel_size {self.kernel_size}"
                )
        self.ceil_mode = bool(ceil_mode)
        self._init_domain(mesh, shard_dims)

    def _config(self):
        return {
            "kernel_size": self.kernel_size,
            "stride": self.stride,
            "padding": self.padding,
            "dilation": self.dilation,
            "ceil_mode": self.ceil_mode,
        }

    def _build(self, shape, sizes: Dict[int, List[int]], like: torch.Tensor):
        plans, out_shape = {}, list(shape[:2])
        for i in range(self.spatial):
            d = 2 + i
            k, s, dil, p = self.kernel_size[i], self.stride[i], self.dilation[i], self.padding[i]
            length = sum(sizes[d]) if d in sizes else shape[d]
            what = f"dim {d}" + (f" (mesh dim {self.shard_dims.index(d)})" if d in sizes else "")
            out_len = pool_out_len(length, k, s, dil, p, self.ceil_mode)
            if out_len <= 0:
                raise ValueError(
                    f"{type(self).__name__}: input {what} of {length} rows gives an empty output "
                    f"(kernel {k}, stride {s}, padding {p}, dilation {dil})"
                )
            if d in sizes:
                plans[d] = plan_windows(sizes[d], out_len, conv_window(k, s, dil, p), mode=self._mode, what=what)[
                    self._coord(d)
                ]
                out_shape.append(plans[d].out_rows)
            else:
                out_shape.append(out_len)
        pads = tuple(0 if 2 + i in sizes else p for i, p in enumerate(self.padding))
        return {d: plans[d] for d in self.shard_dims}, tuple(out_shape), pads, self._extra(shape, sizes, plans, like)

    def _extra(self, shape, sizes, plans, like):
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plans, out_shape, pads, extra = self._layout(x)  # validated on every rank before any halo traffic
        groups = {d: self._group_of(d) for d in plans}
        x = gather_windows(x, plans, groups, self._mode, self._fill)
        if 0 in out_shape:  # owns no output rows: an empty output still tied to the exchange
            return self._tie(x.new_zeros(out_shape), x)
        return self._pool(x, pads, extra)

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, ceil_mode={self.ceil_mode}, shard_dims={self.shard_dims}"
        )

    @classmethod
    def _check_type(cls, m: nn.Module) -> None:
        if type(m) is not cls._nn:
            raise TypeError(f"{cls.__name__}.from_module expects nn.{cls._nn.__name__}, got {type(m).__name__}")


class _MaxPoolNd(_PoolNd):
    def __init__(
        self,
        kernel_size,
        stride=None,
        padding=0,
        dilation=1,
        return_indices: bool = False,
        ceil_mode: bool = False,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
    ):
        super().__init__()
        if return_indices:
            raise ValueError(
                f"{type(self).__name__}: return_indices=True is not supported (indices would be "
                "positions in the local slab); use return_indices=False"
            )
        self.return_indices = False
        self._setup(kernel_size, stride, padding, dilation, ceil_mode, mesh, shard_dims)

    @classmethod
    def from_module(cls, m: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The domain-parallel twin of an ``nn.MaxPoolNd``."""
        cls._check_type(m)
        return cls(
            m.kernel_size,
            m.stride,
            m.padding,
            m.dilation,
            m.return_indices,
            m.ceil_mode,
            mesh=mesh,
            shard_dims=shard_dims,
        )

    def _pool(self, x, pads, extra):
        return _MAX[self.spatial](x, self.kernel_size, self.stride, pads, self.dilation, self.ceil_mode)


class _AvgPoolNd(_PoolNd):
    _fill, _mode, _dilated = 0.0, "zeros", False

    def __init__(
        self,
        kernel_size,
        stride=None,
        padding=0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: Optional[int] = None,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
    ):
        super().__init__()
        if divisor_override is not None and (isinstance(divisor_override, bool) or int(divisor_override) == 0):
            raise ValueError(
                f"{type(self).__name__}: divisor_override must be a nonzero int or None, got {divisor_override!r}"
            )
        self.count_include_pad, self.divisor_override = bool(count_include_pad), divisor_override
        self._setup(kernel_size, stride, padding, 1, ceil_mode, mesh, shard_dims)

    @classmethod
    def from_module(cls, m: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The domain-parallel twin of an ``nn.AvgPoolNd``."""
        cls._check_type(m)
        return cls(
            m.kernel_size,
            m.stride,
            m.padding,
            m.ceil_mode,
            m.count_include_pad,
            getattr(m, "divisor_override", None),
            mesh=mesh,
            shard_dims=shard_dims,
        )

    def _config(self):
        return {
            **super()._config(),
            "count_include_pad": self.count_include_pad,
            "divisor_override": self.divisor_override,
        }

    def _extra(self, shape, sizes, plans, like):
        """Divisor of every owned output position (a product of per-dim counts), built once per layout."""
        if self.divisor_override is not None:
            return float(self.divisor_override)
        counts = []
        for i in range(self.spatial):
            d, k, s, p = 2 + i, self.kernel_size[i], self.stride[i], self.padding[i]
            length = sum(sizes[d]) if d in sizes else shape[d]
            first, rows = (
                (plans[d].out_start, plans[d].out_rows)
                if d in plans
                else (0, pool_out_len(length, k, s, 1, p, self.ceil_mode))
            )
            per = []
            for o in range(first, first + rows):
                start = o * s - p
                end = min(start + k, length + p)
                count = end - start if self.count_include_pad else min(end, length) - max(start, 0)
                per.append(float(max(count, 1)))  # an all-padding window sums to 0 whatever the divisor
            counts.append(per)
        div = None
        for i, per in enumerate(counts):  # outer product of the per-dim counts: (*out_spatial)
            t = torch.tensor(per, dtype=like.dtype, device=like.device).view([-1] + [1] * (self.spatial - 1 - i))
            div = t if div is None else div * t
        return div

    def _pool(self, x, pads, extra):
        if self.spatial == 1:  # avg_pool1d has no divisor_override: pool (N, C, 1, L)
            sums = F.avg_pool2d(
                x.unsqueeze(2), (1,) + self.kernel_size, (1,) + self.stride, (0,) + pads, self.ceil_mode, True, 1
            ).squeeze(2)
        else:
            pool = F.avg_pool2d if self.spatial == 2 else F.avg_pool3d
            sums = pool(x, self.kernel_size, self.stride, pads, self.ceil_mode, True, 1)
        return sums / extra  # divisor_override, or the cached per-position divisor


def _doc(kind: str, n: int, dims: str, example: str) -> str:
    return f"""``nn.{kind}{n}d`` on an input sharded along {dims} (every argument of the nn module, same
    defaults, plus ``*, mesh=None, shard_dims=(2,)``), exact against the serial layer on any partition
    whose shards can supply the windows (else ``ValueError`` on every rank before any halo traffic).

    Args:
        kernel_size, stride, padding, ...: every argument of ``nn.{kind}{n}d``, same defaults
            ({"no ``return_indices=True``" if kind == "MaxPool" else "``divisor_override`` included"}).
        mesh: a 1-D mesh, or a 2-D one to shard two dims (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the dims of the ``(N, C, *spatial)`` input sharded over the mesh dims.

    Returns:
        ``forward(x)``: this rank's rows of the serial output, from this rank's rows of the input
        (any partition); balanced (``tplayers.shard_sizes``) unless the length is kept.

    Raises:
        ValueError: bad arguments; in ``forward``, on every rank before any halo traffic: a
            partition whose shards cannot supply the windows, an empty output, wrong dims or
            dtype, shapes that differ in unsharded dims, ranks built with other arguments.
        TypeError: ``from_module`` of another module type.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = {example}
        pool = tplayers.Distributed{kind}{n}d.from_module(serial, mesh=mesh)
        x = torch.randn(2, 3, {", ".join(["12"] * n)})            # same on every rank
        y = tplayers.gather(pool(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x))
    """


class DistributedMaxPool1d(_MaxPoolNd):
    __doc__ = _doc("MaxPool", 1, "L", "torch.nn.MaxPool1d(3, stride=2, padding=1)")
    spatial, _nn = 1, nn.MaxPool1d


class DistributedMaxPool2d(_MaxPoolNd):
    __doc__ = _doc("MaxPool", 2, "H and/or W", "torch.nn.MaxPool2d(2)")
    spatial, _nn = 2, nn.MaxPool2d


class DistributedMaxPool3d(_MaxPoolNd):
    __doc__ = _doc("MaxPool", 3, "D, H and/or W", "torch.nn.MaxPool3d(3, 2, 1, ceil_mode=True)")
    spatial, _nn = 3, nn.MaxPool3d


class DistributedAvgPool1d(_AvgPoolNd):
    __doc__ = _doc("AvgPool", 1, "L", "torch.nn.AvgPool1d(3, 2, 1, count_include_pad=False)")
    spatial, _nn = 1, nn.AvgPool1d


class DistributedAvgPool2d(_AvgPoolNd):
    __doc__ = _doc("AvgPool", 2, "H and/or W", "torch.nn.AvgPool2d(2)")
    spatial, _nn = 2, nn.AvgPool2d


class DistributedAvgPool3d(_AvgPoolNd):
    __doc__ = _doc("AvgPool", 3, "D, H and/or W", "torch.nn.AvgPool3d(3, 2, 1, ceil_mode=True)")
    spatial, _nn = 3, nn.AvgPool3d
