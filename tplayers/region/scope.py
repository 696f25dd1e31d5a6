"""Where a region guard is on: a :class:`DomainRegion` bound to a module, or :func:`domain_region` by hand.

``DomainParallel`` binds a :class:`DomainRegion` to its region's root module with a forward
pre-hook and an always-called forward hook (no wrapper module: ``state_dict`` keys are unchanged),
and a pair of small hooks on every submodule that keep the module path for error messages. Each
call of the root:

1. one small agreement: every rank's local input shape, compared with the previous call's table
   (the only collective the guard adds on every call, docs/design.md (the region guard)); when any rank's partition
   changed, every rank forgets the region's cached layouts together, so a partition that changes
   on some ranks only is re-planned on all of them instead of hanging. The first call also
   compares a fingerprint of every replicated parameter and buffer of the region (ranks built
   from different seeds raise ``ValueError`` naming the tensor and the ranks);
2. a :class:`~tplayers.region.guard.RegionGuard` is pushed, the first tensor argument is tagged as
   sharded along ``shard_dims``, the forward runs guarded, and the guard is popped. On the first
   call of a partition (a table not yet run through without a refusal) the guard agrees on the
   decisions it reads from local sizes before each collective that follows them (``check``, see
   :mod:`tplayers.region.guard`), so a refusal on some ranks is a ``ValueError`` on every rank.

Under ``torch.compile`` tracing the guard does not run: a region whose eager calls needed it (routed
ops, summed replicated gradients) raises ``ValueError`` when traced; validate a model eagerly
before compiling it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from tplayers.comm.agree import exchange_agreed, value_fingerprints
from tplayers.comm.buckets import GradBuckets
from tplayers.domain.active import in_guarded_call, stepped_aside
from tplayers.domain.shard import reset_layouts
from tplayers.domain.tensor import plain
from tplayers.layers._common import replicated_tensors
from tplayers.mesh import resolve_mesh
from tplayers.region.aliases import Aliases
from tplayers.region.compiled import plainly_local, prepare_refusals, refuse_routed, refuse_unchecked
from tplayers.region.guard import RegionGuard, active_guard
from tplayers.region.outside import outside_guard, run_op, wrap_outputs

__all__ = ["DomainRegion", "domain_region", "first_tensor"]


class DomainRegion:
    """A domain region's configuration and the state it keeps across calls (routed twins, the last
    agreement table)."""

    def __init__(self, mesh, shard_dims: Sequence[int], name: str = "", outer: bool = False) -> None:
        self.mesh = resolve_mesh(mesh, (1, 2))
        self.shard_dims = tuple(int(d) for d in shard_dims)
        if len(self.shard_dims) != self.mesh.ndim:
            raise ValueError(
                f"domain region {name or '<root>'}: shard_dims {self.shard_dims} needs a "
                f"{len(self.shard_dims)}-D mesh, got a {self.mesh.ndim}-D one"
            )
        self.name = name or "<root>"
        prepare_refusals()  # before any tracing (Dynamo is imported here, not with tplayers)
        self.routes: Dict = {}
        self._table: Optional[List] = None
        # per module a call ran (the root, or a member called outside it): the last table such a call ran
        # through without a refusal (each runs its own decisions)
        self._checked: Dict[int, List] = {}
        self._values_checked = False  # replicated tensors compared across ranks (first call)
        self._stack: List[RegionGuard] = []
        self._raised: List = []  # the exception being handled when each call began (sys.exc_info)
        self._root: Optional[weakref.ref] = None  # the hooked module, weakly: its hooks hold this region
        self.needs_guard = False  # an eager call routed an op or summed a replicated gradient
        # a model around container regions: its first tensor argument is sharded when it can be (has the
        # sharded dims on every rank), else (a timestep, token ids) the model's own code is only watched
        self.outer = bool(outer)
        self.nested = False  # a region inside an outer region (whose model code may call it from a method)
        self._wraps: List[bool] = []  # per open call: whether its sharded outputs leave as DomainTensor
        self._outside = None  # the guard of this region's data outside its calls (tplayers.region.outside)
        self.aliases = Aliases()  # tags made while its calls are recomputed (nested checkpoints)

    @property
    def root(self) -> Optional[nn.Module]:
        """The module whose calls this region guards (``None`` before its first call or once it is gone).
        Held weakly: the module's hooks hold this region, and a strong reference back would keep every
        model alive until the cyclic garbage collector runs (with it its process groups, whose gloo
        threads may then be torn down during interpreter exit)."""
        return None if self._root is None else self._root()

    @root.setter
    def root(self, module: Optional[nn.Module]) -> None:
        self._root = None if module is None else weakref.ref(module)

    # copy / pickle: the mesh by reference, caches empty
    def __deepcopy__(self, memo):
        new = DomainRegion.__new__(DomainRegion)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.routes, new._table, new._stack, new._root = {}, None, [], None
        new._checked, new._values_checked, new._raised = {}, False, []
        new._wraps, new._outside = [], None
        new.needs_guard = self.needs_guard
        copied_root = memo.get(id(self.root)) if self.root is not None else None  # the module copy holding us
        if isinstance(copied_root, nn.Module):
            new.root = copied_root
        return new

    def __getstate__(self):
        return {"mesh": self.mesh, "shard_dims": self.shard_dims, "name": self.name, "outer": self.outer}

    def run_op(self, func, args, kwargs):
        """An op on this region's :class:`~tplayers.domain.tensor.DomainTensor` s outside its calls
        (:func:`tplayers.region.outside.run_op`)."""
        return run_op(self, func, args, kwargs)

    def __setstate__(self, state):
        self.__init__(state["mesh"], state["shard_dims"], state["name"], state.get("outer", False))

    def collectives(self):
        """Collectives per call: ``(forward list, backward list)``: the entry agreement; replicated tensors
        meeting the shards add one all-reduce each in backward (counted at run time by
        :func:`tplayers.count_collectives`)."""
        return ["all_gather (region entry agreement)"], ["all_reduce per replicated tensor meeting the shards"]

    # ------------------------------------------------------------------ entry / exit
    def agree(self, x) -> bool:
        """The per-call agreement (see the module docstring). Whether ``x`` is sharded: always, but in
        an ``outer`` region whose first tensor argument lacks the sharded dims on every rank."""
        groups = [self.mesh.get_group(i) for i in range(self.mesh.ndim)]
        ok = isinstance(x, torch.Tensor) and x.dim() > max(self.shard_dims)
        with stepped_aside():  # an outer guard's: this read is not the model code's (RegionGuard.note_read)
            shape = list(x.shape) if ok else []
        row = [int(ok), len(shape)] + shape + [-1] * (6 - len(shape))
        values = None
        if not self._values_checked and self.root is not None:  # first call: the replicated tensors too
            values = value_fingerprints(replicated_tensors(self.root))
        table = exchange_agreed(
            row,
            {"region": self.name, "shard_dims": self.shard_dims},
            groups,
            f"domain region {self.name}",
            tag="domain.region",
            values=values,
        )
        self._values_checked = True
        flat = [r for line in table for r in line]
        bad = [i for i, r in enumerate(flat) if not r[0]]
        if self.outer and len(bad) == len(flat):
            return False  # nothing sharded comes in: the model's code is watched (region outputs)
        if bad:
            raise ValueError(
                f"domain region {self.name}: the first tensor argument must have more than "
                f"{max(self.shard_dims)} dims on every rank; rank(s) {bad} passed something else"
            )
        if self._table is not None and self._table != flat and self.root is not None:
            reset_layouts(self.root)
            for twin in self.routes.values():
                twin.reset_layout()
        self._table = flat
        return True

    def enter(self, x, agreed: bool = False, scope: Optional[nn.Module] = None) -> RegionGuard:
        """Push this call's guard. ``agreed``: :meth:`agree` ran for this call (a ``DomainParallel``
        region); its table decides whether the guard checks (a partition not yet run through).
        Without it (``domain_region`` by hand) the guard always checks. ``scope``: the module the call
        runs (default the root; a member called outside the root's call), whose twins' gradients the
        call's buckets hold."""
        outer = active_guard()  # a model-level watch: region outputs stay visible to it
        guard = RegionGuard(self.mesh, self.shard_dims, self.name, token=None if outer is None else outer.token)
        guard.routes = self.routes
        guard.agreed = agreed
        guard.aliases = self.aliases
        if outer is not None and outer.recomputing:  # a nested region recomputed: the same record
            guard.aliases, guard.recomputing = outer.aliases, True
        scope = self.root if scope is None else scope
        guard.scope_key = id(scope)
        guard.check = not agreed or self._table != self._checked.get(guard.scope_key)
        if outer is not None:  # the same call: the shapes its code read count here too
            guard.reads = outer.reads
        if scope is not None:  # before any twin runs: the gate's backward must come last
            guard.buckets = GradBuckets.for_region(scope, guard.groups)
        guard.__enter__()
        self._stack.append(guard)
        if isinstance(x, torch.Tensor):
            guard.mark_input(x)
        return guard

    def exit(self, error: Optional[BaseException] = None) -> None:
        """Pop this call's guard, then settle its armed decisions (``error``: the exception this
        rank's forward raised, which the other ranks then raise too). A call that ran through
        without a refusal marks its partition checked."""
        if self._stack:
            guard = self._stack.pop()
            guard.__exit__(None, None, None)
            self.needs_guard |= guard.acted
            try:
                guard.settle(error)
            except ValueError:
                if error is None:
                    raise
                return  # this rank's own exception propagates; the others raise the agreed one
            if error is None and guard.agreed:
                self._checked[guard.scope_key] = self._table

    # ------------------------------------------------------------------ hooks
    def check_compilable(self) -> None:
        """Under ``torch.compile`` tracing, which the guard does not run in: raise ``ValueError`` (on every
        rank, from a graph break) unless an eager call ran through this region and needed no guard, or
        the region is plainly twins and local modules (:mod:`tplayers.region.compiled`)."""
        if self.needs_guard:
            refuse_routed(self.name)
        elif not self._checked and not plainly_local(self.root):
            refuse_unchecked(self.name)

    def pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            self.check_compilable()
            return None
        if any(g is active_guard() for g in self._stack):
            return None  # re-entered inside its own call
        if self.root is not module:  # a deep copy or an unpickled region starts without it
            self.root = module
        x = first_tensor(args, kwargs)
        outer = active_guard()
        if outer is not None and hasattr(outer, "settle"):
            outer.settle()  # a region nested in another: the outer one's decisions before this agreement
        self.open(x, wrap=self.nested and not in_guarded_call())
        return None

    def open(self, x, scope: Optional[nn.Module] = None, wrap: bool = True) -> None:
        """Agree and push this call's guard (``x``: the first tensor argument; ``scope``: see :meth:`enter`;
        ``wrap``: the call's sharded outputs leave it as :class:`~tplayers.domain.tensor.DomainTensor`)."""
        marked = self.agree(plain(x))
        self._raised.append(sys.exc_info()[1])
        guard = self.enter(x if marked else None, agreed=True, scope=scope)
        if wrap and active_guard() is guard and guard.reads is not outside_guard(self).reads:
            # a call opened from code outside the region (a method): the lengths that code read on the
            # region's DomainTensors count here too (one meaning for a size, tplayers.region.sizes)
            guard.reads = guard.token.reads = outside_guard(self).reads  # the call's recomputations read them too
        self._wraps.append(wrap)

    def post_hook(self, module, args, kwargs, output):
        return self.close(output)

    def close(self, output=None):
        """Pop the guard :meth:`open` pushed (from an always-called hook: the forward's exception, if
        any, is the one being handled now); ``output`` with its sharded tensors wrapped where the call
        was opened outside every guarded call (``None``: keep the forward's own output)."""
        if self._stack and active_guard() is self._stack[-1]:
            before = self._raised.pop() if self._raised else None
            now = sys.exc_info()[1]  # always_call: the forward's exception is being handled here
            wrapped = output
            if (
                now is None
                and self._stack[-1].check
                and torch.is_grad_enabled()
                and isinstance(output, (torch.Tensor, tuple, list))
            ):
                self._stack[-1].check_functions(output if isinstance(output, (tuple, list)) else (output,))
            if self._wraps.pop() and now is None and output is not None:
                wrapped = wrap_outputs(self._stack[-1], self, output)
            self.exit(now if now is not None and now is not before else None)
            return None if wrapped is output else wrapped
        return None


def first_tensor(args, kwargs):
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return next((a for a in kwargs.values() if isinstance(a, torch.Tensor)), None) if x is None else x


@contextlib.contextmanager
def domain_region(mesh=None, shard_dims: Sequence[int] = (2,), *, inputs: Sequence[torch.Tensor] = ()):
    """Guard hand-written code as a domain region: every op on the tensors of ``inputs`` (this rank's
    slices along ``shard_dims``) and on what derives from them is checked, routed or refused exactly
    as inside a ``DomainParallel`` region. No collective on entry (a ``DomainParallel`` region
    adds its per-call agreement; here the partition is yours).

    Args:
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the tensor dim sharded over each mesh dim.
        inputs: tensors to tag as sharded along ``shard_dims``.

    Yields:
        The :class:`RegionGuard` (``guard.mark_input(t)`` tags another sharded tensor).

    Raises:
        ValueError: on entry, ``shard_dims`` that do not match the mesh's dims or an input with
            too few dims; inside, on every rank, any op on sharded data that is neither exact
            locally nor routed (the message names the op, the module and the sharded dims).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers
        mesh = tplayers.init_mesh()
        full = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        x = tplayers.shard(full, 2, mesh)
        with tplayers.domain_region(mesh, (2,), inputs=(x,)):
            m = x.mean(dim=(2, 3), keepdim=True)                       # global mean, replicated
            y = F.interpolate(x - m, scale_factor=2, mode="bilinear")  # routed: exact
        serial = F.interpolate(full - full.mean(dim=(2, 3), keepdim=True), scale_factor=2, mode="bilinear")
        torch.testing.assert_close(tplayers.gather(y, 2, mesh), serial)
    """
    region = DomainRegion(mesh, shard_dims, "<domain_region>")
    guard = region.enter(None)
    error = None
    try:
        for t in inputs:
            guard.mark_input(t)
        yield guard
    except BaseException as e:
        error = e
        raise
    finally:
        region.exit(error)
