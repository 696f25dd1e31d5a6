"""Domain-parallel 2-D convolution: the input is split spatially, the result is exact.

``DistributedConv2d`` takes every ``nn.Conv2d`` argument (same defaults) plus
``mesh`` and ``shard_dims``: ``(2,)`` shards H over a 1-D mesh, ``(3,)`` W, and
``(2, 3)`` both over a 2-D mesh. Input and output are plain local tensors,
this rank's slice along the sharded dims; gathering the outputs gives
``nn.Conv2d`` on the gathered input, and every gradient matches.

Per forward: a halo exchange per sharded dim, then a local ``F.conv2d``. The last
sharded dim's exchange and the convolution form one autograd Function,
:class:`HaloConv2dFunction`, whose backward runs the adjoint halo exchange while
one all-reduce sums the weight and bias gradients over the domain group (so every
rank holds the serial model's parameter gradient, and the all-reduce's latency
hides behind the halo messages; on a 1-D mesh of 2 ranks the sum is instead one exchange with
the peer inside the halo messages, see :func:`_pair_backward`). The first exchange on a
2-D mesh uses :class:`~tplayers.comm.HaloExchange1d`. A rank owning no output rows
returns an empty output through the same Function, so its collectives match its peers'.

Layout: local sizes may be any partition (not only :func:`tplayers.shard_sizes`).
Each rank's local shape is exchanged once per local shape (a small all-gather,
cached), validated identically on every rank (a ``ValueError`` everywhere, before
any halo traffic), and turned into halo widths and output ownership
(:mod:`tplayers.layers._conv_layout`). If the partition changes while some rank's
local shape does not, call :meth:`DistributedConv2d.reset_layout` on every rank.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.utils import _pair

from tplayers.comm import all_reduce_sum, halo_exchange_along, record_collective
from tplayers.comm.agree import exchange_agreed
from tplayers.comm.collectives import run_p2p
from tplayers.comm.halo import halo_adjoint, halo_pad
from tplayers.layers._common import ShardedModule, autocast_inputs
from tplayers.layers._conv_layout import PADDING_MODES, AxisPlan, plan_axis
from tplayers.sharding import ShardSpec

__all__ = ["DistributedConv2d", "HaloConv2dFunction"]

# memory_format=None: channels_last from this many channels per group (in and out), plain below.
AUTO_CHANNELS_LAST_MIN = 16

_TORCH_PAD_MODE = {"circular": "circular", "reflect": "reflect", "replicate": "replicate"}


def _pad_tuple(dim: int, lo: int, hi: int):
    """``F.pad`` argument padding only dim ``dim`` (2 or 3) of a 4-D tensor."""
    return (lo, hi, 0, 0) if dim == 3 else (0, 0, lo, hi)


class DistributedConv2d(ShardedModule):
    """``nn.Conv2d`` on a spatially sharded input (H, W or both), exact against the serial layer.

    Shapes (local = this rank's slice of the sharded dims, any partition):

    - ``weight``: ``(out_channels, in_channels // groups, kH, kW)``, ``bias``: ``(out_channels,)``,
      replicated; their gradients are summed over the domain group
    - input: ``(N, C_in, H_local, W_local)``; output: ``(N, C_out, Ho_local, Wo_local)``; output
      row ``o`` lives on the rank holding the centre of its receptive field

    ``padding_mode``: "zeros", "circular" (a periodic domain), "reflect", "replicate".
    ``memory_format`` (keyword, beyond ``nn.Conv2d``'s arguments): layout of the halo-padded
    buffer the exchange must allocate anyway, hence of the convolution and its output.
    ``torch.channels_last`` is what oneDNN and cuDNN convolve fastest once there are enough
    channels (about 1.5-2x on CPU here); with few channels the plain layout is faster. The
    default ``None`` ("auto") picks ``channels_last`` when ``in_channels // groups`` and
    ``out_channels // groups`` are both at least ``AUTO_CHANNELS_LAST_MIN`` (16), else
    ``torch.contiguous_format``; an explicit value is always used. Values are identical either
    way; the input gradient keeps the input's layout.
    Under ``torch.autocast`` it computes in the autocast dtype as ``nn.Conv2d`` does, and the
    halo messages and gradient sums carry that dtype.
    A partition whose shards cannot supply their neighbours' halos raises
    ``ValueError`` on every rank before any halo traffic.

    Example (``torchrun --nproc-per-node 2 example.py``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        serial = torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular")
        conv = tplayers.DistributedConv2d.from_module(serial, mesh=mesh, shard_dims=(2,))
        x = torch.randn(2, 3, 32, 16)                        # same on every rank
        y = tplayers.gather(conv(tplayers.shard(x, 2, mesh)), 2, mesh)
        torch.testing.assert_close(y, serial(x))
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,),
                 memory_format: Optional[torch.memory_format] = None) -> None:
        super().__init__()
        name = type(self).__name__
        for arg, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) "
                             f"must be divisible by groups ({groups})")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"{name}: padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.dilation = _pair(kernel_size), _pair(stride), _pair(dilation)
        if min(self.kernel_size + self.stride + self.dilation) < 1:
            raise ValueError(f"{name}: kernel_size, stride and dilation must be >= 1, got "
                             f"{self.kernel_size}, {self.stride}, {self.dilation}")
        self.padding, self.padding_mode = padding, padding_mode
        self._pads = self._resolve_padding(padding)
        dims = tuple(int(d) % 4 for d in shard_dims)
        if not dims or any(d not in (2, 3) for d in dims) or len(set(dims)) != len(dims):
            raise ValueError(f"{name}: shard_dims must be (2,), (3,) or (2, 3), got {tuple(shard_dims)}")
        self.shard_dims = dims
        if memory_format is None:
            narrow = min(in_channels, out_channels) // groups < AUTO_CHANNELS_LAST_MIN
            memory_format = torch.contiguous_format if narrow else torch.channels_last
        if memory_format not in (torch.channels_last, torch.contiguous_format):
            raise ValueError(f"{name}: memory_format must be None, torch.channels_last or torch.contiguous_format, "
                             f"got {memory_format}")
        self.memory_format = memory_format
        mesh = self._bind_mesh(mesh, len(dims))
        self._groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty((out_channels, in_channels // groups) + self.kernel_size, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, **kw))
        else:
            self.register_parameter("bias", None)
        self._layouts: Dict[Tuple[int, ...], Tuple[Dict[int, AxisPlan], Tuple[int, ...]]] = {}
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _resolve_padding(self, padding) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """(lo, hi) input padding for H and W, as ``nn.Conv2d`` applies it."""
        if isinstance(padding, str):
            if padding == "valid":
                return (0, 0), (0, 0)
            if padding != "same":
                raise ValueError(f"{type(self).__name__}: padding must be 'same', 'valid', an int or a pair, "
                                 f"got {padding!r}")
            if self.stride != (1, 1):
                raise ValueError(f"{type(self).__name__}: padding='same' needs stride 1, got {self.stride}")
            totals = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
            return tuple((t // 2, t - t // 2) for t in totals)
        ph, pw = _pair(padding)
        if min(ph, pw) < 0:
            raise ValueError(f"{type(self).__name__}: padding must be >= 0, got {padding!r}")
        return (ph, ph), (pw, pw)

    def reset_parameters(self) -> None:
        """``nn.Conv2d``'s initialisation, then a broadcast from the first domain rank so every
        rank holds the same replicated parameters (use ``from_module`` to copy a serial layer)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * self.kernel_size[0] * self.kernel_size[1]
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(self.bias, -bound, bound)
        with torch.no_grad():
            for group in self._groups:
                if dist.get_world_size(group) > 1:
                    for p in self.parameters():
                        dist.broadcast(p.data, dist.get_global_rank(group, 0), group=group)

    def shard_specs(self) -> Dict[str, ShardSpec]:
        """Weight and bias are replicated on every rank of the domain."""
        specs = {"weight": ShardSpec.replicated(self.weight.shape)}
        if self.bias is not None:
            specs["bias"] = ShardSpec.replicated(self.bias.shape)
        return specs

    @classmethod
    def from_module(cls, conv: nn.Conv2d, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,),
                    memory_format: Optional[torch.memory_format] = None):
        """The domain-parallel twin of ``conv``, holding a copy of its parameters.

        Build optimizers after swapping: the new parameters are new objects.
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"{cls.__name__}.from_module expects an nn.Conv2d, got {type(conv).__name__}")
        layer = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                    conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode, device="meta",
                    dtype=conv.weight.dtype, mesh=mesh, shard_dims=shard_dims, memory_format=memory_format)
        layer = layer.to_empty(device=conv.weight.device)
        layer._copy_shards_from(conv)
        return layer

    def reset_layout(self) -> None:
        """Forget cached partitions (call on every rank when the partition changes)."""
        self._layouts.clear()

    # ------------------------------------------------------------------ layout
    def _exchange_shapes(self, x: torch.Tensor, dtype: torch.dtype) -> list:
        """``table[c0][c1]`` = every rank's (ok, N, C, H, W, dtype/device ok)."""
        ok = isinstance(x, torch.Tensor) and x.dim() == 4
        shape = list(x.shape) if ok else [-1] * 4
        same = int(ok and x.dtype == dtype and x.device == self.weight.device)
        config = {"kernel_size": self.kernel_size, "stride": self.stride, "padding": self._pads,
                  "dilation": self.dilation, "groups": self.groups, "padding_mode": self.padding_mode,
                  "shard_dims": self.shard_dims, "in_channels": self.in_channels,
                  "out_channels": self.out_channels, "dtype": str(self.weight.dtype)}
        return exchange_agreed([int(ok)] + shape + [same], config, self._groups, type(self).__name__, "conv.layout")

    def _layout(self, x: torch.Tensor, dtype: torch.dtype):
        """Plans and output shape for ``x``'s local shape; ``dtype``: the compute dtype (the weight's,
        or the autocast dtype) that ``x`` must have."""
        key = tuple(x.shape) if isinstance(x, torch.Tensor) else None  # a bad input still joins the exchange
        if key in self._layouts:
            # Cached layout: every rank skips the exchange alike. The per-call checks stay local
            # (a dtype or device change must not reach the halo traffic with mismatched buffers).
            if x.dtype != dtype or x.device != self.weight.device:
                raise ValueError(f"{type(self).__name__}: input dtype/device must match the weight's "
                                 f"({dtype}, {self.weight.device}), got ({x.dtype}, {x.device})")
            return self._layouts[key]
        table = self._exchange_shapes(x, dtype)  # once per local shape
        name = type(self).__name__
        flat = [(c0, c1, row) for c0, rows in enumerate(table) for c1, row in enumerate(rows)]
        for c0, c1, row in flat:
            if not row[0]:
                raise ValueError(f"{name}: the input must be 4-D (N, C, H, W) on every rank; mesh position "
                                 f"{(c0, c1)[:self.mesh.ndim]} passed another rank")
            if not row[5]:
                raise ValueError(f"{name}: input dtype/device must match the weight's "
                                 f"({dtype}, {self.weight.device}) on every rank; mesh position "
                                 f"{(c0, c1)[:self.mesh.ndim]} differs")
        shapes = {(c0, c1): row[1:5] for c0, c1, row in flat}
        sizes_along = {}
        for d in (0, 1, 2, 3):
            mesh_dim = self.shard_dims.index(d) if d in self.shard_dims else None
            for (c0, c1), shp in shapes.items():
                peer = shapes[(0, c1)] if mesh_dim == 1 else shapes[(c0, 0)] if mesh_dim == 0 else shapes[(0, 0)]
                if shp[d] != peer[d]:
                    raise ValueError(
                        f"{name}: local input shapes differ across ranks in dim {d} "
                        f"({'not sharded' if mesh_dim is None else 'sharded over the other mesh dim'}): "
                        f"{shapes[(0, 0)]} vs {shp} at mesh position {(c0, c1)[:self.mesh.ndim]}"
                    )
            if mesh_dim == 0:  # shard sizes along this dim, in mesh order
                sizes_along[d] = [table[c0][0][1 + d] for c0 in range(len(table))]
            elif mesh_dim == 1:
                sizes_along[d] = [row[1 + d] for row in table[0]]
        if shapes[(0, 0)][1] != self.in_channels:
            raise ValueError(f"{name}: input must have {self.in_channels} channels, got {shapes[(0, 0)][1]}")
        plans: Dict[int, AxisPlan] = {}
        out_shape = [key[0], self.out_channels, 0, 0]
        for d in (2, 3):
            k, s, dil, pad = self.kernel_size[d - 2], self.stride[d - 2], self.dilation[d - 2], self._pads[d - 2]
            if d in self.shard_dims:
                i = self.shard_dims.index(d)
                per = plan_axis(sizes_along[d], kernel=k, stride=s, dilation=dil, pad=pad, mode=self.padding_mode,
                                what=f"dim {d} (mesh dim {i})")
                plans[d] = per[self.mesh.get_local_rank(i)]
                out_shape[d] = plans[d].out_rows
            else:
                plan_axis([key[d]], kernel=k, stride=s, dilation=dil, pad=pad, mode=self.padding_mode,
                          what=f"dim {d}")  # same checks as nn.Conv2d would make
                out_shape[d] = (key[d] + pad[0] + pad[1] - dil * (k - 1) - 1) // s + 1
        self._layouts[key] = (plans, tuple(out_shape))
        return self._layouts[key]

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, self.weight, self.bias)  # as F.conv2d under torch.autocast
        plans, out_shape = self._layout(x, weight.dtype)  # validated on every rank before any halo traffic
        empty = 0 in out_shape
        *first, last = sorted(plans)
        for d in first:  # H on a 2-D mesh: halo exchange (autograd Function), edge padding, trim
            x = self._edges(self._exchange(x, d, plans[d]), d, plans[d])  # same rows on the whole mesh row
        i = self.shard_dims.index(last)

        def local(xp, w, b):  # the part after the last exchange, differentiated inside the Function
            if empty:  # this rank owns no output rows: an empty output tied to the inputs, so the
                # backward (halo adjoints, gradient all-reduce) runs exactly as on every other rank
                tie = xp.sum() * 0 + w.sum() * 0 + (b.sum() * 0 if b is not None else 0)
                return xp.new_zeros(out_shape) + tie
            return self._local_conv(self._edges(xp, last, plans[last]), w, b)

        # (N, C_in, rows, W) -> (N, C_out, Ho_local, Wo_local)
        return HaloConv2dFunction.apply(x, weight, bias, last, self._groups[i], plans[last],
                                        self.padding_mode == "circular", self.memory_format, local, self._groups)

    def _exchange(self, x: torch.Tensor, d: int, p: AxisPlan) -> torch.Tensor:
        group = self._groups[self.shard_dims.index(d)]
        return halo_exchange_along(x, group, d, p.recv, p.send, self.padding_mode == "circular", self.memory_format)

    def _edges(self, x: torch.Tensor, d: int, p: AxisPlan) -> torch.Tensor:
        """Reflect / replicate padding at the global edge, then drop own rows nobody needs."""
        if max(p.boundary):
            x = F.pad(x, _pad_tuple(d, *p.boundary), mode=_TORCH_PAD_MODE[self.padding_mode])
        if p.trim[0] or p.trim[1]:
            x = x.narrow(d, p.trim[0], x.size(d) - p.trim[0] - p.trim[1])
        return x

    def _local_conv(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Pad the non-sharded dims as nn.Conv2d would, then convolve (sharded dims: no padding)."""
        conv_pad = [0, 0]
        for d in (2, 3):
            if d in self.shard_dims:
                continue
            lo, hi = self._pads[d - 2]
            if self.padding_mode == "zeros" and lo == hi:
                conv_pad[d - 2] = lo  # let the convolution pad
            elif lo or hi:
                mode = "constant" if self.padding_mode == "zeros" else _TORCH_PAD_MODE[self.padding_mode]
                x = F.pad(x, _pad_tuple(d, lo, hi), mode=mode)
        return F.conv2d(x, weight, bias, self.stride, tuple(conv_pad), self.dilation, self.groups)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        halo = [f"halo send/recv (dim {d})" for d in self.shard_dims]
        if len(self._groups) == 1 and dist.get_world_size(self._groups[0]) == 2:
            return halo, [f"halo send/recv (dim {self.shard_dims[0]}) carrying the weight+bias grads"]
        return halo, halo + ["all_reduce (weight+bias grads)"] * len(self.shard_dims)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding!r}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, padding_mode={self.padding_mode!r}, shard_dims={self.shard_dims}")


class HaloConv2dFunction(torch.autograd.Function):
    """forward: halo exchange of ``x`` along ``dim``, then ``local(x_padded, weight, bias)`` (edge
    padding, trim, the convolution) /
    backward: ``local``'s backward; then the adjoint halo exchange runs while one all-reduce sums the
    weight and bias gradients over the domain (further mesh dims: one more all-reduce each).

    Fusing the last exchange with the convolution lets the gradient all-reduce overlap the halo
    messages of the backward instead of following them.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dim, group, plan, periodic, memory_format, local, reduce_groups):
        xp, ctx.state = halo_pad(x, dim, group, plan.recv, plan.send, periodic, memory_format)
        with torch.enable_grad():  # record the local graph; it is differentiated in backward
            xp = xp.detach().requires_grad_(ctx.needs_input_grad[0])
            w = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            b = bias.detach().requires_grad_(ctx.needs_input_grad[2]) if bias is not None else None
            out = local(xp, w, b)
        ctx.graph, ctx.reduce_groups = (out, xp, w, b), reduce_groups
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, xp, w, b = ctx.graph
        ctx.graph = None
        wanted = [t for t in (xp, w, b) if t is not None and t.requires_grad]
        grads = dict(zip(map(id, wanted), torch.autograd.grad(out, wanted, grad)))
        params = [t for t in (w, b) if t is not None and t.requires_grad]
        flat = torch.cat([grads[id(t)].reshape(-1) for t in params]) if params else None
        groups = [g for g in ctx.reduce_groups if dist.get_world_size(g) > 1] if params else []
        if len(groups) == 1 and groups[0] is ctx.state.group and dist.get_world_size(groups[0]) == 2:
            grad_x = _pair_backward(grads[id(xp)] if xp.requires_grad else None, flat, ctx.state)
        else:
            grad_x = _reduce_backward(grads[id(xp)] if xp.requires_grad else None, flat, ctx.state, groups)
        out_grads, offset = {}, 0
        for t in params:
            out_grads[id(t)] = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
        gw = out_grads.get(id(w))
        gb = out_grads.get(id(b)) if b is not None else None
        return grad_x, gw, gb, None, None, None, None, None, None, None


def _pair_backward(grad_xp: Optional[torch.Tensor], flat: torch.Tensor, state) -> Optional[torch.Tensor]:
    """Two ranks: the parameter-gradient sum is one exchange with the peer (send mine, receive
    theirs, add), carried in the same batch as the adjoint halo messages: one round trip.

    ``mine + theirs`` on one rank and ``theirs + mine`` on the other are the same float sum,
    so both ranks hold bitwise-identical gradients (as an all-reduce would give them).
    """
    group = state.group
    peer = dist.get_global_rank(group, 1 - dist.get_rank(group))
    theirs = torch.empty_like(flat)
    if grad_xp is not None:
        grad_x = halo_adjoint(grad_xp, state, extra=(flat, theirs, peer, "conv.param_grads"))
    else:
        grad_x = None
        nbytes = flat.numel() * flat.element_size()
        record_collective("send", nbytes, 2, "conv.param_grads")
        record_collective("recv", nbytes, 2, "conv.param_grads")
        run_p2p([dist.P2POp(dist.isend, flat, peer), dist.P2POp(dist.irecv, theirs, peer)])
    flat.add_(theirs)
    return grad_x


def _reduce_backward(grad_xp: Optional[torch.Tensor], flat: Optional[torch.Tensor], state, groups) -> Optional[torch.Tensor]:
    """General case: an async all-reduce over the first group, posted after the halo messages and
    waited after them; one blocking all-reduce per further mesh dim."""
    pending = []

    def start_reduce():
        if groups:
            record_collective("all_reduce", flat.numel() * flat.element_size(), dist.get_world_size(groups[0]),
                              "conv.param_grads")
            pending.append(dist.all_reduce(flat, group=groups[0], async_op=True))

    grad_x = None
    if grad_xp is not None:
        grad_x = halo_adjoint(grad_xp, state, during=start_reduce)
    else:
        start_reduce()
    for work in pending:
        work.wait()
    for g in groups[1:]:
        all_reduce_sum(flat, g, "conv.param_grads")
    return grad_x
