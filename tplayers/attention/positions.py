"""Where a rank's tokens sit in the serial token order: :func:`token_positions` (flattened grid factors,
each sharded over a mesh dim or whole), for masks, causal attention and position tables over sharded
tokens (:mod:`tplayers.attention.sdpa`, the region guard's token rules)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from tplayers.attention.plan import gather_rows, topology
from tplayers.mesh import resolve_mesh

__all__ = ["token_positions"]


def token_positions(
    local_sizes: Sequence[int], mesh_dims: Sequence[Optional[int]], mesh: Optional[DeviceMesh] = None
) -> Tuple[torch.Tensor, int]:
    """Global row-major indices of this rank's tokens when the token dim flattens factors of local
    sizes ``local_sizes`` (e.g. ``(H_local, W_local)``), factor ``i`` sharded over mesh dim
    ``mesh_dims[i]`` (an int) or not sharded (None). Returns ``(positions int64 (prod(local_sizes),),
    global_length)``. One small all-gather of the sizes; call it identically on every rank.

    Args:
        local_sizes: this rank's size of each factor of the token dim.
        mesh_dims: per factor, the mesh dim sharding it, or ``None``.
        mesh: the mesh (``None``: :func:`tplayers.default_mesh`).

    Returns:
        ``(positions, global_length)``: int64 ``(prod(local_sizes),)`` and an int.

    Raises:
        ValueError: mismatched lengths, negative sizes, bad or repeated ``mesh_dims``, sizes that
            do not form a grid across ranks.

    Example (``torchrun --nproc-per-node 4``: a 2x2 mesh, an image of 6x5 pixels sharded over H and W)::

        import torch, tplayers
        from tplayers.functional import token_positions
        mesh = tplayers.init_mesh((2, 2), names=("h", "w"))
        c = mesh.get_coordinate()
        h, w = (3, 3) if c[1] == 0 else (3, 2)
        pos, total = token_positions((h, w), (0, 1), mesh)
        grid = torch.arange(30).view(6, 5)                 # the serial row-major token indices
        assert total == 30 and torch.equal(pos, grid[3 * c[0]:3 * c[0] + 3, 3 * c[1]:3 * c[1] + w].reshape(-1))
    """
    mesh = resolve_mesh(mesh, tuple(range(1, 9)))
    sizes = [int(s) for s in local_sizes]
    dims = list(mesh_dims)
    if len(sizes) != len(dims) or not sizes:
        raise ValueError(
            f"token_positions: local_sizes and mesh_dims need one entry per factor, got {len(sizes)} and {len(dims)}"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"token_positions: local_sizes must be non-negative, got {sizes}")
    used = [d for d in dims if d is not None]
    if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < mesh.ndim for d in used) or len(
        set(used)
    ) != len(used):
        raise ValueError(
            f"token_positions: mesh_dims entries must be distinct mesh dims in [0, {mesh.ndim}) or None, got {dims}"
        )
    topo = topology(mesh)
    table = torch.tensor(gather_rows(sizes, topo, "attention.token_positions")).view(topo.shape + (len(sizes),))
    coord = [int(c) for c in mesh.get_coordinate()]
    glob, offsets = [], []
    for i, d in enumerate(dims):
        if d is None:
            if not bool((table[..., i] == sizes[i]).all()):
                raise ValueError(
                    f"token_positions: factor {i} is not sharded, so every rank must hold the same "
                    f"size, got {sorted(set(table[..., i].flatten().tolist()))}"
                )
            glob.append(sizes[i])
            offsets.append(0)
            continue
        # sizes of factor i along mesh dim d, for every setting of the other mesh dims
        along = table[..., i].movedim(d, -1).reshape(-1, topo.shape[d])  # (other coordinates, shape[d])
        if not bool((along == along[0]).all()):
            raise ValueError(
                f"token_positions: factor {i}'s local sizes along mesh dim {d} differ between the "
                f"other mesh coordinates: {table[..., i].tolist()}"
            )
        line = along[0].tolist()
        glob.append(sum(line))
        offsets.append(sum(line[: coord[d]]))
    pos = torch.zeros((), dtype=torch.int64)
    stride = 1
    for i in reversed(range(len(sizes))):
        idx = torch.arange(offsets[i], offsets[i] + sizes[i], dtype=torch.int64) * stride
        pos = idx.view((-1,) + (1,) * (len(sizes) - 1 - i)) + pos
        stride *= glob[i]
    return pos.reshape(-1), stride
