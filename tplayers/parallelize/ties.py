"""Tied parameters (``lm_head.weight is wte.weight``) through :func:`parallelize_module`.

A tie survives when every module holding the shared Parameter is swapped by
the plan into a twin that shards it the same way (same global shape, dim and
ranges on every rank): the twins then get one Parameter again. Anything else
would silently untie the weights (the copies drift apart after one step), so
it raises ``ValueError`` naming both modules, before the model changes.

A whole module shared under two names (``self.b = self.a``) is not a tie between two modules:
the plan replaces it under every name with one replacement (:mod:`tplayers.parallelize.aliases`),
so its Parameters stay one set; a module's names are its aliases throughout this file.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tplayers.layers._common import ShardedModule
from tplayers.parallelize.aliases import inside
from tplayers.parallelize.styles import key_repr

__all__ = ["find_ties", "check_tie_owners", "retie"]

Member = Tuple[str, str]  # (module name, parameter name)


def find_ties(model: nn.Module) -> List[List[Member]]:
    """Groups of ``(module name, parameter name)`` holding one Parameter object (groups of 2+)."""
    groups: Dict[int, List[Member]] = {}
    seen_modules = set()
    for mname, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in seen_modules:  # a module reachable under two names is one module
            continue
        seen_modules.add(id(mod))
        for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            groups.setdefault(id(p), []).append((mname, pname))
    return [g for g in groups.values() if len(g) > 1]


def _owner(matches, mname: str):
    for m in matches:
        if any(inside(mname, alias) for alias in m.aliases or (m.name,)):
            return m
    return None


def _where(member: Member) -> str:
    mname, pname = member
    return f"{mname}.{pname}" if mname else pname


def check_tie_owners(matches: Sequence, ties: List[List[Member]]) -> None:
    """Raise ``ValueError`` for a tie the plan would break: one side swapped and the other not, or
    a side swapped as part of a larger subtree while the other is swapped on its own."""
    for group in ties:
        owners = [_owner(matches, mname) for mname, _ in group]
        if len({id(o) for o in owners}) == 1:
            continue  # untouched, or inside one swapped subtree whose style handles it
        for (a, oa), (b, ob) in ((x, y) for x in zip(group, owners) for y in zip(group, owners)):
            if oa is ob:
                continue
            if (
                oa is None
                or ob is None
                or a[0] not in (oa.aliases or (oa.name,))
                or b[0] not in (ob.aliases or (ob.name,))
            ):
                plan_a = f"swapped by plan key {key_repr(oa.key)}" if oa is not None else "not in the plan"
                plan_b = f"swapped by plan key {key_repr(ob.key)}" if ob is not None else "not in the plan"
                raise ValueError(
                    f"the plan would break tied parameters: {_where(a)} and {_where(b)} are one Parameter, but "
                    f"module {a[0] or '<root>'!r} is {plan_a} and module {b[0] or '<root>'!r} is {plan_b}; "
                    "shard both the same way (e.g. RowParallel() on the embedding and ColumnParallel() on "
                    "the lm_head) or neither"
                )


def _layout(module: nn.Module, pname: str) -> Optional[tuple]:
    if not isinstance(module, ShardedModule):
        return None
    spec = module.shard_specs().get(pname)
    if spec is None:
        return None
    return (spec.global_shape, spec.dim, spec.spans)


def retie(built: Sequence, ties: List[List[Member]]) -> None:
    """Make the twins of tied modules share one Parameter again (the replacements only; the model
    is not touched). Raises ``ValueError`` naming both modules if they shard it differently."""
    new_of = {alias: new for match, new in built for alias in match.aliases or (match.name,)}
    for group in ties:
        if not all(mname in new_of for mname, _ in group):
            continue  # checked by check_tie_owners: all inside one swapped subtree, or none swapped
        (m0, p0), rest = group[0], group[1:]
        first = new_of[m0].get_parameter(p0)
        for mname, pname in rest:
            new = new_of[mname]
            other = new.get_parameter(pname)
            if other is first:
                continue
            la, lb = _layout(new_of[m0], p0), _layout(new, pname)
            same = la is not None and la == lb and other.shape == first.shape and other.dtype == first.dtype
            if not same or not torch.equal(other.detach(), first.detach()):
                raise ValueError(
                    f"the plan would break tied parameters: {_where((m0, p0))} and {_where((mname, pname))} are one "
                    f"Parameter, but their twins {type(new_of[m0]).__name__} and {type(new).__name__} shard it "
                    f"differently (global shape, dim, ranges: {la} vs {lb}); e.g. RowParallel() on an embedding "
                    "matches ColumnParallel() on its tied lm_head"
                )
            owner = new.get_submodule(pname.rpartition(".")[0]) if "." in pname else new
            setattr(owner, pname.rpartition(".")[2], first)
