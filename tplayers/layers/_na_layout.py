"""The partition of :class:`~tplayers.layers.neighborhood_attention.NeighborhoodAttention`'s input:
every rank's local shape exchanged (cached as :mod:`tplayers.layers._domain` says), checked to form a
grid over the mesh, and turned into each sharded axis's halo plan from global positions
(:func:`tplayers.ops.na_layout.axis_plans`). A mixin of that class (it reads its configuration)."""

from __future__ import annotations

from typing import Tuple

import torch

from tplayers.layers._common import autocast_dtype_ok
from tplayers.layers._domain import layout_priming, priming
from tplayers.ops.na import AXIS_NAMES
from tplayers.ops.na_layout import axis_plans
from tplayers.ops.registry import constant_result

__all__ = ["NALayout", "_Layout"]

_Layout = Tuple[Tuple[int, ...], Tuple[int, ...], dict]  # global size, offsets, {tensor dim: AxisPlan}


class NALayout:
    """Input checks and the cached partition of a neighborhood-attention layer (``_layout(x)``)."""

    def _check_local(self, x: torch.Tensor) -> bool:
        return (
            isinstance(x, torch.Tensor)
            and x.dim() == self.spatial_rank + 2
            and x.shape[-1] == self.embed_dim
            and autocast_dtype_ok(x, self.qkv.weight)
            and x.device == self.qkv.weight.device
        )

    def _raise_bad_input(self, x, where: str = "") -> None:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        dtype = (x.dtype, x.device) if isinstance(x, torch.Tensor) else None
        names = ", ".join(AXIS_NAMES[self.spatial_rank])
        raise ValueError(
            f"{type(self).__name__}: input must be (B, {names}, {self.embed_dim}) with the weights' dtype "
            f"and device ({self.qkv.weight.dtype}, {self.qkv.weight.device}){where}; got {shape} {dtype}"
        )

    def _layout(self, x: torch.Tensor) -> _Layout:
        if isinstance(x, torch.Tensor) and torch.compiler.is_compiling() and not layout_priming():
            self._prime_layout(
                tuple(int(s) for s in x.shape), x.dtype, x.device
            )  # the exchange stays out of the graph (int(): shapes specialised, never symbolic)
        key = tuple(x.shape) if isinstance(x, torch.Tensor) else None  # a bad input still joins the exchange
        cached = self._layout_cached()  # else exchanged (as DomainLayer's)
        if cached and key in self._layouts:
            # Cached layout: every rank skips the exchange alike; the per-call checks stay local
            # (a dtype or device change must not reach the halo traffic with mismatched buffers).
            if not self._check_local(x):
                self._raise_bad_input(x)
            return self._layouts[key]
        # table[c0][c1] = every rank's (ok, B, *spatial), exchanged along each mesh dim
        rank = self.spatial_rank
        ok = self._check_local(x)
        row = [int(ok)] + (list(x.shape[: rank + 1]) if ok else [-1] * (rank + 1))
        tile = self._tile_backend() is not None
        config = {
            "kernel_size": self.kernel_size,
            "stride": self.stride,
            "dilation": self.dilation,
            "is_causal": self.is_causal,
            "local_backend": self.local_backend,
            "tile": tile,
            "natten installed": self._natten_installed if self.local_backend == "natten" else None,
            "shard_dims": self.shard_dims,
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "dtype": str(self.qkv.weight.dtype),
        }
        table = self._exchange_layout(row, config, "na.layout")
        if key in self._layouts and self._tables.get(key) == table:
            return self._layouts[key]  # the same partition on every rank as when it was planned
        rows = [r for line in table for r in line]
        if not ok:
            self._raise_bad_input(x)
        if not all(r[0] for r in rows):
            self._raise_bad_input(x, " on every rank (another rank passed a bad input)")
        self._check_grid(table)
        sizes, offsets, plans = [0] * rank, [0] * rank, {}
        for axis in range(rank):  # spatial axis i is tensor dim i + 1
            tensor_dim = axis + 1
            mesh_dim = self.shard_dims.index(tensor_dim) if tensor_dim in self.shard_dims else None
            if mesh_dim == 0:
                line = [table[c][0][1 + tensor_dim] for c in range(len(table))]  # extents along mesh dim 0
            elif mesh_dim == 1:
                line = [r[1 + tensor_dim] for r in table[0]]  # extents along mesh dim 1
            else:
                line = [key[tensor_dim]]  # not sharded
            what = AXIS_NAMES[rank][axis] + ("" if mesh_dim is None else f" (mesh dim {mesh_dim})")
            per = axis_plans(
                line,
                kernel=self.kernel_size[axis],
                dilation=self.dilation[axis],
                causal=self.is_causal[axis],
                what=what,
                stride=self.stride[axis],
                tile=tile,
            )
            index = 0 if mesh_dim is None else self.mesh.get_local_rank(mesh_dim)
            if mesh_dim is not None:
                plans[tensor_dim] = per[index]
            sizes[axis], offsets[axis] = sum(line), sum(line[:index])
        self._layouts[key] = (tuple(sizes), tuple(offsets), plans)
        self._tables[key] = table
        return self._layouts[key]

    @constant_result
    def _prime_layout(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> int:
        """Fill the layout cache for an input of ``shape`` eagerly while ``torch.compile`` traces
        (as :meth:`tplayers.layers._domain.DomainLayer._prime_layout`): every rank traces the same
        code, so the exchange stays collective; the graph only reads the cache."""
        if shape not in self._layouts:
            with priming():
                self._layout(torch.zeros((), dtype=dtype, device=device).expand(shape))
        return 0

    def _check_grid(self, table) -> None:
        """Batch equal everywhere; unsharded dims equal everywhere; a sharded dim equal along the
        other mesh dim (H equal along mesh rows when H is sharded over mesh dim 0, ...)."""
        names = AXIS_NAMES[self.spatial_rank]
        mesh_of = [self.shard_dims.index(d + 1) if d + 1 in self.shard_dims else None for d in range(len(names))]
        for c0, line in enumerate(table):
            for c1, r in enumerate(line):
                ref = [table[c0 if m == 0 else 0][c1 if m == 1 else 0][2 + d] for d, m in enumerate(mesh_of)]
                if r[1] != table[0][0][1] or list(r[2:]) != ref:
                    expect = ", ".join(f"{n}={e}" for n, e in zip(names, ref))
                    raise ValueError(
                        f"{type(self).__name__}: local input shapes do not form a grid partition over the mesh "
                        f"(shard_dims={self.shard_dims}): rank at mesh position {(c0, c1)[: len(self._groups)]} has "
                        f"(B, {', '.join(names)})={tuple(r[1:])}, expected B={table[0][0][1]}, {expect}"
                    )
