"""Domain-parallel upsampling (``DistributedUpsample``) and the band resampling it shares with the
adaptive average pools (:mod:`tplayers.layers.adaptive_pool`).

Both are linear and separable: along one dim, output row ``o`` is a weighted sum
of a few input rows. The weights are taken from PyTorch itself, once per layout:
the serial op applied to an identity (one channel per input row, size 1 along the
other dims) gives the ``(L_in, L_out)`` matrix ``W`` exactly as the serial kernel
weighs its taps (nearest, nearest-exact, linear, bilinear, bicubic, trilinear,
area; ``align_corners`` and ``scale_factor`` semantics included). The rows a shard's
outputs read (the window of the core) are the nonzero band of its columns; the
N-d halo exchange brings them, and the local result is the band product, dim by
dim (so no corner blocks are needed). Unsharded dims are left to the serial op
with an exact identity along the sharded ones.

An adaptive average pool to size 1 along a sharded dim is a global reduction: each
rank weighs its own rows and one all-reduce (forward; identity backward) gives the
result, replicated along that dim on every rank.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm import reduce_from_parallel_region
from tplayers.domain.window import gather_rows
from tplayers.layers._domain import DomainLayer
from tplayers.sharding import offsets_from_sizes
from tplayers.window_plan import out_partition, plan_ranges

__all__ = ["DistributedUpsample"]

_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear", "area")


def _eye(n_sp: int, d: int, length: int, like: torch.Tensor) -> torch.Tensor:
    """``(1, L, *ones)`` with channel ``c`` holding a one at position ``c`` along ``d``."""
    view = [1, length] + [1] * n_sp
    view[d] = length
    return torch.eye(length, dtype=like.dtype, device=like.device).view(view)


class _BandResample(DomainLayer):
    """A separable linear resampling along the sharded dims, from probed weight matrices."""

    _reduce_to_one = False  # adaptive pools: size 1 along a sharded dim is a global reduction

    def _build(self, shape, sizes: Dict[int, List[int]], like: torch.Tensor):
        n_sp = len(shape) - 2
        steps, out_shape = [], list(shape)
        for d in self.shard_dims:  # mesh order
            length = sum(sizes[d])
            w = self._probe(_eye(n_sp, d, length, like), n_sp, d)  # (L_in, L_out)
            out_len, c = w.shape[1], self._coord(d)
            starts = offsets_from_sizes(sizes[d])
            if out_len == 1 and self._reduce_to_one:
                own = w[starts[c] : starts[c] + sizes[d][c]]
                steps.append((d, None, own, True))
                out_shape[d] = 1
                continue
            outs = out_partition(sizes[d], out_len)
            needs = []
            for o0, rows in zip(offsets_from_sizes(outs), outs):
                band = w[:, o0 : o0 + rows].ne(0).any(1).nonzero().flatten().tolist()
                needs.append((band[0], band[-1] + 1) if rows and band else None)
            what = f"dim {d} (mesh dim {self.shard_dims.index(d)})"
            plan = plan_ranges(sizes[d], needs, outs, mode="zeros", what=what)[c]
            a = plan.in_start
            rows_in = needs[c][1] - needs[c][0] if needs[c] else 0
            steps.append((d, plan, w[a : a + rows_in, plan.out_start : plan.out_start + plan.out_rows], False))
            out_shape[d] = plan.out_rows
        for d in range(2, len(shape)):
            if d not in self.shard_dims:
                out_shape[d] = self._out_len(d, shape[d], n_sp)
        return steps, tuple(out_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, out_shape = self._layout(x)  # validated on every rank before any halo traffic
        for d, plan, w, reduce in steps:
            group = self._group_of(d)
            if not reduce:
                x = gather_rows(x, d, group, plan, "zeros")
            # interpolation and pooling keep the input dtype under autocast (as the serial ops do);
            # the band product must not be cast down like a user's matmul
            with torch.autocast(x.device.type, enabled=False):
                x = (x.movedim(d, -1) @ w).movedim(-1, d)  # (..., rows_in) @ (rows_in, rows_out) along d
            if reduce:  # size 1: the sum of every rank's part, replicated along d
                x = reduce_from_parallel_region(x.contiguous(), group)
        if all(x.size(d) == out_shape[d] for d in range(2, x.dim())):
            return x
        if 0 in x.shape:
            return self._tie(x.new_zeros(out_shape), x)
        return self._rest(x, out_shape)


class DistributedUpsample(_BandResample):
    """``nn.Upsample`` on an input sharded along one or two spatial dims (``shard_dims`` name dims of
    the ``(N, C, *spatial)`` input, 1-3 spatial dims), exact against the serial module.

    Every mode (nearest, nearest-exact, linear, bilinear, bicubic, trilinear, area), ``size`` or
    ``scale_factor``, ``align_corners`` both ways, ``recompute_scale_factor``. Output rows are
    balanced (``tplayers.shard_sizes``) unless the length is kept.

    Args:
        size, scale_factor, mode, align_corners, recompute_scale_factor: as ``nn.Upsample``
            (exactly one of ``size`` / ``scale_factor``; sizes global).
        mesh: a 1-D mesh, or a 2-D one to shard two dims (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the dims of the ``(N, C, *spatial)`` input sharded over the mesh dims.

    Returns:
        ``forward(x)``: this rank's rows of the serial output, from this rank's rows of the input.

    Raises:
        ValueError: a bad mode, both or neither of ``size`` / ``scale_factor``, ``align_corners``
            with a mode without corners; in ``forward``, on every rank before any halo traffic: a
            partition whose shards cannot supply the taps, mismatched shapes, ranks built differently.
        TypeError: ``from_module`` of a module that is not an ``nn.Upsample``.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)                                  # the same model and data on every rank
        serial = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        up = tplayers.DistributedUpsample.from_module(serial, mesh=mesh)
        x = torch.randn(1, 3, 9, 7)                           # same on every rank
        y = tplayers.gather(up(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x))
    """

    spatial = None

    def __init__(
        self,
        size=None,
        scale_factor=None,
        mode: str = "nearest",
        align_corners: Optional[bool] = None,
        recompute_scale_factor: Optional[bool] = None,
        *,
        mesh: Optional[DeviceMesh] = None,
        shard_dims: Sequence[int] = (2,),
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if mode not in _MODES:
            raise ValueError(f"{name}: mode must be one of {_MODES}, got {mode!r}")
        if (size is None) == (scale_factor is None):
            raise ValueError(
                f"{name}: give exactly one of size and scale_factor, got size={size!r}, scale_factor={scale_factor!r}"
            )
        if align_corners is not None and mode not in ("linear", "bilinear", "bicubic", "trilinear"):
            raise ValueError(f"{name}: align_corners only applies to linear, bilinear, bicubic and trilinear modes")
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor
        self._init_domain(mesh, shard_dims)

    @classmethod
    def from_module(cls, m: nn.Upsample, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The domain-parallel twin of an ``nn.Upsample`` (or ``nn.UpsamplingNearest2d`` / ``Bilinear2d``)."""
        if not isinstance(m, nn.Upsample):
            raise TypeError(f"{cls.__name__}.from_module expects an nn.Upsample, got {type(m).__name__}")
        return cls(
            m.size,
            m.scale_factor,
            m.mode,
            m.align_corners,
            getattr(m, "recompute_scale_factor", None),
            mesh=mesh,
            shard_dims=shard_dims,
        )

    def _config(self):
        return {
            "size": self.size,
            "scale_factor": self.scale_factor,
            "mode": self.mode,
            "align_corners": self.align_corners,
            "recompute_scale_factor": self.recompute_scale_factor,
        }

    def _per_dim(self, value, n_sp: int):
        if isinstance(value, (tuple, list)):
            if len(value) != n_sp:
                raise ValueError(
                    f"{type(self).__name__}: size/scale_factor has {len(value)} entries for {n_sp} spatial dims"
                )
            return list(value)
        return [value] * n_sp

    def _interp(self, x: torch.Tensor, d_sizes: Dict[int, int], n_sp: int) -> torch.Tensor:
        """``F.interpolate`` with this layer's arguments, dims in ``d_sizes`` kept at their size."""
        if self.size is not None:
            size = self._per_dim(self.size, n_sp)
            size = [d_sizes.get(2 + i, s) for i, s in enumerate(size)]
            return F.interpolate(x, size=size, mode=self.mode, align_corners=self.align_corners)
        scale = [1.0 if 2 + i in d_sizes else float(s) for i, s in enumerate(self._per_dim(self.scale_factor, n_sp))]
        return F.interpolate(
            x,
            scale_factor=scale,
            mode=self.mode,
            align_corners=self.align_corners,
            recompute_scale_factor=self.recompute_scale_factor,
        )

    def _probe(self, eye: torch.Tensor, n_sp: int, d: int) -> torch.Tensor:
        keep = {2 + i: 1 for i in range(n_sp) if 2 + i != d}
        return self._interp(eye, keep, n_sp).reshape(eye.size(1), -1)

    def _out_len(self, d: int, length: int, n_sp: int) -> int:
        if self.size is not None:
            return int(self._per_dim(self.size, n_sp)[d - 2])
        return math.floor(float(length) * float(self._per_dim(self.scale_factor, n_sp)[d - 2]))

    def _rest(self, x, out_shape):
        return self._interp(x, {d: x.size(d) for d in self.shard_dims}, x.dim() - 2)

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, scale_factor={self.scale_factor}, mode={self.mode!r}, "
            f"align_corners={self.align_corners}, shard_dims={self.shard_dims}"
        )
