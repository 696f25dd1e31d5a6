"""Halo exchange for domain parallelism: pad the local slab with its neighbours' edge rows.

``halo_exchange(x, mesh, shard_dims, recv, send, periodic)`` returns ``x``
padded along each sharded dim ``shard_dims[i]`` (sharded over mesh dim ``i``):
``recv[i] = (lo, hi)`` rows arrive on the low / high side, ``send[i] = (lo, hi)``
rows (this rank's first / last rows) go to the low / high neighbour and must
equal that neighbour's ``recv`` on the facing side. Widths are per rank
(asymmetric, any values); along shard dim ``i`` they must depend only on the mesh
coordinate ``i`` (a grid partition), which is what layers compute.

Boundaries: ``periodic[i]=True`` wraps (the first rank's low neighbour is the
last rank, a mesh dim of size 1 wraps onto itself). Otherwise the global
boundary is **zero filled**: the first rank's low halo and the last rank's
high halo are zeros (so a zero-padded convolution can read its padding from the
halo), and sends toward a missing neighbour are not made (their widths are ignored).

On a 2-D mesh the exchange runs along mesh dim 0, then along mesh dim 1 on the
already padded tensor, so corner blocks travel with the second exchange
(diagonal neighbours need no group of their own, and every byte sent is needed).

Backward is the exact adjoint: halo gradients go back to the rank that owns
those rows and are added into its edge rows (zero-filled halos drop theirs).

Example (2 ranks, ``torchrun --nproc-per-node 2``)::

    import torch, tplayers
    from tplayers.comm import halo_exchange
    mesh = tplayers.init_mesh()
    x = torch.randn(1, 1, 5, 4)                                  # this rank's rows
    y = halo_exchange(x, mesh, (2,), recv=[(1, 1)], send=[(1, 1)], periodic=[False])
    # y: (1, 1, 7, 4); rank 0 has a zero row on top, rank 1 a zero row below
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import exchange_p2p, group_by_name
from tplayers.comm.halo_route import HaloRoute, halo_route
from tplayers.ops import pack_faces, unpack_faces
from tplayers.ops.registry import OpSpec, constant_result, register

__all__ = [
    "HaloRoute",
    "HaloState",
    "halo_pad",
    "halo_route",
    "halo_state",
    "halo_adjoint",
    "ensure_halo_ops",
]

Pair = Tuple[int, int]

# channels-last layout of a 4-D / 5-D tensor (the input gradient keeps the input's layout)
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}

# Tags keep the two directions apart when both neighbours are the same rank (2 ranks, periodic).
_TAG_DOWN, _TAG_UP = 17, 18


def _swap(
    src: torch.Tensor,
    dim: int,
    to_lo: Pair,
    to_hi: Pair,
    from_hi: int,
    from_lo: int,
    route: "HaloRoute",
    tag: str,
    during: Optional[Callable[[], None]] = None,
) -> Tuple[torch.Tensor, int]:
    """Send face ``to_lo`` of ``src`` to the low neighbour and ``to_hi`` to the high one (``route``);
    receive ``from_hi`` rows from the high neighbour and ``from_lo`` rows from the low one.

    Returns the receive buffer ``[rows from lo | rows from hi]`` and the element count
    of the first part. Faces are ``(start, length)`` along ``dim``. All ops are posted in
    one batch (:func:`~tplayers.comm.collectives.exchange_p2p`, the same order on every rank)
    and all are waited before returning, so the send buffer is never reused early.
    ``during`` (optional) runs once the messages are posted and before they are waited.
    """
    (lo, hi), (lo_g, hi_g), group_size = route.peers, route.local, route.size
    row = _row_numel(src, dim)
    faces = []
    if lo is not None and to_lo[1]:
        faces.append(to_lo)
    if hi is not None and to_hi[1]:
        faces.append(to_hi)
    sendbuf = pack_faces(src, dim, faces)
    n_lo_recv = row * from_lo if lo is not None else 0
    n_hi_recv = row * from_hi if hi is not None else 0
    recvbuf = src.new_empty(n_lo_recv + n_hi_recv)  # [from lo | from hi]
    sends, recvs, offset = [], [], 0  # (tensor, the peer's rank in the group, tag)
    for peer, face, ptag in ((lo_g, to_lo, _TAG_DOWN), (hi_g, to_hi, _TAG_UP)):
        if peer is not None and face[1] and row:  # empty messages are skipped on both sides
            size = row * face[1]
            part = sendbuf if size == sendbuf.numel() else sendbuf[offset : offset + size]  # one message: no slice
            offset += size
            record_collective("send", size * part.element_size(), group_size, tag)
            sends.append((part, peer, ptag))
    # Receive from hi what it sent down, and from lo what it sent up: same order everywhere.
    if n_hi_recv:
        record_collective("recv", n_hi_recv * recvbuf.element_size(), group_size, tag)
        recvs.append((recvbuf if not n_lo_recv else recvbuf[n_lo_recv:], hi_g, _TAG_DOWN))
    if n_lo_recv:
        record_collective("recv", n_lo_recv * recvbuf.element_size(), group_size, tag)
        recvs.append((recvbuf if not n_hi_recv else recvbuf[:n_lo_recv], lo_g, _TAG_UP))
    exchange_p2p(route.group, sends, recvs, route.direct, during)
    del sendbuf  # complete: safe to release
    return recvbuf, n_lo_recv


def _row_numel(t: torch.Tensor, dim: int) -> int:
    """Elements in one row of ``t`` along ``dim`` (the product of the other dims)."""
    return math.prod(s for d, s in enumerate(t.shape) if d != dim)


@dataclass(frozen=True)
class HaloState:
    """What the adjoint of one exchange needs: dim, group, widths, local rows, peers, x's layout
    (``route``: the resolved neighbours, derived from ``group`` and ``peers`` when not given)."""

    dim: int
    group: dist.ProcessGroup
    recv: Pair
    send: Pair
    n: int
    peers: Tuple[Optional[int], Optional[int]]
    grad_format: torch.memory_format
    route: Optional[HaloRoute] = field(default=None, compare=False, repr=False)

    def resolved(self) -> HaloRoute:
        """``route``, or the route of ``group`` and ``peers``."""
        return self.route if self.route is not None else halo_route(self.group, peers=self.peers)


def _grad_format(x: torch.Tensor) -> torch.memory_format:
    """``x``'s own layout: channels-last (4-D / 5-D, not also contiguous) or contiguous."""
    cl_format = _CHANNELS_LAST.get(x.dim())
    cl = cl_format is not None and not x.is_contiguous() and x.is_contiguous(memory_format=cl_format)
    return cl_format if cl else torch.contiguous_format


def halo_state(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    recv: Pair,
    send: Pair,
    periodic: bool,
    route: Optional[HaloRoute] = None,
) -> HaloState:
    """The :class:`HaloState` of exchanging ``x`` (what :func:`halo_pad` returns with the padded tensor);
    ``route``: the exchange's :func:`halo_route`, when the caller keeps it (else resolved here)."""
    route = halo_route(group, periodic) if route is None else route
    return HaloState(dim, group, tuple(recv), tuple(send), x.size(dim), route.peers, _grad_format(x), route)


def halo_pad(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    recv: Pair,
    send: Pair,
    periodic: bool,
    memory_format: torch.memory_format = torch.contiguous_format,
    out: Optional[torch.Tensor] = None,
    route: Optional[HaloRoute] = None,
) -> Tuple[torch.Tensor, HaloState]:
    """Forward of :class:`HaloExchange1d` without autograd: the padded tensor and the adjoint's state.

    While compiling (``torch.compile``) the exchange is the custom op ``tplayers::halo_pad``.
    ``out`` (optional, eager): the padded buffer to fill (``x``'s shape padded along ``dim``, any
    layout). ``route``: :func:`halo_route` of ``group`` and ``periodic``, when the caller keeps it
    (a layer, once per layout).
    """
    state = halo_state(x, dim, group, recv, send, periodic, route)
    if torch.compiler.is_compiling():
        ensure_halo_ops()
        out = torch.ops.tplayers.halo_pad(
            x, dim, group.group_name, list(recv), list(send), bool(periodic), format_code(memory_format)
        )
        return out, state
    return _eager_halo_pad(x, state, periodic, memory_format, out), state


def _eager_halo_pad(
    x: torch.Tensor,
    state: HaloState,
    periodic: bool,
    memory_format: torch.memory_format,
    out: Optional[torch.Tensor] = None,
):
    route = state.resolved()
    dim, n, (lo, hi), size = state.dim, state.n, route.peers, route.size
    (r_lo, r_hi), (s_lo, s_hi) = state.recv, state.send
    shape = list(x.shape)
    shape[dim] = r_lo + n + r_hi
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format)
    assert list(out.shape) == shape, (list(out.shape), shape)
    out.narrow(dim, r_lo, n).copy_(x)
    if size == 1 and periodic:  # wraps onto itself: local copies, no communication
        out.narrow(dim, 0, r_lo).copy_(x.narrow(dim, n - r_lo, r_lo))
        out.narrow(dim, r_lo + n, r_hi).copy_(x.narrow(dim, 0, r_hi))
        return out
    buf, _ = _swap(x, dim, (0, s_lo), (n - s_hi, s_hi), r_hi, r_lo, route, "halo.fwd")
    faces = []
    if lo is None:
        out.narrow(dim, 0, r_lo).zero_()
    elif r_lo:
        faces.append((0, r_lo))
    if hi is None:
        out.narrow(dim, r_lo + n, r_hi).zero_()
    elif r_hi:
        faces.append((r_lo + n, r_hi))
    unpack_faces(buf, out, dim, faces)
    return out


def halo_adjoint(
    grad: torch.Tensor, state: HaloState, during: Optional[Callable[[], None]] = None, owned: bool = False
) -> torch.Tensor:
    """Backward of :class:`HaloExchange1d`: the gradient of ``x`` from the padded tensor's ``grad``.

    ``during`` (optional) runs after the messages are posted and before they are
    waited, so a caller can overlap other work (e.g. an async all-reduce) with them.
    ``owned=True`` (eager only): ``grad`` is a fresh buffer of the caller's, which nothing else
    reads (a convolution's input gradient); when it is laid out in the input's layout, the result
    is the view of its own rows with the halo gradients added in place, instead of a copy of them
    (the same values: the halo rows that travel are packed before any own row changes).
    While compiling, the adjoint is the custom op ``tplayers::halo_adjoint``
    (``during`` then runs before it).
    """
    if torch.compiler.is_compiling():
        if during is not None:
            during()
        ensure_halo_ops()
        return torch.ops.tplayers.halo_adjoint(grad, *state_codes(state))
    route = state.resolved()
    dim, n, (lo, hi), size = state.dim, state.n, route.peers, route.size
    (r_lo, r_hi), (s_lo, s_hi) = state.recv, state.send
    grad_x = grad.narrow(dim, r_lo, n)
    if not (owned and grad.is_contiguous(memory_format=state.grad_format)):
        grad_x = grad_x.clone(memory_format=state.grad_format)
    if size == 1 and lo is not None:  # periodic onto itself
        if during is not None:
            during()
        grad_x.narrow(dim, n - r_lo, r_lo).add_(grad.narrow(dim, 0, r_lo))
        grad_x.narrow(dim, 0, r_hi).add_(grad.narrow(dim, r_lo + n, r_hi))
        return grad_x
    # Adjoint of the forward swap: halo gradients travel back the way the rows came.
    buf, _ = _swap(grad, dim, (0, r_lo), (r_lo + n, r_hi), s_hi, s_lo, route, "halo.bwd", during)
    faces = []
    if lo is not None and s_lo:
        faces.append((0, s_lo))
    if hi is not None and s_hi:
        faces.append((n - s_hi, s_hi))
    unpack_faces(buf, grad_x, dim, faces, accumulate=True)  # overlapping faces add up
    return grad_x


def _pad_arg(ndim: int, dim: int, pair: Pair) -> List[int]:
    pad = [0] * (2 * (ndim - dim))
    pad[-2], pad[-1] = pair
    return pad


# ------------------------------------------------------------- custom ops (torch.compile)
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def format_code(memory_format: torch.memory_format) -> int:
    """A memory format as an int (custom-op schemas have no memory_format type)."""
    return _FORMATS.index(memory_format)


def format_of(code: int) -> torch.memory_format:
    """The memory format :func:`format_code` gave ``code``."""
    return _FORMATS[code]


def peer_code(peer) -> int:
    """A neighbour's global rank, -1 for none."""
    return -1 if peer is None else int(peer)


def state_codes(state: HaloState) -> tuple:
    """``state`` as a custom op's integer arguments (dim, group name, recv, send, n, lo, hi, grad
    format); :func:`state_from_codes` is the inverse."""
    return (
        state.dim,
        state.group.group_name,
        list(state.recv),
        list(state.send),
        state.n,
        peer_code(state.peers[0]),
        peer_code(state.peers[1]),
        format_code(state.grad_format),
    )


def state_from_codes(dim: int, group_name: str, recv, send, n: int, lo: int, hi: int, grad_format: int) -> HaloState:
    """The :class:`HaloState` a custom op's integer arguments describe."""
    peers = (None if lo < 0 else lo, None if hi < 0 else hi)
    return HaloState(dim, group_by_name(group_name), tuple(recv), tuple(send), n, peers, _FORMATS[grad_format])


def _halo_pad_op(
    x: torch.Tensor, dim: int, group_name: str, recv: List[int], send: List[int], periodic: bool, memory_format: int
) -> torch.Tensor:
    return halo_pad(x, dim, group_by_name(group_name), tuple(recv), tuple(send), periodic, _FORMATS[memory_format])[0]


def _halo_pad_fake(x, dim, group_name, recv, send, periodic, memory_format):
    shape = list(x.shape)
    shape[dim] += recv[0] + recv[1]
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_FORMATS[memory_format])


def _halo_adjoint_op(
    grad: torch.Tensor,
    dim: int,
    group_name: str,
    recv: List[int],
    send: List[int],
    n: int,
    lo: int,
    hi: int,
    grad_format: int,
) -> torch.Tensor:
    return halo_adjoint(grad, state_from_codes(dim, group_name, recv, send, n, lo, hi, grad_format))


def _halo_adjoint_fake(grad, dim, group_name, recv, send, n, lo, hi, grad_format):
    shape = list(grad.shape)
    shape[dim] = n
    return torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=_FORMATS[grad_format])


_OPS = (
    OpSpec("tplayers::halo_pad", _halo_pad_op, _halo_pad_fake),
    OpSpec("tplayers::halo_adjoint", _halo_adjoint_op, _halo_adjoint_fake),
)


@constant_result
def ensure_halo_ops() -> bool:
    """Register ``tplayers::halo_pad`` and ``tplayers::halo_adjoint`` unless they are registered
    already (idempotent); called right before one of them is used while compiling."""
    return register(_OPS)
