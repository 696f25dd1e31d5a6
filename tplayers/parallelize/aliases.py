"""Modules reachable under more than one name (``self.up2 = self.up1 = nn.Upsample(...)``).

``named_modules()`` and ``named_children()`` list a shared module once, under its first
name, so a plan that walked them would swap only that name and leave the serial module
under the others. The plan works on module *objects* instead:

- a plan key matching any name of a module matches the object, and the replacement is
  set under **every** name, so aliases stay aliases (one replacement, one set of
  Parameters, as the serial model has one module);
- a module inside the subtree of one matched module (a ``DomainParallel`` region, a
  container given to a partition function) that holds parameters or buffers and is also
  reachable from outside that subtree (from outside every match, or from another match's
  subtree) cannot get one replacement for both uses: that is a ``ValueError`` naming both
  names. A stateless shared module (an activation, an ``nn.Upsample``) is rebuilt on each
  side, which computes the same function.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from torch import nn

from tplayers.parallelize.styles import key_repr

__all__ = ["module_names", "inside", "check_shared_descendants", "check_aliases_kept"]


def module_names(model: nn.Module) -> Dict[int, List[str]]:
    """``{id(module): every dotted name it is reachable under}`` in ``named_modules`` order."""
    names: Dict[int, List[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return names


def inside(name: str, root: str) -> bool:
    """Whether dotted ``name`` is ``root`` or lies below it (``""`` is the model's root)."""
    return root == "" or name == root or name.startswith(root + ".")


def _holds_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _owner(matches: Sequence, name: str):
    """The match whose subtree holds ``name`` (any of its aliases), or ``None``."""
    for m in matches:
        if any(inside(name, alias) for alias in m.aliases):
            return m
    return None


def check_shared_descendants(matches: Sequence, names_of: Dict[int, List[str]]) -> None:
    """``ValueError`` for a module with parameters or buffers inside one matched subtree and also
    reachable outside it, which no single replacement can serve (see the module docstring)."""
    checked = set()
    for match in matches:
        for sub in match.module.modules():
            if sub is match.module or id(sub) in checked:
                continue
            checked.add(id(sub))
            names = names_of.get(id(sub), [])
            owners = [_owner(matches, n) for n in names]
            if len({id(o) for o in owners}) < 2 or not _holds_state(sub):
                continue
            (a, oa), (b, ob) = _first_two_sides(names, owners)
            raise ValueError(
                f"module {a!r} ({type(sub).__name__}) is also reachable as {b!r}, one module with its own "
                f"parameters/buffers under two names, but {a!r} is {_where(oa)} and {b!r} is {_where(ob)}: no "
                "single replacement serves both names. Plan the module under every name alike (e.g. one key "
                "matching both, or put both uses inside one matched subtree), or give each use its own module"
            )


def _first_two_sides(names: List[str], owners: List[Optional[object]]):
    first = (names[0], owners[0])
    for n, o in zip(names, owners):
        if o is not first[1]:
            return first, (n, o)
    raise AssertionError("called with a single owner")  # pragma: no cover


def _where(match) -> str:
    if match is None:
        return "outside every module the plan swaps"
    return f"inside {match.name or '<root>'!r} (plan key {key_repr(match.key)})"


def check_aliases_kept(model: nn.Module, names_of: Dict[int, List[str]], before: Dict[int, nn.Module]) -> None:
    """After the swap: ``ValueError`` if a module with parameters or buffers that had several names
    in the serial model now has different modules under them (a style rewired one name only).

    ``before`` is ``{id: module}`` of the serial model (ids in ``names_of``). Names that no longer
    exist (inside a replaced subtree of another shape) are not compared.
    """
    for key, names in names_of.items():
        if len(names) < 2 or not _holds_state(before[key]):
            continue
        now = []
        for name in names:
            try:
                now.append((name, model.get_submodule(name)))
            except AttributeError:
                continue
        for name, mod in now[1:]:
            if mod is not now[0][1]:
                raise ValueError(
                    f"modules {now[0][0]!r} and {name!r} are one {type(before[key]).__name__} in the model, but the "
                    f"plan left {type(now[0][1]).__name__} under {now[0][0]!r} and {type(mod).__name__} under "
                    f"{name!r}, so the two uses would no longer be one module (e.g. only one wrapped to sum its "
                    "gradient over the domain). Give the module a single name, or plan it so every name gets the "
                    "same replacement"
                )
