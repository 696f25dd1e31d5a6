"""The collectives as registered custom ops, for ``torch.compile(fullgraph=True)``.

``torch.compile`` cannot trace ``torch.distributed`` calls (they break the
graph). Each op here is an opaque node of the graph whose implementation is the
eager collective (so comm accounting still counts it at run time) and whose
fake implementation only states the output's shape. A process group travels
as its name (``group.group_name``), which dynamo reads from the group object.

The raw collectives of :mod:`tplayers.comm.collectives` switch to these ops
while compiling (``torch.compiler.is_compiling()``), so every autograd Function
built on them (forward and backward) traces into one graph; eager execution
keeps calling ``torch.distributed`` directly (no dispatcher overhead).

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

__all__ = ["all_reduce_op", "all_gather_op"]


def _group(name: str):
    return _resolve_process_group(name)


@torch.library.custom_op("tplayers::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, group_name: str, tag: str) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new contiguous tensor."""
    from tplayers.comm.collectives import _eager_all_reduce_sum

    return _eager_all_reduce_sum(x.clone(memory_format=torch.contiguous_format), _group(group_name), tag)


@all_reduce_op.register_fake
def _(x, group_name, tag):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tplayers::all_gather", mutates_args=())
def all_gather_op(x: torch.Tensor, dim: int, sizes: List[int], group_name: str, tag: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank ``r`` holds ``sizes[r]`` rows)."""
    from tplayers.comm.collectives import _eager_all_gather_along_dim

    return _eager_all_gather_along_dim(x, dim, sizes, _group(group_name), tag).contiguous()


@all_gather_op.register_fake
def _(x, dim, sizes, group_name, tag):
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)
