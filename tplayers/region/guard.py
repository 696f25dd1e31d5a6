"""The region guard: inside a domain region, see every op applied to domain-sharded data.

A :class:`RegionGuard` is a ``TorchFunctionMode`` active while a domain region runs. It follows
which tensors carry domain-sharded dims (the region's spatial input, twin outputs, and everything
derived from them: a tag on the tensor, :mod:`tplayers.domain.layout`) and classifies each torch
call that touches one (:mod:`tplayers.region.rules`):

* inside a twin (a :class:`~tplayers.layers._common.ShardedModule`): the twin's own business, the
  guard steps aside and tags the twin's output;
* provably exact on local data (pointwise / broadcasting, channel ops, views keeping each sharded
  dim whole, ``cat`` along whole dims, dtype moves): run as is;
* interpolation, functional pools and pads, reductions over sharded dims, attention over sharded
  tokens: routed to the distributed implementations in :mod:`tplayers.functional`;
* anything else touching a sharded dim: ``ValueError`` naming the op, the module and the dim, the
  same on every rank (deny by default).

Some decisions read local sizes, which differ across ranks: a reshape of a 1-row or empty shard, an
``expand``, a ``cat`` of differently partitioned tensors may be refused on some ranks only. On the
first call of a region with a new partition (``check``), such decisions are *armed* (:meth:`arm`)
and *settled* before the next collective (:meth:`settle`: before a twin, a routed op, a nested
region, the region's exit): one small all-gather of a flag per rank, so a rank that refused
(:meth:`refuse`, which settles at once) and the ranks that did not meet in the same collective and
all raise the same ``ValueError``, naming the op, the module and the ranks. Settling costs one
small all-gather per run of armed decisions before a collective, on first calls only; later calls
with the same partition make the same decisions and settle nothing.

It also makes the region convention (docs/design.md (the region convention)) follow the data:
where a replicated tensor that requires grad (a parameter, a time embedding, a squeeze-excitation
gate) meets sharded data, it is passed through :class:`~tplayers.domain.boundary.ReplicatedToSharded`
(identity forward, gradient summed over the mesh dims the result is sharded over), once per tensor
and call, so every ``.grad`` equals the serial model's whichever module computed what. Explicit boundary calls
(``replicated_to_sharded``, ``sharded_to_replicated``, :class:`~tplayers.DomainReplicated`,
:class:`~tplayers.ReplicatedBranch`) are identities under a guard: the guard already sums where
the data says so, and every replicated value inside a guarded region is already global.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointFunction

from tplayers.comm.agree import raise_together
from tplayers.domain.active import active_guard, stepped_aside
from tplayers.domain.boundary import ReplicatedToSharded
from tplayers.domain.layout import Layout, canonical_layout, is_sharded, region_layout, sharded_dims
from tplayers.region.aliases import Aliases, recover
from tplayers.region.dispatch import handle
from tplayers.region.lengths import Root, shape_with_lengths
from tplayers.region.rules import _PASS, _PRESERVE, _pointwise_names, first_sharded, op_name
from tplayers.region.rules_broadcast import broadcast_interpolate, either_use
from tplayers.region.rules_slices import FACTORIES, SHAPED, factory, has_len, serial_args
from tplayers.region.rules_windows import folded_root
from tplayers.region.saved_hooks import BODY_ADVICE, is_checkpoint_pack, saved_pack
from tplayers.region.taint import lengths_in, refuse_tainted, taint, values_of
from tplayers.region.twin_calls import call_twin

__all__ = ["RegionGuard", "active_guard", "GuardError", "CallToken", "tag_of"]

_TAG = "_tplayers_domain_tag"
_UNIFORM = "_tplayers_uniform"  # a fresh constant made in this call (the guard's token)
#: factories whose result holds one value everywhere (``torch.zeros(y.shape)``): see :meth:`RegionGuard.uniform`
_CONSTANTS = frozenset(
    ["zeros", "ones", "full", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"]
)
_NOT_CONSTANT = frozenset(["rrelu", "rrelu_", "empty_like"])  # random or uninitialised values


class GuardError(ValueError):
    """An op on domain-sharded data that the guard cannot prove exact and does not route."""


class CallToken:
    """One call of a region, carried by the tags of the tensors it shards; ``reads``: the local lengths
    its code read (:meth:`RegionGuard.note_read`), which a recomputation of part of the call under
    activation checkpointing reads again (:mod:`tplayers.region.recompute`)."""

    __slots__ = ("reads",)

    def __init__(self, reads: Dict[int, set]) -> None:
        self.reads = reads


def tag_of(t: Any) -> Optional[Tuple[CallToken, Layout]]:
    """``(token, layout)`` of a tensor a region call tagged as sharded (``None``: untagged)."""
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


class RegionGuard(TorchFunctionMode):
    """The torch-function mode of one call of a domain region (see the module docstring).

    ``mesh``: the region's 1-D or 2-D mesh (mesh dim ``i`` shards tensor dim ``shard_dims[i]`` of
    its input); ``where``: a name for messages (the region's module path).
    """

    is_region_guard = True  # how :mod:`tplayers.domain.active` finds it on the mode stack

    def __init__(self, mesh, shard_dims: Sequence[int], where: str = "<region>", token: Any = None) -> None:
        super().__init__()
        self.reads: Dict[int, set] = {}  # mesh dim -> local lengths of sharded dims the code read (note_read)
        # tags are valid for this call (the token is shared by nested guards)
        self.token = CallToken(self.reads) if token is None else token
        self.mesh = mesh
        self.shard_dims = tuple(shard_dims)
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self.where = [where]  # module path stack (region hooks push and pop)
        self.packs = [saved_pack()]  # the saved-tensor hooks in place when each of those calls began
        self._bounded: Dict[Tuple[int, Tuple[int, ...]], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.routes: Dict[Any, Any] = {}  # per call-site routed twins (kept across calls by the region)
        self.acted = False  # whether this call routed an op or summed a replicated gradient
        self.buckets = None  # this call's parameter-gradient buckets (tplayers.comm.buckets), set by the region
        self.agreed = False  # a DomainParallel region call: every rank's partition was compared at entry
        self.check = False  # decisions read from local sizes are agreed (a region's first call of a partition)
        self.pending = 0  # such decisions made since the last collective (settled before the next one)
        self.vetted: set = set()  # autograd nodes of twins' outputs (their custom Functions are the twins')
        self.roots: Dict[Tuple[int, int], Tuple[torch.Tensor, Root]] = {}  # (id(t), dim) -> lengths' roots
        self.in_module = 0  # inside a twin's serial module on replicated data (rules_broadcast)
        self.either = 0  # maps whose reading the first op using them decides (rules_broadcast._either)
        self.windows = False  # a view split a sharded dim into windows: later views read serially (rules_windows)
        self.lost = ""  # where model code made a plain local number of a read length (lengths.lost)
        self.aliases: Optional[Aliases] = None  # the region's record of tags made in recomputations
        self.recomputing = False  # a recomputation guard (region/recompute.py): its tags are recorded

    # ----------------------------------------------------------------- tags
    def layout(self, t: Any) -> Optional[Layout]:
        """The sharded layout of ``t`` in this call (``None``: replicated / not a tensor)."""
        tag = getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None
        return tag[1] if tag is not None and tag[0] is self.token else None

    def mark(self, t: Any, layout: Optional[Layout]) -> Any:
        """Tag ``t`` as sharded with ``layout`` in this call (a replicated layout clears the tag). Tags are
        kept canonical (:func:`~tplayers.domain.layout.canonical_layout`), so equal shardings compare equal."""
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            layout = canonical_layout(layout)
            if layout is not None and is_sharded(layout):
                setattr(t, _TAG, (self.token, layout))
                if self.recomputing:  # torch's detached copies of it are the same slice (region/aliases.py)
                    self.aliases.remember(t, self.token, layout)
            elif getattr(t, _TAG, None) is not None:
                setattr(t, _TAG, None)
            if getattr(t, _UNIFORM, None) is not None:  # written: no longer a fresh constant
                setattr(t, _UNIFORM, None)
        return t

    def uniform(self, t: Any) -> bool:
        """Whether ``t`` is a fresh constant made in this call (``torch.zeros`` / ``ones`` / ``full``,
        ``Tensor.new_zeros`` / ``new_ones`` / ``new_full``), not yet written: one value everywhere, so
        a constant of a sharded tensor's local shape is the slice of the serial model's constant of
        the global shape, and broadcasts against sharded data as a size-1 operand does. Any in-place
        write (seen by the guard or not: ``c[:, :, 0] = 1``) bumps the tensor's version and ends it.
        Inference tensors (``torch.inference_mode``) have no version counter: never fresh constants."""
        tag = getattr(t, _UNIFORM, None) if isinstance(t, torch.Tensor) else None
        return tag is not None and tag[0] is self.token and tag[1] == t._version

    def mark_uniform(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and not t.is_inference():
            setattr(t, _UNIFORM, (self.token, t._version))
        return t

    def mark_input(self, x: torch.Tensor) -> torch.Tensor:
        """Tag a region input: ``shard_dims`` sharded over the mesh."""
        if max(self.shard_dims) >= x.dim():
            raise ValueError(
                f"domain region {self.where[0]}: its input has {x.dim()} dims, fewer than the sharded "
                f"dims {self.shard_dims} need"
            )
        with stepped_aside(self, settle=False):  # the guard's own reads are not the code's (note_read)
            shape = x.shape
        return self.mark(x, region_layout(shape, self.shard_dims))

    def note_read(self, t: Any, dim: Optional[int] = None) -> None:
        """Remember the local lengths of ``t``'s sharded dims (or of dim ``dim``) read by the region's code
        (``x.shape``, ``x.size()``): a size equal to one of them may be a local share (:mod:`tplayers.region.sizes`)."""
        lay = self.layout(t)
        for d, entry in enumerate(lay or ()):
            for _, axis in entry or ():
                if axis is not None and axis >= 0 and (dim is None or d == dim % len(lay)):  # not a PREFIX
                    self.reads.setdefault(axis, set()).add(int(t.shape[d]))

    def root(self, t: torch.Tensor, d: int) -> Optional[Root]:
        """The :class:`~tplayers.region.lengths.Root` of sharded dim ``d`` of ``t`` (``None`` unless ``d`` is
        one plain sharded dim; merged dims' lengths: :func:`~tplayers.region.rules_windows.folded_root`), one per
        tensor dim and call."""
        lay = self.layout(t)
        entry = lay[d] if lay is not None else None
        if entry is None or len(entry) != 1 or entry[0][1] is None:
            return None
        key = (id(t), d)
        hit = self.roots.get(key)
        if hit is None or hit[0] is not t:
            with stepped_aside(self, settle=False):
                n = int(t.shape[d])
            hit = (t, Root(n, self.groups[entry[0][1]], entry[0][1]))
            self.roots[key] = hit
        return hit[1]

    def lengths(self, t: Any, out: Any, dim: Any = None) -> Any:
        """``t.shape`` / ``t.size(dim)`` as the region's code reads them: sharded dims' lengths as
        :class:`~tplayers.region.lengths.ShardLen` (see :mod:`tplayers.region.lengths`)."""
        if self.layout(t) is None or _torch_reads():
            return out
        if isinstance(dim, int):
            r = self.root(t, dim % t.dim()) or folded_root(self, t, dim % t.dim())
            return out if r is None else shape_with_lengths((out,), (r,))[0]
        if isinstance(out, torch.Size):
            return shape_with_lengths(out, [self.root(t, d) or folded_root(self, t, d) for d in range(len(out))])
        return out

    # ------------------------------------------------------------ boundary
    def bound(self, t: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
        """``t`` (replicated, requires grad) as used by data sharded over mesh dims ``axes``: identity
        forward, gradient summed over those dims in backward; once per tensor and call."""
        groups = [self.groups[a] for a in axes if self.groups[a].size() > 1]
        if not groups or not torch.is_grad_enabled() or not t.requires_grad:
            return t
        key = (id(t), tuple(axes))
        hit = self._bounded.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        out = ReplicatedToSharded.apply(t, groups)
        self._bounded[key] = (t, out)
        self.acted = True
        return out

    # --------------------------------------------------------------- errors
    def error(self, what: str, layout: Optional[Layout] = None, advice: str = "") -> GuardError:
        dims = f" (sharded dims {sharded_dims(layout)} of the input)" if layout is not None else ""
        return GuardError(
            f"domain region guard: {what}{dims}, in module {self.where[-1]!r}. On a domain-sharded tensor this "
            f"would run on each rank's slice alone and differ from the serial model. {advice}".rstrip()
        )

    # ------------------------------------------------------------ agreement
    def arm(self) -> None:
        """A rule is about to decide from local sizes (which differ across ranks): settle before the
        next collective (nothing to do outside ``check`` calls)."""
        if self.check:
            self.pending += 1

    def settle(self, error: Optional[BaseException] = None) -> None:
        """Before a collective: agree on the decisions armed since the last one. Every rank settles at
        the same point (the same ops were armed on every rank); ``error``: this rank's refusal. If any
        rank refused, every rank raises the same :class:`GuardError`."""
        if not self.pending:
            return
        self.pending = 0
        ranks = self.mesh.mesh.reshape(-1).tolist()
        with stepped_aside(self, settle=False):
            raise_together(
                error, self.groups, f"domain region {self.where[0]}", "domain.guard", ranks=ranks, cls=GuardError
            )

    def refuse(self, err: BaseException) -> BaseException:
        """The error to raise for this rank's refusal ``err``: after an armed decision it is settled
        first (the other ranks meet it before their next collective) and every rank raises the same
        :class:`GuardError`; else ``err`` as it is (a decision read from no local size is the same
        on every rank)."""
        if not self.pending:
            return err
        try:
            self.settle(err)
        except GuardError as agreed:
            return agreed
        return err  # pragma: no cover - settle(err) always raises

    # -------------------------------------------------------- torch function
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recomputing:
            recover(self, args, kwargs)
        if getattr(func, "__name__", None) in _pointwise_names() and lengths_in(args, kwargs):
            args, kwargs = values_of(args, kwargs)  # a length as a value (h_idx >= h - ws): the serial one
            self.acted = True  # not what the code's local call computes: compiling refuses the region
        if not _touches(self, args, kwargs):
            name = getattr(func, "__name__", None)
            if name in FACTORIES and has_len(args, kwargs):
                with stepped_aside(self, settle=False):
                    return factory(self, func, args, kwargs)
            if name in SHAPED and has_len(args, kwargs):  # a replicated tensor has its serial shape
                with stepped_aside(self, settle=False):
                    return func(*serial_args(args), **dict(zip(kwargs, serial_args(kwargs.values()))))
            if self.either:  # an undecided resized map (rules_broadcast): carried along, or refused
                with stepped_aside(self, settle=False):
                    carried = either_use(self, func, name, args, kwargs, False, handle)
                if carried is not None:
                    return carried
            if name == "interpolate" and not self.in_module:  # a replicated 1 x 1 map broadcast to a local size
                out = broadcast_interpolate(self, func, args, kwargs)
                if out is not None:
                    return out
            first = getattr(args[0], _UNIFORM, None) if args and isinstance(args[0], torch.Tensor) else None
            fresh = name in _CONSTANTS or (
                first is not None and self.uniform(args[0]) and _keeps_constant(self, name, args, kwargs)
            )
            out = func(*args, **kwargs)
            if self.lost:  # replicated tensors built after a length became a local number (region/taint.py)
                taint(self, name, args, kwargs, out)
            return self.mark_uniform(out) if fresh else out
        if self.lost and self.windows:
            refuse_tainted(self, func, args, kwargs)
        if self.check and torch.is_grad_enabled():  # a partition's first call: later calls run the same code
            self.check_functions(args, kwargs)
        pack = saved_pack()
        if pack is not self.packs[-1] and is_checkpoint_pack(pack) and getattr(func, "__name__", "") not in _PASS:
            lay = first_sharded(self, args, kwargs)[1]
            raise self.refuse(
                self.error(f"{op_name(func)} in a checkpointed function, outside its modules", lay, BODY_ADVICE)
            )
        if self.either:  # a cat / pointwise op decides an undecided resized map (rules_tokens), others may not
            either_use(self, func, getattr(func, "__name__", ""), args, kwargs, True, handle)
        with stepped_aside(self, settle=False):  # an outer guard (a model watch) must not see the handler's own ops
            return handle(self, func, args, kwargs)

    def check_functions(self, args, kwargs=None) -> None:
        """Refuse sharded arguments made by a custom ``torch.autograd.Function`` that is not the library's
        (nor a twin's): its ``backward`` runs after the region's call, where no guard sees its ops on
        sharded gradients (a spatial mean there would take each rank's slice alone)."""
        for a in args:
            if isinstance(a, torch.Tensor):
                self._check_function(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        self._check_function(b)
        for a in (kwargs or {}).values():
            if isinstance(a, torch.Tensor):
                self._check_function(a)

    def _check_function(self, t: torch.Tensor) -> None:
        fn = t.grad_fn
        cls = None if fn is None else getattr(fn, "_forward_cls", None)  # None for torch's own (C++) nodes
        if cls is None or fn in self.vetted or (getattr(cls, "__module__", "") or "").startswith("tplayers."):
            return
        if cls is CheckpointFunction:  # reentrant checkpointing: its recomputation re-enters the guard (recompute.py)
            return
        lay = self.layout(t)
        if lay is None:
            return
        raise self.refuse(
            self.error(
                f"a custom torch.autograd.Function ({cls.__qualname__}) applied to sharded data",
                lay,
                "Its backward runs outside the region guard, on each rank's slice of the gradient. Write "
                "it with torch ops (autograd then differentiates them under the guard), or use tplayers "
                "twins / tplayers.functional for what needs the whole domain.",
            )
        )

    # ---------------------------------------------------------------- twins
    def call_twin(self, module, call: Callable, args, kwargs):
        """Run a twin with the guard stepped aside; tag its output from its input's layout
        (:func:`tplayers.region.twin_calls.call_twin`)."""
        return call_twin(self, module, call, args, kwargs)


def _keeps_constant(guard: RegionGuard, name, args, kwargs) -> bool:
    """Whether a pointwise op or a move (``to``, ``clone``) of a fresh constant makes a fresh constant: its
    other tensor operands are fresh constants or single values (``torch.ones(y.shape) * 0.5``)."""
    if name in _NOT_CONSTANT or (name not in _PRESERVE and name not in _pointwise_names()):
        return False
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and not guard.uniform(a) and a.numel() > 1:
            return False
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            return False
    return True


def _torch_reads() -> bool:
    """Whether the shape being read is read by torch's own Python (``torch.utils.checkpoint`` records
    saved tensors' shapes and compares them on recomputation), not by the model's code: torch keeps
    plain local lengths."""
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith(("tplayers.region", "torch.overrides")):
        f = f.f_back
    return f is not None and f.f_globals.get("__name__", "").startswith("torch.")


def _touches(guard: RegionGuard, args, kwargs) -> bool:
    """Whether any tensor argument (top level, or inside a list/tuple; keyword: top level) is sharded in this call."""
    token = guard.token
    for a in args:
        for b in a if isinstance(a, (list, tuple)) else (a,):
            tag = getattr(b, _TAG, None) if isinstance(b, torch.Tensor) else None
            if tag is not None and tag[0] is token:
                return True
    for a in kwargs.values():
        tag = getattr(a, _TAG, None) if isinstance(a, torch.Tensor) else None
        if tag is not None and tag[0] is token:
            return True
    return False
