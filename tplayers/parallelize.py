"""Plans: swap ordinary ``nn`` layers for their distributed twins.

A plan is data: ``{key: value}``. A key is a regex matched with
``re.fullmatch`` against each module's dotted name (``""`` is the root), or an
``nn.Module`` subclass matching by type. A value is a style
(:class:`ColumnParallel`, :class:`RowParallel`, :class:`DomainParallel`) or a partition function
``fn(name, module, mesh) -> nn.Module``. :func:`parallelize_module` applies it;
:func:`explain` shows what it would do without changing anything.

Example (a Megatron MLP; run under ``torchrun`` or plain ``python``)::

    import torch, tplayers
    from torch import nn
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
    print(tplayers.explain(model, plan))
    model = tplayers.parallelize_module(model, plan)
    opt = torch.optim.AdamW(model.parameters())   # build optimizers AFTER swapping
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._common import ShardedModule
from tplayers.layers.attention import NeighborhoodAttention
from tplayers.layers.conv import DistributedConv2d
from tplayers.layers.linear import ColumnParallelLinear, RowParallelLinear
from tplayers.layers.replicated import DomainReplicated
from tplayers.mesh import resolve_mesh

__all__ = ["ParallelStyle", "ColumnParallel", "RowParallel", "DomainParallel", "parallelize_module", "explain", "Explanation"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], nn.Module]
PlanKey = Union[str, type]


class ParallelStyle:
    """A rule that turns one serial module into its distributed twin.

    Subclasses set :attr:`accepts` (the module types they can handle) and
    implement :meth:`build`.
    """

    accepts: Tuple[type, ...] = ()

    def build(self, name: str, module: nn.Module, mesh: DeviceMesh) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def finalize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Called once per style after every swap of the plan; returns the (possibly new) model."""
        return model

    def check(self, key: PlanKey, name: str, module: nn.Module) -> None:
        """Raise ``ValueError`` if this style cannot handle ``module``."""
        if not isinstance(module, self.accepts):
            want = " or ".join(t.__name__ for t in self.accepts)
            raise ValueError(
                f"plan key {_key_repr(key)}: {type(self).__name__} expects {want}, but module "
                f"{name or '<root>'!r} is {type(module).__name__}"
            )


@dataclass(frozen=True)
class ColumnParallel(ParallelStyle):
    """Swap an ``nn.Linear`` for :class:`~tplayers.ColumnParallelLinear` (output features split).

    Example::

        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        model = tplayers.parallelize_module(model, {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()})
    """

    gather_output: bool = False
    accepts = (nn.Linear,)

    def build(self, name, module, mesh):
        return ColumnParallelLinear.from_module(module, mesh=mesh, gather_output=self.gather_output)


@dataclass(frozen=True)
class RowParallel(ParallelStyle):
    """Swap an ``nn.Linear`` for :class:`~tplayers.RowParallelLinear` (input features split).

    ``input_is_parallel=False`` makes the swapped layer take the full input and
    split it locally (a drop-in for an ``nn.Linear`` anywhere in a model)::

        head = tplayers.parallelize_module(nn.Linear(64, 10), {"": tplayers.RowParallel(input_is_parallel=False)})
    """

    input_is_parallel: bool = True
    accepts = (nn.Linear,)

    def build(self, name, module, mesh):
        return RowParallelLinear.from_module(module, mesh=mesh, input_is_parallel=self.input_is_parallel)


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


def _key_repr(key: PlanKey) -> str:
    return key.__name__ if isinstance(key, type) else f"'{key}'"


@dataclass
class _Match:
    name: str
    module: nn.Module
    key: PlanKey
    value: Union[ParallelStyle, PartitionFn]


def _match_plan(model: nn.Module, plan: Mapping) -> List[_Match]:
    """Resolve every key of ``plan`` to modules; validate everything before any change."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping of keys to styles, got {type(plan).__name__}")
    modules = list(model.named_modules())
    owner: Dict[str, PlanKey] = {}
    matches: List[_Match] = []
    for key, value in plan.items():
        if isinstance(key, str):
            try:
                pattern = re.compile(key)
            except re.error as err:
                raise ValueError(f"plan key {key!r} is not a valid regex: {err}") from None
            found = [(n, m) for n, m in modules if pattern.fullmatch(n)]
        elif isinstance(key, type) and issubclass(key, nn.Module):
            found = [(n, m) for n, m in modules if isinstance(m, key)]
        else:
            raise TypeError(f"plan key must be a regex string or an nn.Module subclass, got {key!r}")
        if not (isinstance(value, ParallelStyle) or callable(value)):
            raise TypeError(
                f"plan key {_key_repr(key)}: value must be a ParallelStyle or a callable "
                f"fn(name, module, mesh), got {type(value).__name__}"
            )
        if not found:
            candidates = [f"{n or '<root>'} ({type(m).__name__})" for n, m in modules]
            raise ValueError(
                f"plan key {_key_repr(key)} matches no module; candidates: " + ", ".join(candidates)
            )
        for name, module in found:
            if name in owner:
                raise ValueError(
                    f"module {name or '<root>'!r} ({type(module).__name__}) is matched by two plan keys: "
                    f"{_key_repr(owner[name])} and {_key_repr(key)}"
                )
            owner[name] = key
            if isinstance(value, ParallelStyle):
                value.check(key, name, module)
            matches.append(_Match(name, module, key, value))
    names = sorted(owner)
    for name in names:
        for other in names:
            if other != name and (name == "" or other.startswith(name + ".")):
                raise ValueError(
                    f"plan keys {_key_repr(owner[name])} and {_key_repr(owner[other])} match nested "
                    f"modules {name or '<root>'!r} and {other!r}; a swapped module's children cannot be "
                    "swapped too"
                )
    return matches


def _build(match: _Match, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    if isinstance(match.value, ParallelStyle):
        new = match.value.build(match.name, module, mesh)
    else:
        new = match.value(match.name, module, mesh)
    if not isinstance(new, nn.Module):
        raise TypeError(
            f"plan key {_key_repr(match.key)}: partition function returned {type(new).__name__} "
            f"for {match.name!r}, expected an nn.Module"
        )
    return new


def parallelize_module(model: nn.Module, plan: Mapping, *, mesh: Optional[DeviceMesh] = None) -> nn.Module:
    """Swap the modules ``plan`` matches for their distributed twins, in place.

    Returns the model (a new object only when the plan matches the root
    ``""``). Every key is resolved and checked before anything changes: a key
    that matches nothing, a module matched by two keys, or a style given a
    module type it cannot handle raises ``ValueError`` naming the key and module.

    Build the optimizer **after** this call: swapped parameters are new objects.
    """
    mesh = resolve_mesh(mesh, (1, 2))  # 2-D only for domain styles sharding two dims
    matches = _match_plan(model, plan)
    if any(p.grad is not None for m in matches for p in m.module.parameters()):
        warnings.warn(
            "parallelize_module: swapped modules already have gradients; an optimizer built before "
            "this call still holds the old parameters. Build the optimizer after parallelize_module.",
            stacklevel=2,
        )
    for match in matches:
        new = _build(match, match.module, mesh)
        if match.name == "":
            model = new
            continue
        parent_name, _, child = match.name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    styles = {id(m.value): m.value for m in matches if isinstance(m.value, ParallelStyle)}
    for style in styles.values():
        model = style.finalize(model, mesh)
    return model


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _collectives(module: nn.Module) -> str:
    """Collectives per step of ``module`` and everything inside it, e.g. ``fwd: all_reduce; bwd: -``."""
    fwd: Dict[str, int] = {}
    bwd: Dict[str, int] = {}
    described = False
    for sub in module.modules():
        describe = getattr(sub, "collectives", None)
        if describe is None:
            continue
        described = True
        for names, counts in zip(describe(), (fwd, bwd)):
            for name in names:
                counts[name] = counts.get(name, 0) + 1
    if not described:
        return "?"
    text = lambda c: ", ".join(n if k == 1 else f"{n} x{k}" for n, k in c.items()) or "-"  # noqa: E731
    return f"fwd: {text(fwd)}; bwd: {text(bwd)}"


@dataclass
class Explanation:
    """What :func:`explain` found: one row per swapped module, plus totals."""

    rows: List[Tuple[str, str, str, str, int, int, str]]
    world_size: int
    total_before: int
    total_after: int

    def __str__(self) -> str:
        head = ("module", "key", "before", "after", "param bytes (serial)", "param bytes / rank", "collectives per step")
        body = [tuple(str(c) for c in r) for r in self.rows]
        body.append(("(whole model)", "", "", "", str(self.total_before), str(self.total_after), ""))
        widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        sep = "  ".join("-" * w for w in widths)
        return "\n".join([f"plan on a mesh of {self.world_size} ranks", line(head), sep] + [line(r) for r in body])


def explain(model: nn.Module, plan: Mapping, mesh: Optional[DeviceMesh] = None, *, print_table: bool = True) -> Explanation:
    """Show what :func:`parallelize_module` would swap, without changing ``model``.

    For each matched module: the plan key, types before and after, parameter
    bytes before (serial) and per rank after, and the collectives the twin
    issues per forward and backward. The twins are built on copies and thrown
    away. Returns an :class:`Explanation` (``str()`` is the table) and prints it
    unless ``print_table=False``.
    """
    mesh = resolve_mesh(mesh, (1, 2))
    matches = _match_plan(model, plan)
    rows = []
    swapped_before = swapped_after = 0
    for match in matches:
        new = _build(match, copy.deepcopy(match.module), mesh)
        if isinstance(match.value, ParallelStyle):
            new = match.value.finalize(new, mesh)
        before, after = _param_bytes(match.module), _param_bytes(new)
        swapped_before += before
        swapped_after += after
        rows.append(
            (match.name or "<root>", _key_repr(match.key), type(match.module).__name__, type(new).__name__,
             before, after, _collectives(new))
        )
    total = _param_bytes(model)
    result = Explanation(rows, mesh.size(), total, total - swapped_before + swapped_after)
    if print_table:
        print(result)
    return result
