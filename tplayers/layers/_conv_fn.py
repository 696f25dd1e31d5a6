"""The ``DistributedConvNd`` twins' convolution: the last sharded dim's halo exchange fused with the
local convolution. One entry (:func:`tplayers.layers._conv_run.halo_conv`), two strategies chosen by
``ConvSpec.strips``: halo-padded (here, with what both share: :class:`ConvSpec`, the parameter-gradient
packing and sums) and main-plus-strips (:mod:`tplayers.layers._conv_strips`).

**Halo-padded** (``strips=None``: any plan; always while compiling): the exchange fills a halo-padded
copy of the input, then one convolution. The backward overlaps the parameter-gradient sum with the
adjoint halo messages (an async all-reduce posted with them, :func:`_reduce_backward`, on any number
of ranks). It saves the halo-padded input and the weight with ``save_for_backward`` and calls
``aten.convolution_backward`` directly (only the cheap boundary padding and trim are replayed under
autograd in backward).

Both strategies are two autograd Functions, one saving (exactly what it needs, before anything is
computed) and one computing, so that activation checkpointing (``use_reentrant=False``) stops its
recomputation before the convolution; neither keeps an autograd graph on ``ctx``.

Example (2 ranks; ``DistributedConv2d`` takes the main-plus-strips strategy by itself where the plans
allow it, for a slab of at least ``EDGE_MIN_ELEMENTS`` elements per rank or with ``overlap_halo=True``)::

    import torch, tplayers
    mesh = tplayers.init_mesh()
    conv = tplayers.DistributedConv2d(4, 8, 3, padding=1, mesh=mesh)
    y = conv(tplayers.shard(torch.randn(2, 4, 1024, 1024), 2, mesh))   # (2, 8, 512, 1024) per rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from tplayers.comm import all_reduce_sum, record_collective
from tplayers.comm.collectives import group_by_name
from tplayers.comm.halo import format_of, halo_adjoint, halo_pad, state_codes, state_from_codes
from tplayers.comm.halo_route import HaloRoute, halo_route
from tplayers.layers._conv_twice import twice_backward
from tplayers.ops.registry import OpSpec, constant_result, register
from tplayers.window_plan import AxisPlan, EdgeGeometry

__all__ = [
    "ConvSpec",
    "HaloConvFunction",
    "conv_order",
    "finish_param_sum",
    "flat_param_grads",
    "in_format",
    "post_param_sum",
    "split_param_grads",
]


@dataclass(frozen=True, eq=False, kw_only=True)
class ConvSpec:
    """Everything :func:`halo_conv` needs, computed once per layout (Python ints only, plus groups)."""

    halo_dim: int  # the last sharded dim: its halo exchange is fused with the convolution
    halo_group: dist.ProcessGroup  # halo_dim's mesh group
    plan: AxisPlan  # this rank's plan along halo_dim
    periodic: bool  # halo_dim wraps (circular padding)
    memory_format: torch.memory_format  # the local convolution's layout
    out_format: torch.memory_format  # the output's layout (nn.ConvNd's for the input)
    # halo_dim's boundary padding and trim, then the unsharded dims' padding conv_fn cannot do itself
    pad_and_trim: Callable[[torch.Tensor], torch.Tensor]
    skip_pad_and_trim: bool  # pad_and_trim is the identity (no boundary rows, no trim, no other padding)
    conv_fn: Callable  # F.conv1d / conv2d / conv3d
    stride: Tuple[int, ...]
    padding: Tuple[int, ...]  # conv_fn's padding (0 along sharded dims)
    dilation: Tuple[int, ...]
    groups: int
    out_shape: Tuple[int, ...]
    reduce_groups: tuple  # every mesh dim's group: the parameter gradients are summed over all
    spatial_order: Optional[Tuple[int, ...]] = None  # spatial dims reordered for the convolution (conv_order)
    # the strategy: main-plus-strips at this rank's geometry (every rank's plan allows it, so every rank
    # takes it; eager only), or None: halo-padded
    strips: Optional[EdgeGeometry] = None
    # derived once here, so that no step repeats them (per-call cost is the overhead-bound regime's whole budget)
    order: "_Order" = field(init=False, repr=False)  # the convolution on spatially permuted views
    route: HaloRoute = field(init=False, repr=False)  # the fused dim's neighbours
    live_groups: tuple = field(init=False, repr=False)  # reduce_groups of more than one rank
    empty: bool = field(init=False, repr=False)  # this rank owns no output rows
    padded: "PadBuffer" = field(init=False, repr=False)  # the halo-padded input's buffer, reused when free

    def __post_init__(self):
        derived = {
            "order": _Order(self),
            "route": halo_route(self.halo_group, self.periodic),
            "live_groups": tuple(g for g in self.reduce_groups if dist.get_world_size(g) > 1),
            "empty": 0 in self.out_shape,
            "padded": PadBuffer(),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, at construction


class _ConvCompute(torch.autograd.Function):
    """forward: the local convolution of the halo-padded input (boundary padding and trim first) /
    backward: the output gradient handed unchanged to :class:`HaloConvFunction` through ``token``."""

    @staticmethod
    def forward(ctx, token, xp, weight, bias, spec: ConvSpec):
        if spec.empty:
            return xp.new_zeros(spec.out_shape)
        p = spec.order
        xc = xp if spec.skip_pad_and_trim else spec.pad_and_trim(xp)
        y = p.back(spec.conv_fn(p.fwd(xc), p.fwd(weight), bias, p.stride, p.padding, p.dilation, spec.groups))
        return in_format(y, spec.out_format)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


def in_format(y: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``y`` in ``memory_format`` (itself when already so laid out: the convolution ran in the
    output's layout; else one copy, e.g. a convolution in another layout than the input's)."""
    return y if y.is_contiguous(memory_format=memory_format) else y.contiguous(memory_format=memory_format)


class HaloConvFunction(torch.autograd.Function):
    """forward: halo exchange of ``x`` along ``spec.halo_dim``; saves the padded input and the weight;
    returns ``(token, xp)``: ``xp`` the padded input (no gradient flows through it) and ``token``
    a zero-strided zeros tensor of the output's shape, whose gradient is the convolution's output
    gradient (:class:`_ConvCompute` passes it back) /
    backward: the convolution's backward; then the adjoint halo exchange runs while the weight and
    bias gradients are summed over the domain (an async all-reduce overlapping it, and one more
    all-reduce per further mesh dim).
    A rank owning no output rows takes part in every collective with zero contributions.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spec: ConvSpec, reduce: bool = True):
        p = spec.plan
        eager = not torch.compiler.is_compiling()
        out = spec.padded.take(x, spec.halo_dim, p.recv, spec.memory_format) if eager else None
        xp, ctx.state = halo_pad(
            x,
            spec.halo_dim,
            spec.halo_group,
            p.recv,
            p.send,
            spec.periodic,
            spec.memory_format,
            out=out,
            route=spec.route,
        )
        if eager:
            spec.padded.keep(xp)
        ctx.save_for_backward(xp, weight)
        ctx.spec, ctx.has_bias, ctx.reduce = spec, bias is not None, reduce
        ctx.mark_non_differentiable(xp)
        return xp.new_zeros(()).expand(spec.out_shape), xp  # x and weight share a dtype (checked by the layer)

    @staticmethod
    def backward(ctx, grad, _grad_xp=None):
        if torch.is_grad_enabled():  # create_graph=True: a double backward reads the input gradient
            return twice_backward(HaloConvFunction.first_backward, ctx, grad, ctx.saved_tensors[1])
        return HaloConvFunction.first_backward(ctx, grad)

    @staticmethod
    def first_backward(ctx, grad):
        xp, weight = ctx.saved_tensors
        spec = ctx.spec
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        if spec.empty:
            gxp = torch.zeros_like(xp) if need_x else None
            gw = torch.zeros_like(weight) if need_w else None
            gb = weight.new_zeros(weight.shape[0]) if need_b else None
        else:
            compiling = torch.compiler.is_compiling()
            if spec.skip_pad_and_trim:  # nothing to replay: the convolution read xp itself
                xc = xp
            elif compiling:  # traceable: the padding / trim's vjp through torch.func
                xc, prepare_vjp = torch.func.vjp(spec.pad_and_trim, xp)
            else:
                with torch.enable_grad():  # replay only the cheap padding / trim, to differentiate it
                    xp_ = xp.detach().requires_grad_(need_x)
                    xc = spec.pad_and_trim(xp_)
            p = spec.order
            gi, gw, gb = torch.ops.aten.convolution_backward(
                p.fwd(grad),
                p.fwd(xc.detach()),
                p.fwd(weight),
                [weight.shape[0]] if ctx.has_bias else None,
                p.stride,
                p.padding,
                p.dilation,
                False,
                [0] * len(spec.stride),
                spec.groups,
                [need_x, need_w, need_b],
            )
            gi, gw = (p.back(gi) if gi is not None else None), (p.back(gw) if gw is not None else None)
            gxp = None
            if need_x and spec.skip_pad_and_trim:
                gxp = gi
            elif need_x and compiling:
                gxp = prepare_vjp(gi)[0]
            elif need_x:
                gxp = gi if xc is xp_ else torch.autograd.grad(xc, xp_, gi)[0]
        flat = flat_param_grads(gw, gb, need_w, need_b)
        groups = spec.live_groups if flat is not None and ctx.reduce else ()
        state = ctx.state
        if torch.compiler.is_compiling():  # one registered op: adjoint halo + parameter-gradient sum
            grad_x, flat = _compiled_backward(gxp, flat, state, groups)
        else:  # gxp: convolution_backward's fresh input gradient (or views of it), read by nothing else
            grad_x = _reduce_backward(gxp, flat, state, groups, owned=True)
        gw, gb = split_param_grads(flat, weight, need_w, need_b)
        return grad_x, gw, gb, None, None


#: The number of references to a tensor's storage (``None`` where this PyTorch lacks it: no reuse).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class PadBuffer:
    """The halo-padded input of the last forward, kept to be filled again by the next one.

    A fresh padded buffer per step costs page faults on every step (a large block comes from new
    pages); the floor, a convolution of a
    standing tensor, pays none. The buffer is handed out again only when nothing else holds its
    storage (the previous step's backward has run and released it, or its graph is gone):
    autograd's saved copy counts as a holder, so a second forward before the backward (a layer
    applied twice, activation checkpointing, ``retain_graph``) gets a new buffer, and the values
    are exactly those of a fresh one (every row is written: own rows, halos, boundary zeros).
    It holds one padded input per layer and layout between steps (what a step needs anyway);
    ``reset_layouts`` drops it with the layout.
    """

    def __init__(self) -> None:
        self.tensor: Optional[torch.Tensor] = None

    def take(self, x: torch.Tensor, dim: int, recv: Tuple[int, int], memory_format) -> Optional[torch.Tensor]:
        """The kept buffer when it fits ``x`` padded by ``recv`` along ``dim`` and is free, else None."""
        t = self.tensor
        if t is None or _storage_use_count is None:
            return None
        shape = list(x.shape)
        shape[dim] += recv[0] + recv[1]
        if (
            list(t.shape) != shape
            or t.dtype != x.dtype
            or t.device != x.device
            or not t.is_contiguous(memory_format=memory_format)
        ):
            return None
        # our tensor and the temporary storage object are the only holders: no graph reads it
        return t if _storage_use_count(t.untyped_storage()._cdata) == 2 else None

    def keep(self, xp: torch.Tensor) -> None:
        self.tensor = xp.detach()


class _Order:
    """The convolution on spatially permuted views (``spec.spatial_order``; identity when ``None``).

    A convolution is the same on permuted spatial dims with the weight permuted alike; PyTorch's
    CPU backend choice looks at the first spatial dims only (N*C*D*H > 20480 for oneDNN), so a 3-D
    convolution sharded along D (a thin D) is reordered to put the long dims first: same values,
    oneDNN instead of the slow native kernel (about 7x on one core here).
    """

    def __init__(self, spec: ConvSpec):
        n = len(spec.stride)
        order = spec.spatial_order or tuple(range(n))
        self.full = (0, 1) + tuple(2 + i for i in order)
        self.inv = tuple(self.full.index(i) for i in range(n + 2))
        self.identity = spec.spatial_order is None
        self.stride = [spec.stride[i] for i in order]
        self.padding = [spec.padding[i] for i in order]
        self.dilation = [spec.dilation[i] for i in order]

    def fwd(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.identity else t.permute(self.full)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.identity else t.permute(self.inv)


def conv_order(local_shape: Tuple[int, ...], like: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """Spatial order for a 3-D convolution on the CPU in fp32 whose leading dims are too thin for
    PyTorch to pick oneDNN (``N*C*D*H <= 20480``) while a reordering is not; else ``None``."""
    if len(local_shape) != 5 or like.device.type != "cpu" or like.dtype != torch.float32:
        return None
    n, c, *sp = local_shape
    order = tuple(sorted(range(3), key=lambda i: -sp[i]))
    if n * c * sp[0] * sp[1] > 20480 or n * c * sp[order[0]] * sp[order[1]] <= 20480:
        return None
    return order


def flat_param_grads(
    gw: Optional[torch.Tensor], gb: Optional[torch.Tensor], need_w: bool, need_b: bool
) -> Optional[torch.Tensor]:
    """``[weight grad | bias grad]`` (the needed ones) as one new flat tensor, summed in one message;
    ``None`` when neither is needed."""
    params = [g.reshape(-1) for g, need in ((gw, need_w), (gb, need_b)) if need]
    return torch.cat(params) if params else None


def split_param_grads(flat: Optional[torch.Tensor], weight: torch.Tensor, need_w: bool, need_b: bool):
    """``(weight grad, bias grad)`` as views of :func:`flat_param_grads`'s ``flat`` (``None`` where not needed)."""
    n = weight.numel() if need_w else 0
    return (flat[:n].view_as(weight) if need_w else None), (flat[n : n + weight.shape[0]] if need_b else None)


def post_param_sum(flat: torch.Tensor, groups) -> list:
    """Post the sum of ``flat`` (weight and bias gradients) over ``groups[0]`` as an async all-reduce
    (in place); returns the pending works for :func:`finish_param_sum` (none without groups)."""
    if not groups:
        return []
    record_collective(
        "all_reduce", flat.numel() * flat.element_size(), dist.get_world_size(groups[0]), "conv.param_grads"
    )
    return [dist.all_reduce(flat, group=groups[0], async_op=True)]


def finish_param_sum(flat: torch.Tensor, pending: list, groups) -> torch.Tensor:
    """Wait for :func:`post_param_sum`'s works, then sum over each further mesh dim's group (blocking)."""
    for work in pending:
        work.wait()
    for g in groups[1:]:
        flat = all_reduce_sum(flat, g, "conv.param_grads")
    return flat


def _reduce_backward(
    grad_xp: Optional[torch.Tensor], flat: Optional[torch.Tensor], state, groups, owned: bool = False
) -> Optional[torch.Tensor]:
    """The adjoint halo exchange of ``grad_xp`` (``owned``: see :func:`~tplayers.comm.halo.halo_adjoint`)
    with an async all-reduce of ``flat`` over the first group, posted after the halo messages and
    waited after them; one blocking all-reduce per further mesh dim."""
    pending = []

    def start_reduce():
        pending.extend(post_param_sum(flat, groups))

    grad_x = None
    if grad_xp is not None:
        grad_x = halo_adjoint(grad_xp, state, during=start_reduce, owned=owned)
    else:
        start_reduce()
    if groups:
        finish_param_sum(flat, pending, groups)
    return grad_x


def _compiled_backward(gxp, flat, state, groups):
    """The backward's communication as the custom op ``tplayers::halo_conv_backward`` (for
    ``torch.compile``): returns ``(grad_x or None, summed flat or None)``."""
    if flat is None:
        return (halo_adjoint(gxp, state) if gxp is not None else None), None
    has_x = gxp is not None
    _ensure_conv_ops()
    grad_x, summed = torch.ops.tplayers.halo_conv_backward(
        gxp if has_x else flat.new_empty(0),
        flat,
        has_x,
        *state_codes(state),
        *([g.group_name for g in groups] + ["", ""])[:2],
    )
    return (grad_x if has_x else None), summed


def _halo_conv_backward_op(
    gxp: torch.Tensor,
    flat: torch.Tensor,
    has_x: bool,
    dim: int,
    group_name: str,
    recv: List[int],
    send: List[int],
    n: int,
    lo: int,
    hi: int,
    grad_format: int,
    reduce0: str,
    reduce1: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eager body of :func:`_compiled_backward`: the same paths as :meth:`HaloConvFunction.backward`."""
    state = state_from_codes(dim, group_name, recv, send, n, lo, hi, grad_format)
    groups = [group_by_name(name) for name in (reduce0, reduce1) if name]  # a mesh has at most 2 dims
    flat = flat.clone()  # reduced in place below; the op's input stays untouched
    gxp = gxp if has_x else None
    grad_x = _reduce_backward(gxp, flat, state, groups)
    return (grad_x if has_x else flat.new_empty(0)), flat


def _halo_conv_backward_fake(gxp, flat, has_x, dim, group_name, recv, send, n, lo, hi, grad_format, reduce0, reduce1):
    if has_x:
        shape = list(gxp.shape)
        shape[dim] = n
        grad_x = torch.empty(shape, dtype=gxp.dtype, device=gxp.device, memory_format=format_of(grad_format))
    else:
        grad_x = flat.new_empty(0)
    return grad_x, torch.empty_like(flat)


@constant_result
def _ensure_conv_ops() -> bool:
    """Register ``tplayers::halo_conv_backward`` on first use (idempotent; see :mod:`tplayers.ops.registry`)."""
    return register([OpSpec("tplayers::halo_conv_backward", _halo_conv_backward_op, _halo_conv_backward_fake)])
