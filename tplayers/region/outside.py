"""Sharded data outside its region's call: the ops applied to a :class:`~tplayers.domain.tensor.DomainTensor`.

A region call opened where no guarded call runs returns its sharded outputs as ``DomainTensor``
(:func:`wrap_outputs`). Each torch op later applied to one outside every guarded call comes here
(:func:`run_op`): the region's *outside guard*, a :class:`~tplayers.region.guard.RegionGuard`
that is never pushed on the mode stack, tags the arguments with their layouts and applies the same
rule as inside the region (:func:`tplayers.region.dispatch.handle`: local, routed or refused);
decisions read from local sizes are agreed at once (one small all-gather, :meth:`RegionGuard.settle`),
so a refusal is a ``ValueError`` on every rank; the sharded results come back as ``DomainTensor``.
See docs/design.md (the region guard).
"""

from __future__ import annotations

from typing import Any

import torch

from tplayers.domain.tensor import DomainTensor, plain, wrap
from tplayers.region.dispatch import handle
from tplayers.region.guard import RegionGuard

__all__ = ["run_op", "wrap_outputs"]


def outside_guard(region) -> RegionGuard:
    """The guard that checks ``region``'s data outside its calls (made once per region)."""
    g = region.__dict__.get("_outside")
    if g is None:
        g = RegionGuard(region.mesh, region.shard_dims, f"{region.name} (outside its call)")
        g.check = True  # no entry agreement here: every decision read from local sizes is agreed
        region._outside = g
    return g


def run_op(region, func, args, kwargs) -> Any:
    """Apply ``func`` to arguments holding ``region``'s ``DomainTensor`` s as the region's guard would."""
    g = outside_guard(region)

    def unwrap(a):
        if isinstance(a, DomainTensor):
            if a._tp_region.mesh != region.mesh:
                raise ValueError(
                    f"domain region {region.name}: an op mixes tensors sharded over different meshes "
                    f"(regions {region.name} and {a._tp_region.name})"
                )
            return g.mark(plain(a), a._tp_layout)
        if isinstance(a, (list, tuple)) and any(isinstance(b, DomainTensor) for b in a):
            return type(a)(unwrap(b) for b in a) if type(a) in (list, tuple) else a
        return a

    args = tuple(unwrap(a) for a in args)
    kwargs = {k: unwrap(v) for k, v in kwargs.items()}
    g.where[:] = [g.where[0]]
    try:
        out = handle(g, func, args, kwargs)
        g.settle()
    finally:
        g._bounded.clear()
    return wrap_outputs(g, region, out)


def wrap_outputs(g: RegionGuard, region, output: Any) -> Any:
    """``output`` of a region call with each tensor the call's guard ``g`` tagged as sharded made a
    ``DomainTensor`` (tensors, lists, tuples, named tuples and mappings such as diffusers' outputs)."""
    if isinstance(output, torch.Tensor):
        lay = g.layout(output)
        return output if lay is None or isinstance(output, torch.nn.Parameter) else wrap(output, region, lay)
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(wrap_outputs(g, region, o) for o in output))
    if type(output) in (list, tuple):
        return type(output)(wrap_outputs(g, region, o) for o in output)
    if isinstance(output, dict):
        for k in list(output.keys()):
            new = wrap_outputs(g, region, output[k])
            if new is not output[k]:
                output[k] = new
        return output
    return output
