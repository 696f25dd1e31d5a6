"""Repartition: move a domain-sharded tensor from one sharded dim to another with all-to-alls.

A tensor sharded along dim ``a`` over a group of ``p`` ranks (rank ``r`` holds ``from_sizes[r]``
rows of ``a`` and the whole of dim ``b``) becomes sharded along ``b`` (rank ``r`` holds
``to_sizes[r]`` rows of ``b``, :func:`tplayers.shard_sizes` by default, and the whole of ``a``)
with one all-to-all over the group: rank ``r`` sends rank ``q`` its rows of ``a`` restricted to
``q``'s rows of ``b``. Every element that changes owner crosses the wire once, so the bytes a rank
sends are the minimum: its local size times ``(1 - its share of b)``.

On a 2-D mesh each mesh dim is repartitioned by its own all-to-all over that mesh dim's group
(one per mesh dim that moves). The pieces meet in ``torch.distributed.all_to_all_single`` (gloo
and NCCL both implement it, uneven splits included); complex tensors travel as their real view.

Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

    import torch, tplayers
    mesh = tplayers.init_mesh()
    full = torch.randn(2, 3, 10, 7, dtype=torch.float64)
    h = tplayers.shard(full, 2, mesh)                      # sharded along H
    w = tplayers.repartition(h, mesh, 2, 3)                 # now sharded along W
    torch.testing.assert_close(w, tplayers.shard(full, 3, mesh))
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.accounting import record_collective
from tplayers.comm.agree import exchange_agreed
from tplayers.mesh import resolve_mesh
from tplayers.sharding import offsets_from_sizes, shard_sizes

__all__ = [
    "all_to_all_dim",
    "AllToAllDim",
    "plan_moves",
    "grid_sizes",
    "mesh_tensor_dims",
    "repartition",
    "repartition_sized",
]

Dims = Union[int, Sequence[int]]
# (mesh dim, tensor dim sharded before, tensor dim sharded after): one all-to-all of a plan
Move = Tuple[int, int, int]


def all_to_all_dim(
    x: torch.Tensor,
    from_dim: int,
    to_dim: int,
    from_sizes: Sequence[int],
    to_sizes: Sequence[int],
    group: dist.ProcessGroup,
    tag: str = "",
) -> torch.Tensor:
    """``x`` sharded along ``from_dim`` (rank ``r`` holds ``from_sizes[r]`` rows, ``to_dim`` whole)
    -> sharded along ``to_dim`` (rank ``r`` holds ``to_sizes[r]`` rows, ``from_dim`` whole).

    One ``all_to_all_single`` over ``group`` (none for a group of one); records the bytes this rank
    sends to other ranks (its own block stays local) as ``all_to_all``.
    """
    world = dist.get_world_size(group)
    from_dim, to_dim = from_dim % x.dim(), to_dim % x.dim()
    if world == 1:
        return x
    me = dist.get_rank(group)
    assert x.size(from_dim) == from_sizes[me] and x.size(to_dim) == sum(to_sizes), (x.shape, from_sizes, to_sizes)
    offs = offsets_from_sizes(to_sizes)
    blocks = [x.narrow(to_dim, offs[q], to_sizes[q]).contiguous().reshape(-1) for q in range(world)]
    send = torch.cat(blocks) if blocks else x.new_empty(0)
    shapes = []
    for r in range(world):
        shape = list(x.shape)
        shape[from_dim], shape[to_dim] = int(from_sizes[r]), int(to_sizes[me])
        shapes.append(shape)
    counts_in = [b.numel() for b in blocks]
    counts_out = [_numel(s) for s in shapes]
    recv = x.new_empty(sum(counts_out))
    # Complex values travel as (real, imag) pairs of their real dtype.
    wire_send, wire_recv, k = send, recv, 1
    if send.is_complex():
        wire_send, wire_recv, k = torch.view_as_real(send).reshape(-1), torch.view_as_real(recv).reshape(-1), 2
    nbytes = (send.numel() - counts_in[me]) * send.element_size()
    record_collective("all_to_all", nbytes, world, tag)
    dist.all_to_all_single(wire_recv, wire_send, [c * k for c in counts_out], [c * k for c in counts_in], group=group)
    pieces = torch.split(recv, counts_out)
    return torch.cat([p.view(s) for p, s in zip(pieces, shapes)], from_dim)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class AllToAllDim(torch.autograd.Function):
    """forward: all-to-all from sharded along ``from_dim`` (``from_sizes``) to sharded along ``to_dim``
    (``to_sizes``) / backward: the reverse all-to-all of the gradient (``to_dim`` back to ``from_dim``)."""

    @staticmethod
    def forward(ctx, x, from_dim, to_dim, from_sizes, to_sizes, group):
        ctx.args = (from_dim, to_dim, list(from_sizes), list(to_sizes), group)
        return all_to_all_dim(x, from_dim, to_dim, from_sizes, to_sizes, group, "repartition.fwd")

    @staticmethod
    def backward(ctx, grad):
        from_dim, to_dim, from_sizes, to_sizes, group = ctx.args
        if torch.is_grad_enabled():  # create_graph=True: the reverse move as a node (tplayers.comm.twice)
            return AllToAllDim.apply(grad, to_dim, from_dim, to_sizes, from_sizes, group), None, None, None, None, None
        back = all_to_all_dim(grad, to_dim, from_dim, to_sizes, from_sizes, group, "repartition.bwd")
        return back, None, None, None, None, None


def plan_moves(current: Sequence[int], target: Sequence[int], spare: Sequence[int]) -> List[Move]:
    """The all-to-alls taking the sharded dims ``current`` (one tensor dim per mesh dim) to ``target``.

    A mesh dim moves once its target dim is not sharded by another mesh dim; a cycle (a swap of two
    mesh dims' dims) is broken by moving one of them through the first dim of ``spare`` that no mesh
    dim shards (one more all-to-all). Raises ``ValueError`` when a cycle has no spare dim.

    >>> plan_moves((2, 3), (3, 4), spare=(0, 1))
    [(1, 3, 4), (0, 2, 3)]
    >>> plan_moves((2, 3), (3, 2), spare=(1,))
    [(0, 2, 1), (1, 3, 2), (0, 1, 3)]
    """
    cur, out = list(current), []
    while cur != list(target):
        ready = [i for i in range(len(cur)) if cur[i] != target[i] and target[i] not in cur]
        if ready:
            i = ready[0]
            out.append((i, cur[i], target[i]))
            cur[i] = target[i]
            continue
        free = [d for d in spare if d not in cur and d not in target]
        if not free:
            raise ValueError(
                f"repartition from {tuple(current)} to {tuple(target)} swaps sharded dims and the tensor has no "
                "other dim to pass one through"
            )
        i = next(i for i in range(len(cur)) if cur[i] != target[i])
        out.append((i, cur[i], free[0]))
        cur[i] = free[0]
    return out


def grid_sizes(table, mesh: DeviceMesh, what: str) -> List[List[int]]:
    """Per mesh dim ``i``, the lengths of its sharded dim held along mesh dim ``i`` by the ranks of
    this rank's group, from an exchanged table of rows ``[len along mesh dim 0, len along mesh dim 1]``
    (:func:`~tplayers.comm.agree.exchange_agreed`). ``ValueError`` (the same on every rank) unless the
    shards form a grid (the rows of mesh row ``c0`` agree on their length along mesh dim 0, and so on)."""
    if mesh.ndim == 1:
        return [[line[0][0] for line in table]]
    for c0, line in enumerate(table):
        for c1, row in enumerate(line):
            if row[0] != line[0][0] or row[1] != table[0][c1][1]:
                raise ValueError(
                    f"{what}: the shards do not form a grid: mesh position ({c0}, {c1}) holds {tuple(row)} "
                    f"where its mesh row holds {line[0][0]} and its mesh column {table[0][c1][1]}"
                )
    me0, me1 = mesh.get_local_rank(0), mesh.get_local_rank(1)
    return [[line[me1][0] for line in table], [r[1] for r in table[me0]]]


def mesh_tensor_dims(value, mesh_ndim: int, ndim: int, label: str) -> Tuple[int, ...]:
    """``value`` (an int, or one tensor dim per mesh dim) as distinct non-negative dims of an ``ndim``-D
    tensor; ``label`` names the argument in the errors (``"repartition: from_dims"``)."""
    dims = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(dims, (tuple, list)) or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise TypeError(f"{label} must be an int or a tuple of ints, got {value!r}")
    if len(dims) != mesh_ndim:
        raise ValueError(f"{label} needs one tensor dim per mesh dim ({mesh_ndim}), got {value!r}")
    if any(not -ndim <= d < ndim for d in dims):
        raise ValueError(f"{label} must name dims of a {ndim}-D tensor, got {value!r}")
    out = tuple(d % ndim for d in dims)
    if len(set(out)) != len(out):
        raise ValueError(f"{label} must name distinct dims, got {value!r}")
    return out


def _dims(value, ndim_mesh: int, ndim: int, name: str) -> Tuple[int, ...]:
    return mesh_tensor_dims(value, ndim_mesh, ndim, f"repartition: {name}")


def repartition(x: torch.Tensor, mesh: Optional[DeviceMesh], from_dims: Dims, to_dims: Dims) -> torch.Tensor:
    """This rank's slice of the same global tensor, sharded along ``to_dims`` instead of ``from_dims``.

    forward: one all-to-all per mesh dim whose sharded dim changes / backward: the reverse
    repartition of the gradient (the same all-to-alls, reversed).

    ``x`` is this rank's slice along ``from_dims`` (one tensor dim per mesh dim; any partition,
    uneven or empty shards included). The result holds the :func:`tplayers.shard_sizes` slice of
    each ``to_dims[i]`` over mesh dim ``i`` and the whole of the dims that were sharded before; a
    mesh dim whose dim does not change keeps its partition (and moves nothing).
    A swap (``(2, 3)`` -> ``(3, 2)`` on a 2-D mesh) passes one dim through a third and costs one more
    all-to-all. One small exchange first compares every rank's arguments and local sizes.

    Args:
        x: this rank's slice.
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).
        from_dims: the tensor dim sharded over each mesh dim now (an int for a 1-D mesh).
        to_dims: the tensor dim to shard over each mesh dim.

    Returns:
        This rank's slice along ``to_dims``.

    Raises:
        TypeError: ``x`` is not a tensor, or the dims are not ints / tuples of ints.
        ValueError: on every rank, when the dims do not name distinct dims (one per mesh dim), when
            ranks disagree on the arguments, dtype or unsharded sizes, or when (2-D mesh) the shards
            do not form a grid.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        full = torch.randn(1, 4, 6, 5, dtype=torch.float64)
        c = tplayers.repartition(tplayers.shard(full, 3, mesh), mesh, 3, 1)   # W-sharded -> channel-sharded
        torch.testing.assert_close(c, tplayers.shard(full, 1, mesh))
    """
    mesh = resolve_mesh(mesh, (1, 2))
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    error, src, dst, ndim = None, (), (), -1
    try:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"repartition: x must be a torch.Tensor, got {type(x).__name__}")
        ndim = x.dim()
        src = _dims(from_dims, mesh.ndim, ndim, "from_dims")
        dst = _dims(to_dims, mesh.ndim, ndim, "to_dims")
        plan_moves(src, dst, spare=sorted(range(ndim), key=lambda d: -x.size(d)))
    except (TypeError, ValueError) as e:
        error = e
    row = [int(x.size(d)) for d in src] if error is None else [0] * mesh.ndim
    row += [0] * (2 - len(row))
    rest = tuple(-1 if d in src else int(s) for d, s in enumerate(x.shape)) if error is None else ()
    config = {"from_dims": src, "to_dims": dst, "dtype": str(getattr(x, "dtype", None)), "other dims": rest}
    table = exchange_agreed(row, config, groups, "tplayers.repartition", "repartition.layout", error=error)
    sizes = grid_sizes(table, mesh, "tplayers.repartition")
    return repartition_sized(x, mesh, src, dst, sizes)


def repartition_sized(
    x: torch.Tensor,
    mesh: DeviceMesh,
    from_dims: Sequence[int],
    to_dims: Sequence[int],
    sizes: Sequence[Sequence[int]],
    to_sizes: Optional[Dict[Tuple[int, int], Sequence[int]]] = None,
) -> torch.Tensor:
    """:func:`repartition` with the partition known (no exchange): ``sizes[i]`` are the lengths of
    ``from_dims[i]`` held along mesh dim ``i`` by this rank's group. ``to_sizes[(i, d)]``: the lengths
    to give tensor dim ``d`` over mesh dim ``i`` (default :func:`tplayers.shard_sizes`). Arguments are
    trusted (agreed by the caller)."""
    cur = list(from_dims)
    sizes = [list(s) for s in sizes]
    spare = sorted(range(x.dim()), key=lambda d: -x.size(d))
    for i, a, b in plan_moves(cur, to_dims, spare):
        group = mesh.get_group(i)
        if group.size() == 1:
            sizes[i] = [x.size(b)]
            continue
        new = (to_sizes or {}).get((i, b)) or shard_sizes(x.size(b), group.size())
        x = AllToAllDim.apply(x, a, b, sizes[i], list(new), group)
        sizes[i] = list(new)
    return x
