"""``tplayers.repartition`` as code anywhere calls it, a domain region included: the all-to-alls of
:func:`tplayers.comm.all_to_all.repartition`, run with the region guard stepped aside, the result
tagged sharded along ``to_dims`` when a guard is active (so the guard follows the new sharding).

Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

    import torch, tplayers
    mesh = tplayers.init_mesh()
    full = torch.randn(2, 3, 10, 7, dtype=torch.float64)
    x = tplayers.shard(full, 2, mesh)                    # sharded along H
    with tplayers.domain_region(mesh, (2,), inputs=(x,)):
        w = tplayers.repartition(x, mesh, 2, 3)          # sharded along W, and the guard knows it
        m = w.mean(dim=3, keepdim=True)                  # routed: the global mean over W, H whole
    torch.testing.assert_close(m, full.mean(dim=3, keepdim=True))
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.all_to_all import repartition as _repartition
from tplayers.domain.active import active_guard, stepped_aside
from tplayers.domain.layout import region_layout

__all__ = ["repartition"]


def repartition(
    x: torch.Tensor,
    mesh: Optional[DeviceMesh],
    from_dims: Union[int, Sequence[int]],
    to_dims: Union[int, Sequence[int]],
) -> torch.Tensor:
    """This rank's slice of the same global tensor, sharded along ``to_dims`` instead of ``from_dims``.

    See :func:`tplayers.comm.all_to_all.repartition` for the arguments, errors and costs (one
    all-to-all per mesh dim whose sharded dim changes; backward the reverse). Inside a domain region
    the guard steps aside while it runs and the result is tagged sharded along ``to_dims``.
    """
    guard = active_guard()
    with stepped_aside(guard) if guard is not None else contextlib.nullcontext():
        out = _repartition(x, mesh, from_dims, to_dims)
        dims = (to_dims,) if isinstance(to_dims, int) else tuple(to_dims)
        dims = tuple(d % out.dim() for d in dims)
    if guard is not None and hasattr(guard, "mark"):
        guard.mark(out, region_layout(out.shape, dims))
    return out
