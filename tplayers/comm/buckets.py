"""Gradient buckets of one domain-region call: the twins' replicated parameters summed over the
domain in few asynchronous all-reduces, overlapped with the rest of the backward (as DDP does).

A convolution twin's weight is replicated while its input is sharded, so each rank's weight
gradient is a partial sum over its own pixels and the ranks' parts must be added. Outside a region
each twin adds them itself, one all-reduce per layer in its backward. Inside a region call:

1. at entry, one :class:`_Gate` node takes every bucketed parameter (the region's convolution
   twins' ``weight`` / ``bias``, in reverse module order, grouped into buckets of at most
   :data:`BUCKET_BYTES` per dtype) and hands the twins identical views of them. Being created
   first, the gate's backward runs last, after the whole region's backward;
2. each twin call wraps the gated parameters in a :class:`_Deposit` node (identity forward); its
   backward adds the partial gradients into the bucket's flat buffer instead of passing them on.
   When every call counted in forward for a bucket has deposited, the bucket's all-reduce is
   posted asynchronously, and the remaining backward (earlier layers) runs while it flies;
3. the gate's backward waits for the buckets (posting any bucket a skipped backward left
   incomplete) and returns each parameter's summed gradient plus whatever reached it through
   ordinary autograd (another, replicated use), so ``param.grad``, hooks and DDP / FSDP see one
   ordinary accumulation.

Exact: backward is linear in the output gradient, and the same partial gradients are summed as
before, only later and fused. Every rank posts the same buckets in the same order (the same
graph). Under ``torch.compile``, without grad mode, or for a parameter the gate does not hold (a
parametrised weight, a twin outside the region's module), the twin sums its own gradients as
before.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import all_reduce_sum
from tplayers.mesh import is_dtensor

__all__ = ["BUCKET_BYTES", "GradBuckets", "region_params", "using_buckets"]

#: Largest bucket, in bytes (DDP's default is 25 MB; smaller buckets start earlier and overlap more).
BUCKET_BYTES = 4 << 20

_CURRENT: contextvars.ContextVar[Optional["GradBuckets"]] = contextvars.ContextVar("tplayers_buckets", default=None)


class _Bucket:
    """Parameters reduced together: one flat buffer, one async all-reduce over the first group."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.numel = 0
        self.expected = 0  # twin calls that may deposit (counted in forward)
        self.arrived = 0
        self.flat: Optional[torch.Tensor] = None
        self.work = None
        self.posted = False


class GradBuckets:
    """The buckets of one region call over ``groups`` (the mesh dims' process groups)."""

    def __init__(self, params: Sequence[nn.Parameter], groups: Sequence[dist.ProcessGroup]) -> None:
        self.groups = [g for g in groups if dist.get_world_size(g) > 1]
        self.params = list(params)
        self.buckets: List[_Bucket] = []
        self.slots: Dict[int, Tuple[_Bucket, int]] = {}  # id(param) -> (bucket, offset)
        for members in plan_buckets(self.params):
            b = _Bucket(members[0].dtype, members[0].device)
            for p in members:
                self.slots[id(p)] = (b, b.numel)
                b.numel += p.numel()
            self.buckets.append(b)
        self.filled: set = set()  # ids of the parameters some call deposited a gradient for
        self.gated: Dict[int, torch.Tensor] = {}
        if self.params:
            outs = _Gate.apply(self, *self.params)
            self.gated = {id(p): o for p, o in zip(self.params, outs)}

    @classmethod
    def for_region(cls, root: nn.Module, groups) -> Optional["GradBuckets"]:
        """Buckets for ``root``'s convolution twins' trainable parameters; ``None`` when there is nothing
        to bucket (no grad mode, compiling, a world of one, no such parameter)."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        if all(dist.get_world_size(g) == 1 for g in groups):
            return None
        params = bucketed_params(root)
        return cls(params, groups) if params else None

    # ---------------------------------------------------------------- forward
    def take(self, params: Sequence[Optional[torch.Tensor]]):
        """The gated, deposit-wrapped ``params`` of one twin call, or ``None`` when one of them is not
        held here (the twin then sums its own gradients)."""
        live = [p for p in params if p is not None]
        if not live or any(id(p) not in self.slots for p in live):
            return None
        touched = {id(self.slots[id(p)][0]): self.slots[id(p)][0] for p in live}
        for b in touched.values():
            b.expected += 1
        outs = iter(_Deposit.apply(self, tuple(live), tuple(touched.values()), *[self.gated[id(p)] for p in live]))
        return tuple(None if p is None else next(outs) for p in params)

    # --------------------------------------------------------------- backward
    def deposit(self, params, buckets, grads) -> None:
        for p, g in zip(params, grads):
            if g is None:
                continue
            b, offset = self.slots[id(p)]
            if b.flat is None:
                b.flat = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
            b.flat[offset : offset + p.numel()].add_(g.reshape(-1))
            self.filled.add(id(p))
        for b in buckets:
            b.arrived += 1
            if b.arrived == b.expected and b.flat is not None:
                self._post(b)

    def _post(self, b: _Bucket) -> None:
        if b.posted:
            return
        b.posted = True
        if self.groups:
            g = self.groups[0]
            record_collective(
                "all_reduce", b.flat.numel() * b.flat.element_size(), dist.get_world_size(g), "region.param_grads"
            )
            b.work = dist.all_reduce(b.flat, group=g, async_op=True)

    def finish(self) -> List[Optional[torch.Tensor]]:
        """Wait for every bucket (posting those not yet posted, in order); each parameter's summed gradient."""
        for b in self.buckets:
            if b.flat is not None:
                self._post(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
                for g in self.groups[1:]:
                    b.flat = all_reduce_sum(b.flat, g, "region.param_grads")
        out = []
        for p in self.params:
            b, offset = self.slots[id(p)]
            out.append(b.flat[offset : offset + p.numel()].view_as(p) if id(p) in self.filled else None)
        for b in self.buckets:  # empty again: a second backward of the same graph (retain_graph) starts afresh
            b.flat, b.arrived, b.posted = None, 0, False
        self.filled = set()
        return out


def bucketed_params(root: nn.Module) -> List[nn.Parameter]:
    """The trainable parameters the buckets of a region rooted at ``root`` hold: its convolution
    twins' ``bias`` and ``weight``, in reverse module order (about the order backward produces them)."""
    params, seen = [], set()
    for m in reversed(list(root.modules())):
        if not getattr(m, "bucketed_params", False):
            continue
        for name in ("bias", "weight"):
            p = m._parameters.get(name)
            if isinstance(p, nn.Parameter) and not is_dtensor(p) and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def plan_buckets(params: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``params`` grouped into buckets, in order: per (dtype, device), a new bucket when the open one
    would exceed :data:`BUCKET_BYTES` (a parameter larger than that has a bucket of its own)."""
    out: List[List[torch.Tensor]] = []
    open_: Dict[Tuple[torch.dtype, torch.device], Tuple[List[torch.Tensor], List[int]]] = {}
    for p in params:
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        hit = open_.get(key)
        if hit is None or (hit[1][0] and hit[1][0] + nbytes > BUCKET_BYTES):
            hit = open_[key] = ([], [0])
            out.append(hit[0])
        hit[0].append(p)
        hit[1][0] += nbytes
    return out


class _Gate(torch.autograd.Function):
    """forward: views of the bucketed parameters / backward (last of the region): the summed buckets."""

    @staticmethod
    def forward(ctx, buckets: GradBuckets, *params):
        ctx.buckets = buckets
        ctx.set_materialize_grads(False)
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        summed = ctx.buckets.finish()
        out = [s if g is None else (g if s is None else g + s) for g, s in zip(grads, summed)]
        return (None, *out)


class _Deposit(torch.autograd.Function):
    """forward: identity on one twin call's gated parameters / backward: their partial gradients go
    into the buckets (nothing flows on through autograd)."""

    @staticmethod
    def forward(ctx, buckets: GradBuckets, params, touched, *gated):
        ctx.info = (buckets, params, touched)
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in gated)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        buckets, params, touched = ctx.info
        buckets.deposit(params, touched, grads)
        return (None, None, None) + (None,) * len(grads)


@contextlib.contextmanager
def using_buckets(buckets: Optional[GradBuckets]):
    """Make ``buckets`` the ones twins called in this block deposit into (a region guard's twin call)."""
    token = _CURRENT.set(buckets)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def region_params(*params: Optional[torch.Tensor]) -> Tuple[Tuple[Optional[torch.Tensor], ...], bool]:
    """A twin's replicated ``params`` for this call and whether the twin must sum their gradients
    itself: inside a region call whose buckets hold them, the deposit-wrapped views and ``False``;
    else ``params`` unchanged and ``True``."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():  # (dynamo does not trace a ContextVar)
        return params, True
    buckets = _CURRENT.get()
    if buckets is None:
        return params, True
    taken = buckets.take(params)
    return (params, True) if taken is None else (taken, False)
