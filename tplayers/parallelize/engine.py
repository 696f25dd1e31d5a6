"""Plan matching and :func:`parallelize_module`: the plan is data applied by one function."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.agree import exchange_agreed
from tplayers.mesh import resolve_mesh
from tplayers.parallelize.aliases import check_aliases_kept, check_shared_descendants, inside, module_names
from tplayers.parallelize.attention_dropout import guard_attention_dropout
from tplayers.parallelize.attention_groups import check_attention_groups
from tplayers.parallelize.heads import localize_heads
from tplayers.parallelize.source import (
    check_src_rank,
    partition_inputs,
    plan_from_source,
    serial_tensors,
    structure_digest,
)
from tplayers.parallelize.styles import ParallelStyle, PartitionFn, PlanKey, key_repr
from tplayers.parallelize.ties import check_tie_owners, find_ties, retie

__all__ = ["parallelize_module", "match_plan", "build_match"]


@dataclass
class _Match:
    name: str  # the module's first name (``named_modules`` order)
    module: nn.Module
    key: PlanKey
    value: Union[ParallelStyle, PartitionFn]
    aliases: Tuple[str, ...] = ()  # every name of the module (``name`` first): all get the replacement


def match_plan(model: nn.Module, plan: Mapping) -> List[_Match]:
    """Resolve every key of ``plan`` to modules; validate everything before any change.

    A key matches module *objects*: one reachable under several names (``self.b = self.a``)
    is matched once, whichever of its names the key matches, and replaced under all of them.
    """
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a mapping of keys to styles, got {type(plan).__name__}")
    modules = list(model.named_modules(remove_duplicate=False))
    names_of = module_names(model)
    owner: Dict[int, Tuple[PlanKey, str]] = {}  # id(module) -> (key, name it matched)
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
                f"plan key {key_repr(key)}: value must be a ParallelStyle or a callable "
                f"fn(name, module, mesh), got {type(value).__name__}"
            )
        if not found:
            candidates = [f"{n or '<root>'} ({type(m).__name__})" for n, m in modules]
            raise ValueError(f"plan key {key_repr(key)} matches no module; candidates: " + ", ".join(candidates))
        for name, module in found:
            if id(module) in owner:
                okey, oname = owner[id(module)]
                if okey is key:
                    continue  # another name of a module this key already matched
                alias = f" ({oname!r} and {name!r} are one module)" if oname != name else ""
                raise ValueError(
                    f"module {name or '<root>'!r} ({type(module).__name__}) is matched by two plan keys: "
                    f"{key_repr(okey)} and {key_repr(key)}{alias}"
                )
            owner[id(module)] = (key, name)
            if isinstance(value, ParallelStyle):
                value.check(key, name, module)
            aliases = tuple(names_of[id(module)])
            matches.append(_Match(aliases[0], module, key, value, aliases))
    for m in matches:
        for other in matches:
            pair = next(
                ((a, b) for a in m.aliases for b in other.aliases if other is not m and a != b and inside(b, a)), None
            )
            if pair is not None:
                raise ValueError(
                    f"plan keys {key_repr(m.key)} and {key_repr(other.key)} match nested modules "
                    f"{pair[0] or '<root>'!r} and {pair[1]!r}; a swapped module's children cannot be swapped too"
                )
    check_shared_descendants(matches, names_of)
    return matches


def build_match(match: _Match, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    if isinstance(match.value, ParallelStyle):
        new = match.value.build(match.name, module, mesh)
    else:
        new = match.value(match.name, module, mesh)
    if not isinstance(new, nn.Module):
        raise TypeError(
            f"plan key {key_repr(match.key)}: partition function returned {type(new).__name__} "
            f"for {match.name!r}, expected an nn.Module"
        )
    return new


def parallelize_module(
    model: nn.Module, plan: Mapping, *, mesh: Optional[DeviceMesh] = None, src_rank: Optional[int] = 0
) -> nn.Module:
    """Swap the modules ``plan`` matches for their distributed twins, in place.

    Returns the model (a new object only when the plan matches the root
    ``""``). Every key is resolved and checked before anything changes: a key
    that matches nothing, a module matched by two keys, or a style given a
    module type it cannot handle raises ``ValueError`` naming the key and module.

    Tied parameters (``lm_head.weight is wte.weight``) stay one Parameter when
    both modules are swapped into twins that shard it alike (``RowParallel()``
    on the embedding, ``ColumnParallel()`` on the head); a plan that would
    break a tie (one side swapped, or both sharded differently) raises
    ``ValueError`` naming both modules.

    ``src_rank`` (an index into ``mesh``, default 0): every parameter and buffer
    of the result, of the whole model and not only of swapped modules, comes
    from that rank's model, like DTensor's ``src_data_rank``. Shards are cut
    from its serial tensors and scattered, everything else is broadcast, one
    flattened scatter and broadcast per dtype (a shard in a layout that
    :meth:`~tplayers.ShardSpec.for_index` cannot rebuild for the other ranks
    travels whole in the broadcast and each rank takes its slice). So ranks seeded differently (the
    default) still get one consistent model: rank ``src_rank``'s. Before any
    value moves, one small exchange checks that every rank's model has the same
    tensor names, shapes and dtypes, the same plan result and the same
    ``src_rank``, and carries any rank's build error (so every rank raises).
    ``src_rank=None`` keeps each rank's own values without communication (use
    it when every rank built the model identically, e.g. under one seed).
    A partition function gets, on every rank, a copy of rank ``src_rank``'s
    serial module (broadcast before it runs, with that rank's CPU generator
    state, so a layer it draws anew is drawn alike) and its output is kept as
    built, never re-cut: a function that regroups rows builds rank
    ``src_rank``'s model by construction.

    A module reachable under several names (``self.b = self.a``) is one module:
    a key matching any of its names replaces it under all of them. Separate
    q/k/v/o projections of one attention are checked together (see
    :func:`~tplayers.parallelize.attention_groups.check_attention_groups`).

    A plan that fails partway (a partition function or a layer constructor
    raising, a disagreement between ranks, a failed transfer) leaves ``model``
    exactly as it was: every replacement is built before any is swapped in,
    values are written only after every transfer completed, and a style that
    rewires a subtree while building (``DomainParallel``) is undone.

    Build the optimizer **after** this call: swapped parameters are new objects (a warning
    says so when swapped modules already hold gradients).

    Args:
        model: the serial model; changed in place.
        plan: ``{key: value}``: a key is a regex ``re.fullmatch``-ed against dotted module names
            (``""`` is the root) or an ``nn.Module`` subclass (matches by type); a value is a
            :class:`~tplayers.ParallelStyle` or a function ``fn(name, module, mesh) -> nn.Module``.
        mesh: a 1-D mesh (2-D for domain styles sharding two dims); ``None``: the default mesh.
        src_rank: the mesh position whose values every rank gets, or ``None`` (no communication).

    Returns:
        The model (a new object only when the plan matches the root ``""``).

    Raises:
        ValueError: a key matching nothing, a module matched twice, a style given a module it
            cannot handle, a broken tie, ranks whose models or plans differ (on every rank).
        TypeError: a partition function returning something other than an ``nn.Module``.

    Example (``torchrun --nproc-per-node 3``, or 2, or plain ``python``; ranks seeded differently)::

        import torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        torch.manual_seed(torch.distributed.get_rank())      # a different model on every rank
        model = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8), nn.LayerNorm(8))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        model = tplayers.parallelize_module(model, plan, mesh=mesh)   # now rank 0's model everywhere
        x = torch.ones(2, 8)
        out = [torch.empty(2, 8) for _ in range(mesh.size())]
        torch.distributed.all_gather(out, model(x).detach())
        assert all(torch.equal(o, out[0]) for o in out)      # one model: the same output on every rank
    """
    mesh = resolve_mesh(mesh, (1, 2))  # 2-D only for domain styles sharding two dims
    check_src_rank(src_rank, mesh)
    matches = match_plan(model, plan)
    check_attention_groups(model, matches, mesh)
    ties = find_ties(model)
    check_tie_owners(matches, ties)
    if any(p.grad is not None for m in matches for p in m.module.parameters()):
        warnings.warn(
            "parallelize_module: swapped modules already have gradients; an optimizer built before "
            "this call still holds the old parameters. Build the optimizer after parallelize_module.",
            stacklevel=2,
        )
    snapshot = _snapshot(model)
    names_of, objects = module_names(model), {id(m): m for m in model.modules()}
    serial = serial_tensors(model)
    before = structure_digest(model)
    try:  # build every replacement first, then swap; any failure puts the tree back as it was
        error, source = None, None
        inputs, rng = {}, None
        functions = [m for m in matches if not isinstance(m.value, ParallelStyle)]
        if src_rank is not None and functions:  # collective: every rank gets rank src_rank's modules
            inputs, rng = partition_inputs(functions, mesh, src_rank, before)
        try:
            model, built = _swap_all(model, matches, mesh, ties, inputs, rng)
            check_aliases_kept(model, names_of, objects)
            if src_rank is not None:
                # a function's output is rank src_rank's by construction: not re-cut (a tensor it shares
                # with a style's twin, e.g. a tie, is sourced as the style's)
                styled = {id(t) for m, new in built if id(m) not in inputs for t in serial_tensors(new).values()}
                exclude = frozenset(
                    id(t)
                    for m, new in built
                    if id(m) in inputs
                    for t in serial_tensors(new).values()
                    if id(t) not in styled
                )
                source = plan_from_source(model, serial, mesh, exclude)
        except Exception as err:  # noqa: BLE001 - travels to every rank below, then re-raised
            error = err
        if src_rank is None:
            if error is not None:
                raise error
            return model
        config = {
            "model tensors": before,
            "parallelized tensors": source.digest() if source else "",
            "src_rank": src_rank,
        }
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        row = [int(bool(source is not None and source.sliced))]
        table = exchange_agreed(row, config, groups, "parallelize_module", "src_rank.check", error=error)
        if any(r[0] for line in table for r in line):  # some rank holds a layout for_index cannot rebuild
            source.agree_layouts(mesh)
        source.run(serial, mesh, src_rank)
    except BaseException:
        _restore(snapshot)
        raise
    return model


def _swap_all(model: nn.Module, matches: List[_Match], mesh: DeviceMesh, ties=(), inputs=None, rng=None):
    """Build every replacement (partition functions from ``inputs`` where given, under the
    generator state ``rng``), then swap them in; returns ``(model, [(match, replacement)])``."""
    inputs = inputs or {}
    with torch.random.fork_rng(devices=[], enabled=rng is not None):
        if rng is not None:
            torch.set_rng_state(rng)
        built = [(match, build_match(match, inputs.get(id(match), match.module), mesh)) for match in matches]
    retie(built, ties)  # tied parameters sharded alike stay one Parameter (raises if not alike)
    for match, new in built:
        if match.name == "":
            model = new
            continue
        for alias in match.aliases or (match.name,):  # every name of an aliased module: one replacement
            parent_name, _, child = alias.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
    styles = {id(m.value): m.value for m in matches if isinstance(m.value, ParallelStyle)}
    for style in styles.values():
        model = style.finalize(model, mesh)
    for module in model.modules():
        localize_heads(module)  # split heads: a transformers attention's head counts are this rank's
    guard_attention_dropout(model)  # split heads: attention dropout in training is refused
    return model, built


def _snapshot(model: nn.Module) -> List[tuple]:
    """Every module's children, so a failed plan can restore the tree exactly."""
    return [(m, dict(m._modules)) for m in model.modules()]


def _restore(snapshot: List[tuple]) -> None:
    for module, children in snapshot:
        module._modules.clear()
        module._modules.update(children)
