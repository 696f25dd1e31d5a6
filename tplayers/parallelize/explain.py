""":func:`explain`: what a plan would swap, bytes per rank and collectives, without changing anything."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.buckets import bucketed_params, plan_buckets
from tplayers.mesh import resolve_mesh
from tplayers.parallelize.attention_groups import check_attention_groups
from tplayers.parallelize.engine import build_match, match_plan
from tplayers.parallelize.styles import ParallelStyle, key_repr

__all__ = ["explain", "Explanation"]


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _already_counted(module: nn.Module, new: nn.Module, counted: set) -> Tuple[int, int]:
    """Bytes of ``module``'s parameters already in the totals (tied to an earlier match), serial
    and in the twin ``new`` (the same names); the rest of its parameters are marked counted."""
    before = after = 0
    for name, p in module.named_parameters():
        if id(p) in counted:
            before += p.numel() * p.element_size()
            try:
                q = new.get_parameter(name)
            except AttributeError:
                q = p  # the twin renames it: count it as kept whole
            after += q.numel() * q.element_size()
        counted.add(id(p))
    return before, after


def _collectives(module: nn.Module) -> str:
    """Collectives per step of ``module`` and everything inside it, e.g. ``fwd: all_reduce; bwd: -``."""
    fwd: Dict[str, int] = {}
    bwd: Dict[str, int] = {}
    described = False
    bucketed = set()  # twins inside a domain region: its gradient buckets sum their parameter grads
    for sub in module.modules():
        if _region_of(sub) is not None:
            bucketed |= {id(m) for m in sub.modules() if getattr(m, "bucketed_params", False)}
    for sub in module.modules():
        region = _region_of(sub)  # a domain region's per-call agreement and guard
        describe = region.collectives if region is not None else getattr(sub, "collectives", None)
        if describe is None:
            continue
        described = True
        lists = describe()
        if region is not None:  # one async all-reduce per bucket replaces the twins' own
            lists = (
                lists[0],
                list(lists[1])
                + ["all_reduce (parameter-gradient bucket, conv weights+biases)"] * _buckets(region, sub),
            )
        elif id(sub) in bucketed:
            lists = (lists[0], [n for n in lists[1] if "grads)" not in n])
        for names, counts in zip(lists, (fwd, bwd)):
            for name in names:
                counts[name] = counts.get(name, 0) + 1
    if not described:
        return "?"
    text = lambda c: ", ".join(n if k == 1 else f"{n} x{k}" for n, k in c.items()) or "-"  # noqa: E731
    return f"fwd: {text(fwd)}; bwd: {text(bwd)}"


def _region_of(module: nn.Module):
    """The domain region bound to ``module`` by its forward pre-hook, or ``None``."""
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if hasattr(owner, "collectives") and hasattr(owner, "agree"):
            return owner
    return None


def _buckets(region, root: nn.Module) -> int:
    """All-reduces of the gradient buckets of one call of ``root``'s domain region
    (:mod:`tplayers.comm.buckets`): one per bucket and mesh dim of more than one rank."""
    mesh = region.mesh
    dims = sum(1 for i in range(mesh.ndim) if mesh.size(i) > 1)
    return dims * len(plan_buckets(bucketed_params(root)))


@dataclass
class Explanation:
    """What :func:`explain` found: one row per swapped module, plus totals."""

    rows: List[Tuple[str, str, str, str, int, int, str]]
    world_size: int
    total_before: int
    total_after: int

    def __str__(self) -> str:
        head = (
            "module",
            "key",
            "before",
            "after",
            "param bytes (serial)",
            "param bytes / rank",
            "collectives per step",
        )
        body = [tuple(str(c) for c in r) for r in self.rows]
        body.append(("(whole model)", "", "", "", str(self.total_before), str(self.total_after), ""))
        widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        sep = "  ".join("-" * w for w in widths)
        return "\n".join([f"plan on a mesh of {self.world_size} ranks", line(head), sep] + [line(r) for r in body])


def explain(
    model: nn.Module, plan: Mapping, mesh: Optional[DeviceMesh] = None, *, print_table: bool = True
) -> Explanation:
    """Show what :func:`parallelize_module` would swap, without changing ``model``.

    For each matched module: the plan key, types before and after, parameter
    bytes before (serial) and per rank after, and the collectives the twin
    issues per forward and backward. The twins are built on copies and thrown
    away. Returns an :class:`Explanation` (``str()`` is the table) and prints it
    unless ``print_table=False``.

    Args:
        model: the serial model (left unchanged).
        plan: a plan, as :func:`~tplayers.parallelize_module` takes it.
        mesh: the mesh the plan would use (``None``: :func:`tplayers.default_mesh`).
        print_table: print the table.

    Returns:
        An :class:`Explanation`: ``rows`` (module, key, type before, type after, parameter bytes
        serial and per rank, collectives per step), ``total_before``, ``total_after``.

    Raises:
        ValueError: what :func:`~tplayers.parallelize_module` would raise for the plan (a key
            matching nothing, a module matched twice, a style given a module it cannot handle).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        from torch import nn
        mesh = tplayers.init_mesh()
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        plan = {"0": tplayers.ColumnParallel(), "2": tplayers.RowParallel()}
        table = tplayers.explain(model, plan, mesh, print_table=False)
        assert isinstance(model[0], nn.Linear)                    # nothing changed
        assert [r[3] for r in table.rows] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert "all_reduce" in str(table) or mesh.size() == 1    # Row's forward, Column's backward
    """
    mesh = resolve_mesh(mesh, (1, 2))
    matches = match_plan(model, plan)
    check_attention_groups(model, matches, mesh)
    rows = []
    swapped_before = swapped_after = 0
    counted = set()  # ids of serial parameters already in the totals (a tied matrix counts once)
    for match in matches:
        new = build_match(match, copy.deepcopy(match.module), mesh)
        if isinstance(match.value, ParallelStyle):
            new = match.value.finalize(new, mesh)
        before, after = _param_bytes(match.module), _param_bytes(new)
        shared_before, shared_after = _already_counted(match.module, new, counted)
        swapped_before += before - shared_before
        swapped_after += after - shared_after
        rows.append(
            (
                match.name or "<root>",
                key_repr(match.key),
                type(match.module).__name__,
                type(new).__name__,
                before,
                after,
                _collectives(new),
            )
        )
    total = _param_bytes(model)
    result = Explanation(rows, mesh.size(), total, total - swapped_before + swapped_after)
    if print_table:
        print(result)
    return result
