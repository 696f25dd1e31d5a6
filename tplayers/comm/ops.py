"""The collectives as registered custom ops, for ``torch.compile(fullgraph=True)``.

``torch.compile`` cannot trace ``torch.distributed`` calls (they break the
graph). Each op here is an opaque node of the graph whose implementation is the
eager collective (so comm accounting still counts it at run time) and whose
fake implementation only states the output's shape. A process group travels
as its name (``group.group_name``), which dynamo reads from the group object.

The raw collectives of :mod:`tplayers.comm.collectives` switch to these ops
while compiling (``torch.compiler.is_compiling()``), so every autograd Function
built on them (forward and backward) traces into one graph; eager execution
keeps calling ``torch.distributed`` directly (no dispatcher overhead). Importing
this module registers nothing: the ops are registered on first use, by
:func:`ensure_comm_ops` (see :mod:`tplayers.ops.registry`).

Example::

    import torch, tplayers
    mesh = tplayers.init_mesh()
    mlp = torch.nn.Sequential(tplayers.ColumnParallelLinear(8, 16, mesh=mesh),
                              torch.nn.GELU(), tplayers.RowParallelLinear(16, 8, mesh=mesh))
    compiled = torch.compile(mlp, fullgraph=True)    # one graph, collectives inside
    y = compiled(torch.randn(4, 8))
"""

from __future__ import annotations

from typing import List

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from tplayers.ops.registry import OpSpec, register

__all__ = ["ensure_comm_ops", "all_reduce_op", "all_gather_op", "halo_pad_op", "halo_adjoint_op", "format_code",
           "peer_code", "halo_state"]

_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def _group(name: str):
    return _resolve_process_group(name)


def format_code(memory_format: torch.memory_format) -> int:
    """A memory format as an int (custom-op schemas have no memory_format type)."""
    return _FORMATS.index(memory_format)


def peer_code(peer) -> int:
    """A neighbour's global rank, -1 for none."""
    return -1 if peer is None else int(peer)


def halo_state(dim: int, group_name: str, recv, send, n: int, lo: int, hi: int, grad_format: int):
    """The :class:`~tplayers.domain.halo.HaloState` an op's integer arguments describe."""
    from tplayers.domain.halo import HaloState

    peers = (None if lo < 0 else lo, None if hi < 0 else hi)
    return HaloState(dim, _group(group_name), tuple(recv), tuple(send), n, peers, _FORMATS[grad_format])


def all_reduce_op(x: torch.Tensor, group_name: str, tag: str) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new contiguous tensor."""
    from tplayers.comm.collectives import _eager_all_reduce_sum

    return _eager_all_reduce_sum(x.clone(memory_format=torch.contiguous_format), _group(group_name), tag)


def _all_reduce_fake(x, group_name, tag):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def all_gather_op(x: torch.Tensor, dim: int, sizes: List[int], group_name: str, tag: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank ``r`` holds ``sizes[r]`` rows)."""
    from tplayers.comm.collectives import _eager_all_gather_along_dim

    return _eager_all_gather_along_dim(x, dim, sizes, _group(group_name), tag).contiguous()


def _all_gather_fake(x, dim, sizes, group_name, tag):
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


def halo_pad_op(x: torch.Tensor, dim: int, group_name: str, recv: List[int], send: List[int], periodic: bool,
                memory_format: int) -> torch.Tensor:
    """``x`` padded with its neighbours' rows along ``dim`` (see :func:`tplayers.domain.halo.halo_pad`)."""
    from tplayers.domain.halo import halo_pad

    return halo_pad(x, dim, _group(group_name), tuple(recv), tuple(send), periodic, _FORMATS[memory_format])[0]


def _halo_pad_fake(x, dim, group_name, recv, send, periodic, memory_format):
    shape = list(x.shape)
    shape[dim] += recv[0] + recv[1]
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_FORMATS[memory_format])


def halo_adjoint_op(grad: torch.Tensor, dim: int, group_name: str, recv: List[int], send: List[int], n: int,
                    lo: int, hi: int, grad_format: int) -> torch.Tensor:
    """The adjoint of :func:`halo_pad_op`: halo gradients sent back and added into their owners' rows."""
    from tplayers.domain.halo import halo_adjoint

    return halo_adjoint(grad, halo_state(dim, group_name, recv, send, n, lo, hi, grad_format))


def _halo_adjoint_fake(grad, dim, group_name, recv, send, n, lo, hi, grad_format):
    shape = list(grad.shape)
    shape[dim] = n
    return torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=_FORMATS[grad_format])


_OPS = (
    OpSpec("tplayers::all_reduce", all_reduce_op, _all_reduce_fake),
    OpSpec("tplayers::all_gather", all_gather_op, _all_gather_fake),
    OpSpec("tplayers::halo_pad", halo_pad_op, _halo_pad_fake),
    OpSpec("tplayers::halo_adjoint", halo_adjoint_op, _halo_adjoint_fake),
)


@torch.compiler.assume_constant_result
def ensure_comm_ops() -> bool:
    """Register ``tplayers::all_reduce``, ``all_gather``, ``halo_pad`` and ``halo_adjoint`` unless they
    are registered already (idempotent); called right before one of them is used while compiling."""
    return register(_OPS)
