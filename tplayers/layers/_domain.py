"""Base of the domain-parallel spatial twins: mesh binding, the layout exchange, agreement, caching.

A twin's input is this rank's slice of ``(N, C, *spatial)`` along ``shard_dims``
(one tensor dim per mesh dim). Every rank's shape is exchanged
(:func:`~tplayers.comm.agree.exchange_agreed`); the same exchange carries the
layer's configuration (kernel, stride, padding, mode, shard_dims, dtype, ...),
so ranks built differently fail with one ``ValueError`` naming the field and
the ranks, and its first time a fingerprint of the replicated parameters (ranks
built from different seeds fail the same way). Every rank then validates the
same table and plans every shard (:mod:`tplayers.window_plan`), so a bad
partition is a ``ValueError`` on every rank before any halo traffic. The twin's
:meth:`DomainLayer._build` turns the per-dim shard sizes into its cached layout.

When the exchange runs: inside a ``DomainParallel`` region call (whose entry
agreement compared every rank's partition) and while ``torch.compile`` primes,
once per local input shape, cached. Anywhere else (hand-written code, a
``domain_region`` block) on **every call**, one small all-gather: the cache is
keyed by the whole table, so a partition that changes on some ranks only is
re-planned on every rank, exactly, instead of leaving the changed ranks in the
exchange while the others wait in their halo messages.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._common import ShardedModule
from tplayers.ops.registry import constant_result
from tplayers.sharding import ShardSpec

__all__ = ["DomainLayer", "ntuple"]

_PRIMING = False  # True while a layer's _prime_layout fills its cache during torch.compile tracing


def layout_priming() -> bool:
    """Whether a layout cache is being filled eagerly for ``torch.compile`` (see :func:`priming`)."""
    return _PRIMING


@contextlib.contextmanager
def priming():
    """Mark the eager layout computation a layer runs while ``torch.compile`` traces it (inside a
    :func:`~tplayers.ops.registry.constant_result` method): ``is_compiling()`` is True there, and the
    layer must compute its layout instead of priming again."""
    global _PRIMING
    _PRIMING = True
    try:
        yield
    finally:
        _PRIMING = False


def ntuple(value, n: int, name: str, layer: str) -> Tuple[int, ...]:
    """``value`` as an ``n``-tuple of ints (an int is repeated), else ``ValueError``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f"{layer}: {name} must be an int or a tuple of {n} ints, got {value!r}") from None
    if len(out) != n:
        raise ValueError(f"{layer}: {name} must be an int or a tuple of {n} ints, got {value!r}")
    return out


class DomainLayer(ShardedModule):
    """Shared machinery of the ``Distributed*`` spatial twins (subclasses set ``spatial``)."""

    spatial: Optional[int] = 2  # spatial dims of the input (N, C, *spatial); None: any of 1-3

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """Every parameter is replicated on every rank of the domain (none for a layer without any)."""
        return {name: ShardSpec.replicated(p.shape) for name, p in self.named_parameters()}

    def _init_domain(self, mesh: Optional[DeviceMesh], shard_dims: Sequence[int]) -> None:
        nd = 2 + (self.spatial or 3)
        name = type(self).__name__
        try:
            dims = tuple(int(d) for d in shard_dims)
        except TypeError:
            raise ValueError(f"{name}: shard_dims must be a tuple of spatial dims, got {shard_dims!r}") from None
        dims = tuple(d % nd if -nd <= d < nd else d for d in dims)
        if not dims or len(dims) > 2 or any(d < 2 or d >= nd for d in dims) or len(set(dims)) != len(dims):
            raise ValueError(
                f"{name}: shard_dims must be one or two distinct spatial dims of the "
                f"{nd}-D input (2..{nd - 1}), got {tuple(shard_dims)}"
            )
        self.shard_dims = dims
        mesh = self._bind_mesh(mesh, len(dims))
        self._groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self._layouts: Dict[Any, Any] = {}
        self._tables: Dict[Any, Any] = {}  # the exchanged table each cached layout was planned from

    # --------------------------------------------------------------- for twins
    def _config(self) -> Dict[str, object]:
        """The arguments every rank must agree on (beyond ``shard_dims``)."""
        return {}

    def _param_dtype(self) -> Optional[torch.Tensor]:
        """A parameter whose dtype/device the input must match (``None``: no parameters)."""
        return None

    def _build(
        self, shape: Tuple[int, ...], sizes: Dict[int, List[int]], like: torch.Tensor
    ) -> Any:  # pragma: no cover
        """The cached layout from this rank's local shape and every sharded dim's shard sizes
        (``like``: the input, for dtype and device)."""
        raise NotImplementedError

    def reset_layout(self) -> None:
        """Forget cached partitions (on every rank). Rarely needed: a ``DomainParallel`` region resets
        its twins when its partition changes, and twins called elsewhere agree on it every call."""
        self._layouts.clear()
        self._tables.clear()
        self._forget_rows()

    def _group_of(self, d: int) -> dist.ProcessGroup:
        return self._groups[self.shard_dims.index(d)]

    def _coord(self, d: int) -> int:
        return self.mesh.get_local_rank(self.shard_dims.index(d))

    # ------------------------------------------------------------------ layout
    def _ndim_ok(self, x: torch.Tensor) -> bool:
        """Whether ``x`` has the dims this twin takes (``spatial = None``: 1-3 spatial dims)."""
        if self.spatial is not None:
            return x.dim() == 2 + self.spatial
        return 3 <= x.dim() <= 5 and max(self.shard_dims) < x.dim()

    def _layout(self, x: torch.Tensor, ref: Optional[torch.Tensor] = None):
        """The cached layout for ``x`` (exchanged and validated on its first local shape/dtype);
        ``ref``: the tensor whose dtype/device ``x`` must match (default :meth:`_param_dtype`; a
        twin under ``torch.autocast`` passes its weight cast to the compute dtype)."""
        name = type(self).__name__
        is_tensor = isinstance(x, torch.Tensor)
        if (
            is_tensor and torch.compiler.is_compiling() and not layout_priming()
        ):  # shape arithmetic stays out of the graph
            self._prime_layout(
                tuple(int(s) for s in x.shape),
                x.dtype,
                x.device,  # int(): never symbolic
                None if ref is None else ref.dtype,
            )
        key = (tuple(x.shape), x.dtype, x.device) if is_tensor else None  # a bad input still joins the exchange
        cached = self._layout_cached()  # else: exchanged (module docstring)
        if cached and key in self._layouts:
            return self._layouts[key]
        ref = self._param_dtype() if ref is None else ref
        rank_ok = is_tensor and self._ndim_ok(x)
        kind_ok = is_tensor and (ref is None or (x.dtype == ref.dtype and x.device == ref.device))
        shape = list(x.shape) if rank_ok else []
        config = {"layer": name, **self._config(), "shard_dims": self.shard_dims, "mesh shape": tuple(self.mesh.shape)}
        if ref is None:
            config["input dtype"] = str(x.dtype) if is_tensor else None
        row = [int(rank_ok), int(kind_ok), len(shape)] + shape + [-1] * (5 - len(shape))
        table = self._exchange_layout(row, config, "domain.layout")
        if key in self._layouts and self._tables.get(key) == table:
            return self._layouts[key]  # the same partition on every rank as when it was planned
        coords = [(c0, c1) for c0 in range(len(table)) for c1 in range(len(table[0]))]
        where = lambda c: c[: self.mesh.ndim]  # noqa: E731 - mesh position in messages
        ndims = {table[c[0]][c[1]][2] for c in coords}
        for c in coords:
            row = table[c[0]][c[1]]
            if not row[0] or len(ndims) > 1:
                want = f"{2 + self.spatial}-D" if self.spatial else "3-D to 5-D (the same on every rank)"
                raise ValueError(
                    f"{name}: the input must be {want} (N, C, *spatial) on every rank; mesh position "
                    f"{where(c)} passed {row[2] if row[0] else 'another'}-D"
                )
            if not row[1]:
                raise ValueError(
                    f"{name}: input dtype/device must match the weight's ({ref.dtype}, {ref.device}) "
                    f"on every rank; mesh position {where(c)} differs"
                )
        nd = ndims.pop()
        shapes = {c: table[c[0]][c[1]][3 : 3 + nd] for c in coords}
        sizes: Dict[int, List[int]] = {}
        for d in range(nd):
            mesh_dim = self.shard_dims.index(d) if d in self.shard_dims else None
            for c, shp in shapes.items():
                peer = shapes[(c[0], 0)] if mesh_dim == 0 else shapes[(0, c[1])] if mesh_dim == 1 else shapes[(0, 0)]
                if shp[d] != peer[d]:
                    raise ValueError(
                        f"{name}: local input shapes differ across ranks in dim {d} "
                        f"({'not sharded' if mesh_dim is None else 'sharded over the other mesh dim'}): "
                        f"{shapes[(0, 0)]} vs {shp} at mesh position {where(c)}"
                    )
            if mesh_dim == 0:
                sizes[d] = [table[c0][0][3 + d] for c0 in range(len(table))]
            elif mesh_dim == 1:
                sizes[d] = [row[3 + d] for row in table[0]]
        self._layouts[key] = self._build(tuple(shape), sizes, x)
        self._tables[key] = table
        return self._layouts[key]

    @constant_result
    def _prime_layout(
        self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, ref_dtype: Optional[torch.dtype]
    ) -> int:
        """Fill the layout cache for an input of ``shape``/``dtype``/``device`` (``torch.compile``).

        Dynamo calls this eagerly while tracing (its result is a constant), so the layout exchange
        and the plan arithmetic run on Python ints before the graph is built; the traced
        ``forward`` then only reads the cache. Every rank traces the same code, so the exchange
        stays collective. A new local shape recompiles and primes again.
        """
        if (shape, dtype, device) not in self._layouts:
            stand_in = torch.zeros((), dtype=dtype, device=device).expand(shape)  # no allocation
            ref = None if ref_dtype is None else torch.zeros((), dtype=ref_dtype, device=device)
            with priming():  # the eager call below must not prime again (is_compiling() is True here)
                self._layout(stand_in, ref)
        return 0

    def _broadcast_parameters(self) -> None:
        """Make freshly initialised replicated parameters identical on every domain rank."""
        with torch.no_grad():
            for group in self._groups:
                if dist.get_world_size(group) > 1:
                    for p in self.parameters():
                        if p.device.type != "meta":
                            dist.broadcast(p.data, dist.get_global_rank(group, 0), group=group)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)`` (halo messages per sharded dim; the
        parameter-gradient sum for twins with parameters)."""
        halo = [f"halo send/recv (dim {d})" for d in self.shard_dims]
        params = ["all_reduce (parameter grads)"] * len(self.shard_dims) if any(True for _ in self.parameters()) else []
        return halo, halo + params

    def _tie(self, out: torch.Tensor, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
        """``out`` tied (with zero weight) to ``inputs``, so an empty shard's backward still runs
        the same collectives as its peers'."""
        tie = sum((t.sum() * 0 for t in inputs if t is not None and t.requires_grad), out.new_zeros(()))
        return out + tie


class ConvParameters:
    """Weight and bias of the convolution twins, direct and transposed: made, initialised and
    broadcast as ``nn.ConvNd`` / ``nn.ConvTransposeNd`` make them (mixed into a :class:`DomainLayer`)."""

    def _make_parameters(self, weight_shape: Tuple[int, ...], out_channels: int, bias: bool, device, dtype) -> None:
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(weight_shape, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, **kw))
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The ``nn`` module's initialisation (kaiming uniform; bias uniform in ``1/sqrt(fan_in)``),
        then a broadcast from the first domain rank so every rank holds the same replicated
        parameters (use ``from_module`` to copy a serial layer)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self._broadcast_parameters()
