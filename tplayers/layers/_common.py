"""Shared pieces of tplayers layers: mesh binding, input checks, sharding-as-data."""

from __future__ import annotations

import copy
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils import parametrize

from tplayers.comm.agree import exchange_agreed, value_fingerprints
from tplayers.domain.active import active_guard, in_guarded_call, partition_agreed, partition_checked
from tplayers.layers._copy import MeshBound
from tplayers.mesh import resolve_mesh
from tplayers.sharding import ShardSpec


class RegionAware:
    """Mixin for modules that run their own collectives on domain-sharded data (twins, context-parallel
    attention): inside a domain region the guard steps aside while they run and tags their output
    (:mod:`tplayers.region.guard`); everywhere else this is ``nn.Module.__call__``."""

    def __call__(self, *args, **kwargs):
        if self.__dict__.get("_tp_reparametrized"):  # a parametrized weight: computed once per call, as serially
            with parametrize.cached():
                return self._call(*args, **kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        # Inside a domain region the guard steps aside while a twin runs, and tags its output
        # (tplayers.region.guard). A twin of a region called outside the region's call (a model method
        # other than forward) opens that call itself (its entry, set by tplayers.region.scope).
        # Everywhere else this is nn.Module.__call__.
        entry = self.__dict__.get("_tp_region_entry")
        if not torch.compiler.is_compiling():
            guard = active_guard()
            if guard is not None:
                return guard.call_twin(self, super().__call__, args, kwargs)
            if entry is not None and not in_guarded_call():
                return entry.call(self, super().__call__, args, kwargs)
        elif entry is not None:  # traced: the entry refuses a region the guard must check
            return entry.call(self, super().__call__, args, kwargs)
        return super().__call__(*args, **kwargs)


class ShardedModule(RegionAware, MeshBound, nn.Module):
    """Base of every parallel layer: stores its mesh, rank and group, and says
    how each of its tensors is laid out (:meth:`shard_specs`).

    :meth:`shard_specs` is the one source of truth for ``from_module`` (which
    copies ``spec.take(full)``) and for checkpoints (which save and reshard by it).
    ``copy.deepcopy`` keeps the mesh and process groups by reference, ``pickle``
    stores groups as mesh-dim references (:class:`~tplayers.layers._copy.MeshBound`).
    """

    def attach_serial(self, module: nn.Module) -> None:
        """Keep the serial ``module`` this twin replaces, its parameters and buffers rebound to this
        twin's (one set of tensors), to run where a domain region applies the twin to replicated data
        (a 1x1 convolution on a globally pooled tensor, as squeeze-excitation does)."""
        serial = copy.copy(module)  # a shallow copy: the caller's module is left as it is
        serial._parameters, serial._buffers = dict(module._parameters), dict(module._buffers)
        for name, p in self.named_parameters(recurse=False):
            if name in serial._parameters:
                serial._parameters[name] = p
        for name, b in self.named_buffers(recurse=False):
            if name in serial._buffers:
                serial._buffers[name] = b
        self._serial = (serial,)  # a tuple: not a registered child (no state_dict keys)

    def _exchange_layout(self, row, config, tag: str):
        """Every rank's layout ``row``, agreed on ``config`` over this layer's mesh groups
        (:func:`~tplayers.comm.agree.exchange_agreed`). The layer's first exchange outside a region
        (which checks its own) also carries a fingerprint of its parameters, so replicated weights
        that differ across ranks raise ``ValueError`` on every rank."""
        values = None
        if not self.__dict__.get("_values_checked", False) and not partition_agreed():
            values = value_fingerprints(dict(self.named_parameters()))
        table = exchange_agreed(
            row,
            config,
            self._groups,
            type(self).__name__,
            tag,
            values=values,
            ranks=self.mesh.mesh.reshape(-1).tolist(),
        )
        self._values_checked = True
        if partition_agreed() and not partition_checked():
            self._note_rows(table)
        return table

    def _layout_cached(self) -> bool:
        """Whether a layout cached by this rank's local shape may be reused without an exchange: while
        compiling, or in a region call whose partition was run through before, unless this twin took two
        tensors whose local shapes coincide on some rank but not on others (a pooled pyramid's 2- and
        3-row maps are 1 + 1 and 2 + 1 rows: the second rank would reuse the first map's plan while the
        first rank exchanged). The region resets twins when its partition changes (``reset_layout``)."""
        if torch.compiler.is_compiling():
            return True
        return partition_checked() and not self.__dict__.get("_ambiguous", False)

    def _note_rows(self, table) -> None:
        """In a partition's checking call: remember the whole table each rank's row came with; a row seen
        with two different tables marks this twin ambiguous (identically on every rank: every rank sees
        every table)."""
        seen = self.__dict__.setdefault("_row_tables", {})
        whole = repr(table)
        stack = [table]
        while stack:
            item = stack.pop()
            if item and isinstance(item[0], list):
                stack.extend(item)
            elif seen.setdefault(repr(item), whole) != whole:
                self._ambiguous = True

    def _forget_rows(self) -> None:
        self.__dict__.pop("_row_tables", None)
        self.__dict__.pop("_ambiguous", None)

    def _bind_mesh(self, mesh: Optional[DeviceMesh], ndim=1) -> DeviceMesh:
        mesh = resolve_mesh(mesh, ndim)
        self.mesh = mesh
        return mesh

    def shard_specs(self) -> Dict[str, ShardSpec]:  # pragma: no cover - abstract
        """``{local tensor name: ShardSpec}`` for every parameter and buffer."""
        raise NotImplementedError

    def counted_ranges(self, name: str) -> Optional[Tuple[Tuple[int, int], ...]]:
        """The local ``(start, stop)`` ranges along the sharded dim of tensor ``name`` that this rank
        counts in a reduction over the serial tensor's elements (a global gradient norm), or ``None``
        for all of it. Layers where several ranks hold copies of one range (grouped-query key/value
        heads) count each copy on one rank only."""
        return None

    def _copy_shards_from(self, dense: nn.Module) -> None:
        """Copy this rank's slice of each tensor of the serial module ``dense``."""
        with torch.no_grad():
            for name, spec in self.shard_specs().items():
                mine, full = get_tensor(self, name), get_tensor(dense, name)
                mine.copy_(spec.take(full))
                if isinstance(mine, nn.Parameter):
                    mine.requires_grad_(full.requires_grad)


def adopt_tensors(wrapper: nn.Module, module: nn.Module) -> None:
    """Register ``module``'s own parameters and buffers on ``wrapper`` under their names (the same
    tensors), so a wrapper holding ``module`` in a tuple has exactly its ``state_dict`` keys."""
    for name, p in module.named_parameters(recurse=False):
        wrapper.register_parameter(name, p)
    for name, b in module.named_buffers(recurse=False):
        wrapper.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)


def replicated_tensors(root: nn.Module) -> Dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` of every parameter and buffer of ``root`` that every rank of a domain
    mesh holds whole: all of them except the sharded tensors of :class:`ShardedModule` s (by their
    :meth:`~ShardedModule.shard_specs`). Each tensor once, under its first name."""
    sharded = set()
    for mod in root.modules():
        if isinstance(mod, ShardedModule):
            for name, spec in mod.shard_specs().items():
                if not spec.is_replicated:
                    sharded.add(id(get_tensor(mod, name)))
    out: Dict[str, torch.Tensor] = {}
    for name, t in list(root.named_parameters()) + list(root.named_buffers()):
        if id(t) not in sharded:
            out[name] = t
    return out


def get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer called ``name`` (dotted) of ``module``."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)


def check_features(x: torch.Tensor, expected: int, weight: torch.Tensor, arg: str, layer: str) -> None:
    """Raise ``ValueError`` unless ``x`` is ``(..., expected)`` on ``weight``'s device and dtype.

    Called before any collective on every rank. Tensor-parallel inputs are
    replicated (the same on every rank), so a bad input raises on every rank
    and none is left waiting; an input bad on one rank only cannot be detected
    without a collective per step, and would leave its peers waiting in theirs
    until the process group's timeout.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer}: {arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"{layer}: {arg} must have last dim {expected}, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"{layer}: {arg} dtype must match the weight's {weight.dtype}, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"{layer}: {arg} device must match the weight's {weight.device}, got {x.device}")


def init_shards_like_serial(module: "ShardedModule", inits: Dict[str, Callable[[torch.Tensor], None]]) -> None:
    """Initialise each named tensor as this rank's slice of the serial tensor ``inits[name]`` fills.

    For each name in order (the serial module's order of RNG draws), a full tensor
    of the serial shape is allocated on the local tensor's device and dtype, filled
    by ``inits[name]`` (the serial module's init call), and this rank's slice
    (``shard_specs()[name].take``) is copied in. Every rank draws the same full
    tensors, so shards under one seed are the serial module's and the generators
    stay in step. Absent tensors (``bias=None``) are skipped but still not drawn,
    as in the serial module. Cost: one full tensor at a time, per rank.
    """
    specs = module.shard_specs()
    with torch.no_grad():
        for name, init in inits.items():
            mine = getattr(module, name, None)
            if mine is None:
                continue
            spec = specs[name]
            full = torch.empty(spec.global_shape, device=mine.device, dtype=mine.dtype)
            init(full)
            mine.copy_(spec.take(full))
            del full


#: dtypes ``torch.autocast`` casts (float64 and integer tensors are left alone, as autocast does)
AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_inputs(x, *tensors):
    """``(x, *tensors)`` cast to the autocast dtype when ``torch.autocast`` is active on
    ``x``'s device, exactly as ``F.linear`` / ``F.conv2d`` cast their arguments under it
    (fp32/fp16/bf16 tensors are cast, others kept; ``None`` stays ``None``); unchanged otherwise.

    The casts are ordinary differentiable ops, so parameter gradients arrive in the
    parameters' own dtype, as with ``nn.Linear`` under autocast. Layers call this before
    their checks and collectives, so the communication carries the compute dtype.

    >>> w = torch.ones(2, 2)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     x, w16 = autocast_inputs(torch.ones(1, 2), w)
    >>> x.dtype, w16.dtype, w.dtype
    (torch.bfloat16, torch.bfloat16, torch.float32)
    """
    if not isinstance(x, torch.Tensor):
        return (x, *tensors)
    device = x.device.type
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in AUTOCAST_ELIGIBLE else t for t in (x, *tensors)
    )


def check_reduce_dtype(reduce_dtype, layer: str):
    """``reduce_dtype`` (``None`` or a floating dtype) or ``TypeError``."""
    if reduce_dtype is not None and (not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point):
        raise TypeError(f"{layer}: reduce_dtype must be None or a floating torch.dtype, got {reduce_dtype!r}")
    return reduce_dtype


def autocast_dtype_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a layer computing ``F.linear(x, weight)`` accepts ``x``'s dtype: the weight's, or,
    under ``torch.autocast`` on ``x``'s device, any dtype autocast casts (as ``nn.Linear`` does)."""
    if x.dtype == weight.dtype:
        return True
    device = x.device.type
    return (
        torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
        and x.dtype in AUTOCAST_ELIGIBLE
        and weight.dtype in AUTOCAST_ELIGIBLE
    )
