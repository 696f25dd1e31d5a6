"""One rank's tensors to every rank, flattened: broadcast (replicated) and scatter (sharded pieces).

Not autograd Functions: these move parameter *values* once (``parallelize_module(...,
src_rank=...)``), outside any graph. Tensors are grouped by ``(device, dtype)`` and each group
travels as one flat buffer, so a whole model costs one broadcast and one scatter per dtype.
Receivers get fresh buffers; nothing is written into the caller's tensors here, so a failed
collective leaves them untouched (the caller copies out after every transfer succeeded).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.accounting import record_collective

__all__ = ["broadcast_flat", "scatter_flat", "mesh_index"]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, bool viewed as uint8 (not every backend reduces or moves bool)."""
    t = t.detach().reshape(-1)
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def mesh_index(mesh: DeviceMesh) -> int:
    """This process's position in ``mesh`` flattened in row-major order."""
    index = 0
    for dim in range(mesh.ndim):
        index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return index


def _coords(mesh: DeviceMesh, index: int) -> List[int]:
    coords = []
    for dim in reversed(range(mesh.ndim)):
        index, c = divmod(index, mesh.size(dim))
        coords.append(c)
    return coords[::-1]


def broadcast_flat(tensors: Sequence[torch.Tensor], mesh: DeviceMesh, src: int, tag: str = "") -> List[torch.Tensor]:
    """``src``'s values of ``tensors`` (every rank passes tensors of the same shapes and dtypes),
    returned as new tensors; ``src`` is a row-major index into the mesh (1-D or 2-D).

    One broadcast per ``(device, dtype)`` group and mesh dim: along the last mesh dim from
    ``src``'s coordinate, then along the first (the ranks that got ``src``'s values pass them on).
    """
    out: List[torch.Tensor] = [t.detach() for t in tensors]
    coords, me_is_src = _coords(mesh, src), mesh_index(mesh) == src
    for (device, dtype), members in _groups(tensors).items():
        if me_is_src:
            flat = torch.cat([_wire(tensors[i]) for i in members])
        else:  # receives src's values
            wire_dtype = torch.uint8 if dtype == torch.bool else dtype
            flat = torch.empty(sum(tensors[i].numel() for i in members), dtype=wire_dtype, device=device)
        for dim in reversed(range(mesh.ndim)):
            group, size = mesh.get_group(dim), mesh.size(dim)
            if size == 1:
                continue
            record_collective("broadcast", flat.numel() * flat.element_size(), size, tag)
            dist.broadcast(flat, group=group, group_src=coords[dim])
        offset = 0
        for i in members:
            n = tensors[i].numel()
            piece = flat[offset : offset + n]
            piece = piece.view(torch.bool) if dtype == torch.bool else piece
            out[i] = piece.view(tensors[i].shape)
            offset += n
    return out


def scatter_flat(
    pieces: Optional[Sequence[Sequence[torch.Tensor]]],
    shapes: Sequence[Sequence[Tuple[int, ...]]],
    like: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    src: int,
    tag: str = "",
) -> List[torch.Tensor]:
    """Rank ``r`` of a 1-D ``mesh`` receives ``pieces[r]`` (given on ``src`` only; ``None``
    elsewhere) as new tensors. ``shapes[r][i]`` is the shape of rank ``r``'s piece ``i`` (known
    to every rank from the layout, so no sizes are exchanged); ``like[i]`` gives piece ``i``'s
    device and dtype, the same on every rank.

    One scatter per ``(device, dtype)`` group: each rank's pieces flattened into one buffer,
    padded to the longest rank's (uneven shards).
    """
    if mesh.ndim != 1:
        raise ValueError(f"scatter_flat needs a 1-D mesh, got a {mesh.ndim}-D mesh")
    world, me = mesh.size(0), mesh.get_local_rank(0)
    out: List[torch.Tensor] = [t.detach() for t in like]
    for (device, dtype), members in _groups(like).items():
        lengths = [sum(math.prod(shapes[r][i]) for i in members) for r in range(world)]
        longest = max(lengths)
        buf = torch.empty(longest, device=device, dtype=torch.uint8 if dtype == torch.bool else dtype)
        send = None
        if me == src:
            send = []
            for r in range(world):
                flat = [_wire(pieces[r][i]) for i in members] + [buf.new_zeros(longest - lengths[r])]
                send.append(torch.cat(flat))
        if world > 1:
            record_collective("scatter", longest * buf.element_size() * world, world, tag)
            dist.scatter(buf, send, group=mesh.get_group(0), group_src=src)
        else:
            buf.copy_(send[0])
        offset = 0
        for i in members:
            n = math.prod(shapes[me][i])
            piece = buf[offset : offset + n]
            piece = piece.view(torch.bool) if dtype == torch.bool else piece
            out[i] = piece.view(shapes[me][i])
            offset += n
    return out


def _groups(tensors: Sequence[torch.Tensor]) -> Dict[Tuple, List[int]]:
    groups: Dict[Tuple, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups
