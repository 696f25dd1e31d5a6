"""The domain-region convention: which modules of a region see sharded data and which replicated.

Convention (DESIGN §2.4): a sharded tensor's gradient is the gradient of this rank's elements;
a replicated tensor's gradient is the full gradient, the same on every rank. So

* a module with replicated parameters applied to **sharded** data (a per-pixel Linear, a
  channel LayerNorm, a time-embedding MLP whose output is added to the shards) gets only its
  shard's share: :class:`~tplayers.DomainReplicated` sums its gradients over the domain;
* a module applied to **replicated** data (the head after a global pool) already gets the full
  gradient: it is left exactly as it is (wrapping it would double it on 2 ranks);
* a global reduction (an adaptive pool to size 1 along every sharded dim) turns sharded data
  into replicated data (all-reduce forward, identity backward).

DomainParallel sees data flow only through ``nn.Sequential``: after a global reduction, the
remaining children of that Sequential see replicated data. Inside a custom ``forward`` the flow
is invisible, so a global reduction there is a ``ValueError`` (unless a sibling
:class:`~tplayers.ReplicatedBranch` declares where the replicated data goes, as in
squeeze-excitation: the branch's output gradient is summed, so the pool's is full) naming it and the modules that
might consume it (end the region before the pool, write that part as an ``nn.Sequential``, or
route the replicated branch through :class:`~tplayers.ReplicatedBranch`), never a silent 2x.
"""

from __future__ import annotations

from typing import Sequence, Set

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._common import ShardedModule
from tplayers.layers.branch import ReplicatedBranch
from tplayers.layers.replicated import DomainReplicated

__all__ = ["replicated_consumers", "wrap_region"]

_ADAPTIVE = ("AdaptiveAvgPool", "AdaptiveMaxPool")


def _reduces_domain(m: nn.Module, shard_dims: Sequence[int], name: str) -> bool:
    """Whether ``m`` (an adaptive pool, nn or twin) makes every sharded dim size 1 (replicated)."""
    kind = type(m).__name__
    if not any(k in kind for k in _ADAPTIVE) or not hasattr(m, "output_size"):
        return False
    size = m.output_size
    ones = [(size[d - 2] if isinstance(size, (tuple, list)) else size) == 1 for d in shard_dims]
    if any(ones) and not all(ones):
        raise ValueError(f"DomainParallel: {name or '<root>'} ({kind}, output_size={size!r}) reduces some sharded "
                         f"dims {tuple(shard_dims)} to size 1 but not all: its output would be replicated along "
                         "part of the mesh only, which the region convention does not cover; pool every sharded "
                         "dim to 1 or end the region before it")
    return all(ones)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _flow(m: nn.Module, name: str, dims, skip: Set[int]) -> str:
    """Output kind of ``m`` on a sharded input: 'sharded', 'replicated' or 'unknown'."""
    if _reduces_domain(m, dims, name):
        return "replicated"
    if isinstance(m, (ReplicatedBranch, ShardedModule, DomainReplicated)) or not m._modules:
        return "sharded"
    if isinstance(m, nn.Sequential):
        state = "sharded"
        for cname, c in m.named_children():
            if state == "replicated":
                skip.add(id(c))  # sees replicated data: left exactly as it is
            elif state == "unknown" and _has_params(c):
                raise ValueError(
                    f"DomainParallel: {_join(name, cname)} ({type(c).__name__}) follows a module whose custom "
                    "forward contains a global pool, so DomainParallel cannot tell whether it sees sharded or "
                    "replicated data. End the domain region before the pool (put DomainParallel on the trunk "
                    "only), or write that module as an nn.Sequential")
            elif state == "sharded":
                state = _flow(c, _join(name, cname), dims, skip)
        return state
    states = {cname: _flow(c, _join(name, cname), dims, skip) for cname, c in m.named_children()}
    if all(s == "sharded" for s in states.values()):
        return "sharded"
    if any(isinstance(c, ReplicatedBranch) for c in m.children()):
        return "sharded"  # declared: the pooled (replicated) data feeds the ReplicatedBranch, as in SE
    reducers = [_join(name, c) for c, s in states.items() if s != "sharded"]
    consumers = [_join(name, c) for c, mod in m.named_children()
                 if states[c] == "sharded" and _has_params(mod)]
    consumers += [name or "<root>"] if next(m.parameters(recurse=False), None) is not None else []
    if consumers:
        raise ValueError(
            f"DomainParallel: {', '.join(reducers)} turns the sharded dims into a replicated tensor inside the "
            f"custom forward of {name or '<root>'} ({type(m).__name__}), where DomainParallel cannot see which "
            f"of {', '.join(consumers)} consume it (a module applied to replicated data must not have its "
            "gradient summed over the domain, one applied to sharded data must). End the domain region before "
            "the pool (put DomainParallel on the trunk, e.g. a submodule key, and keep the head outside), write "
            "that part as an nn.Sequential, or wrap the replicated branch in tplayers.ReplicatedBranch")
    return "unknown"


def replicated_consumers(region: nn.Module, shard_dims: Sequence[int], name: str = "") -> Set[int]:
    """Ids of the modules of ``region`` that see replicated data (raises where it cannot tell)."""
    skip: Set[int] = set()
    _flow(region, name, tuple(shard_dims), skip)
    return skip


def wrap_region(module: nn.Module, mesh: DeviceMesh, skip: Set[int]) -> nn.Module:
    """Wrap (bottom-up) every module of the region owning direct parameters applied to sharded data."""
    if id(module) in skip or isinstance(module, (ShardedModule, DomainReplicated, ReplicatedBranch)):
        return module
    for child_name, child in list(module.named_children()):
        new = wrap_region(child, mesh, skip)
        if new is not child:
            setattr(module, child_name, new)
    if next(module.parameters(recurse=False), None) is not None:
        return DomainReplicated(module, mesh)
    return module
