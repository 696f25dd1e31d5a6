"""Domain (spatial) tensors: take, scatter and gather slices of a global tensor.

A domain-parallel activation is a plain local tensor: this rank's slice of
the global tensor along the sharded dim(s). ``dim`` is one tensor dim for a
1-D mesh, or a tuple with one tensor dim per mesh dim (``(2, 3)`` on a 2-D
mesh shards H over mesh dim 0 and W over mesh dim 1). Slices follow
:func:`tplayers.shard_sizes`; :func:`gather` also accepts arbitrary uneven
local sizes (it exchanges them).

Example (``torchrun --nproc-per-node 2 example.py`` or plain ``python``)::

    import torch, tplayers
    mesh = tplayers.init_mesh()
    torch.manual_seed(0)
    full = torch.randn(2, 3, 10, 8)                 # same on every rank
    mine = tplayers.shard(full, 2, mesh)            # (2, 3, 5, 8) on each of 2 ranks
    assert torch.equal(tplayers.gather(mine, 2, mesh), full)
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.accounting import record_collective
from tplayers.comm.collectives import gather_along_dim, run_p2p, split_along_dim
from tplayers.mesh import resolve_mesh
from tplayers.sharding import shard_range

__all__ = ["shard", "scatter", "gather", "resolve_domain"]

Dims = Union[int, Sequence[int]]


def resolve_domain(x_dim: int, dim: Dims, mesh: Optional[DeviceMesh]) -> Tuple[DeviceMesh, Tuple[int, ...]]:
    """The mesh (``None`` -> default) and the sharded tensor dims, normalised and checked.

    One tensor dim per mesh dim: an int needs a 1-D mesh, a pair a 2-D mesh.
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise TypeError(f"dim must be an int or a tuple of ints, got {dim!r}")
    mesh = resolve_mesh(mesh, len(dims))
    norm = tuple(d % x_dim for d in dims) if x_dim else dims
    if any(not -x_dim <= d < x_dim for d in dims) or len(set(norm)) != len(norm):
        raise ValueError(f"dim must name distinct dims of a {x_dim}-D tensor, got {dim!r}")
    return mesh, norm


def shard(x: torch.Tensor, dim: Dims, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """This rank's balanced slice of the full tensor ``x`` (identical on every rank).

    forward: narrow (no communication) / backward: all-gather of the gradient
    slices, so a replicated ``x`` gets the full gradient on every rank.
    """
    mesh, dims = resolve_domain(x.dim(), dim, mesh)
    for i, d in enumerate(dims):
        x = split_along_dim(x, d, mesh.get_group(i))
    return x


def gather(x_local: torch.Tensor, dim: Dims, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """The global tensor from every rank's slice (any uneven sizes; exchanged once per call).

    forward: all-gather along ``dim`` (each mesh dim in turn) / backward: keep
    this rank's slice of the gradient.
    """
    mesh, dims = resolve_domain(x_local.dim(), dim, mesh)
    for i in reversed(range(len(dims))):
        x_local = gather_along_dim(x_local, dims[i], mesh.get_group(i))
    return x_local


def _blocks(shape: Sequence[int], dims: Sequence[int], mesh: DeviceMesh):
    """``[(global rank, [(dim, start, length), ...]), ...]`` for every mesh position."""
    out = []
    ranks = mesh.mesh.reshape(-1).tolist()
    coords = torch.stack(torch.meshgrid(*[torch.arange(s) for s in mesh.shape], indexing="ij"), -1).reshape(-1, mesh.ndim)
    for r, c in zip(ranks, coords.tolist()):
        cuts = []
        for i, d in enumerate(dims):
            a, b = shard_range(shape[d], mesh.size(i), c[i])
            cuts.append((d, a, b - a))
        out.append((int(r), cuts))
    return out


def _cut(x: torch.Tensor, cuts) -> torch.Tensor:
    for d, a, n in cuts:
        x = x.narrow(d, a, n)
    return x


class ScatterDomain(torch.autograd.Function):
    """forward: rank ``src`` sends each rank its balanced slice (point-to-point) /
    backward: every rank sends its gradient slice back to ``src``, which assembles the full gradient."""

    @staticmethod
    def forward(ctx, x, dummy, shape, dims, mesh, src_rank):
        me = dist.get_rank()
        blocks = _blocks(shape, dims, mesh)
        ctx.info = (shape, dims, mesh, src_rank, x.dtype, x.device)
        mine = dict(blocks)[me]
        if me == src_rank:
            ops, sends = [], []
            for r, cuts in blocks:
                if r != me:
                    buf = _cut(x, cuts).contiguous()
                    sends.append(buf)  # kept alive until every send completed
                    record_collective("send", buf.numel() * buf.element_size(), mesh.size(), "scatter.fwd")
                    ops.append(dist.P2POp(dist.isend, buf, r))
            run_p2p(ops)
            return _cut(x, mine).clone()
        local_shape = list(shape)
        for d, _, n in mine:
            local_shape[d] = n
        out = torch.empty(local_shape, dtype=x.dtype, device=x.device)
        run_p2p([dist.P2POp(dist.irecv, out, src_rank)])
        return out

    @staticmethod
    def backward(ctx, grad):
        shape, dims, mesh, src_rank, dtype, device = ctx.info
        me = dist.get_rank()
        blocks = _blocks(shape, dims, mesh)
        if me != src_rank:
            g = grad.contiguous()
            record_collective("send", g.numel() * g.element_size(), mesh.size(), "scatter.bwd")
            run_p2p([dist.P2POp(dist.isend, g, src_rank)])
            return None, None, None, None, None, None
        full = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        ops, recvs = [], []
        for r, cuts in blocks:
            if r == me:
                _cut(full, cuts).copy_(grad)
                continue
            buf = torch.empty_like(_cut(full, cuts), memory_format=torch.contiguous_format)
            recvs.append((buf, cuts))
            ops.append(dist.P2POp(dist.irecv, buf, r))
        run_p2p(ops)
        for buf, cuts in recvs:
            _cut(full, cuts).copy_(buf)
        return full, None, None, None, None, None


def scatter(x: Optional[torch.Tensor], dim: Dims, mesh: Optional[DeviceMesh] = None, src: int = 0) -> torch.Tensor:
    """This rank's balanced slice of ``x``, which only mesh rank ``src`` holds.

    ``src`` is a position in the flattened mesh (``0`` = first rank). Other ranks
    pass ``None`` (or any tensor; it is ignored): shape, dtype and whether the
    result needs a gradient travel from ``src`` once (one small broadcast).
    Backward sends the gradient slices back to ``src``.
    """
    mesh_ndim = 1 if isinstance(dim, int) else len(tuple(dim))
    mesh = resolve_mesh(mesh, mesh_ndim)
    ranks = mesh.mesh.reshape(-1).tolist()
    if not 0 <= src < len(ranks):
        raise ValueError(f"src must be a mesh position in [0, {len(ranks)}), got {src}")
    src_rank = int(ranks[src])
    me = dist.get_rank()
    meta = [None]
    if me == src_rank:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"scatter: the src rank must pass a tensor, got {type(x).__name__}")
        meta = [(tuple(x.shape), x.dtype, x.requires_grad)]
    if me == src_rank:  # metadata point-to-point, so any sub-mesh works without a new group
        for r in ranks:
            if r != me:
                dist.send_object_list(meta, dst=r, device=_device(mesh))
    else:
        dist.recv_object_list(meta, src=src_rank, device=_device(mesh))
    shape, dtype, needs_grad = meta[0]
    _, dims = resolve_domain(len(shape), dim, mesh)
    if me == src_rank:
        dummy = x.new_empty(0)
    else:
        x = torch.empty(0, dtype=dtype, device=_device(mesh))
        dummy = torch.empty(0, dtype=dtype, device=x.device, requires_grad=needs_grad)
    return ScatterDomain.apply(x, dummy, shape, dims, mesh, src_rank)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
