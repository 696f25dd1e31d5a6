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
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from tplayers.comm.accounting import record_collective
from tplayers.comm.agree import exchange_agreed
from tplayers.comm.collectives import gather_along_dim, run_p2p, split_along_dim
from tplayers.domain.tensor import plain
from tplayers.mesh import resolve_mesh
from tplayers.sharding import shard_range

__all__ = ["shard", "scatter", "gather", "resolve_domain", "reset_layouts"]

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

    Args:
        x: the full tensor, the same on every rank.
        dim: the sharded tensor dim (1-D mesh), or one dim per mesh dim (``(2, 3)``, 2-D mesh).
        mesh: the mesh (``None``: :func:`tplayers.default_mesh`).

    Returns:
        This rank's slice: ``x.narrow(d, *shard_range)`` along each ``dim``, laid out densely in ``x``'s
        memory format (a copy where the slice is a strided view: model code may call ``.view`` on it).

    Raises:
        TypeError: ``dim`` is not an int or a tuple of ints.
        ValueError: ``dim`` names no dim of ``x``, repeats one, or does not match the mesh's dims.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        full = torch.arange(30.).reshape(1, 1, 10, 3)
        mine = tplayers.shard(full, 2, mesh)                  # rows [start, stop) of H
        start, stop = tplayers.shard_range(10, mesh.size(), mesh.get_local_rank())
        torch.testing.assert_close(mine, full[:, :, start:stop])
    """
    mesh, dims = resolve_domain(x.dim(), dim, mesh)
    for i, d in enumerate(dims):
        x = split_along_dim(x, d, mesh.get_group(i))
    if not _dense(x):  # a slice of H or W is a strided view: model code may .view() its input
        x = x.clone(memory_format=torch.preserve_format)
    return x


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x`` is laid out contiguously (or channels-last, for a 4-D / 5-D tensor)."""
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return x.is_contiguous() or (cl is not None and x.is_contiguous(memory_format=cl))


def gather(x_local: torch.Tensor, dim: Dims, mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
    """The global tensor from every rank's slice (any uneven sizes; exchanged once per call).

    forward: all-gather along ``dim`` (each mesh dim in turn) / backward: keep
    this rank's slice of the gradient.

    The local sizes travel in one small exchange that also compares ``dim``,
    dtype and the other dims across ranks: ranks that disagree get a
    ``ValueError`` on every rank naming the field and the ranks, instead of a
    backend abort or a hang.

    Args:
        x_local: this rank's slice (any size along ``dim``, empty included).
        dim: the sharded tensor dim, or one per mesh dim.
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).

    Returns:
        The full tensor, the same on every rank.

    Raises:
        TypeError: ``x_local`` is not a tensor, or ``dim`` not an int / tuple of ints.
        ValueError: on every rank, when any rank's ``dim``, dtype, dim count or unsharded sizes
            differ, or (2-D mesh) the slices do not form a grid.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.distributed as dist, tplayers
        mesh = tplayers.init_mesh()
        rank = dist.get_rank()
        x_local = torch.full((2, rank + 1), float(rank))      # uneven: 1 column, 2 columns, ...
        full = tplayers.gather(x_local, 1, mesh)
        expected = torch.cat([torch.full((2, r + 1), float(r)) for r in range(mesh.size())], 1)
        torch.testing.assert_close(full, expected)
    """
    mesh = resolve_mesh(mesh, (1, 2))
    x_local = plain(x_local)  # a DomainTensor is this rank's slice (tplayers.domain.tensor)
    error, dims, ndim = None, (), -1
    try:
        if not isinstance(x_local, torch.Tensor):
            raise TypeError(f"gather: x_local must be a torch.Tensor, got {type(x_local).__name__}")
        ndim = x_local.dim()
        _, dims = resolve_domain(ndim, dim, mesh)
    except (TypeError, ValueError) as e:
        error = e
    sizes = [int(x_local.size(d)) for d in dims] if error is None else [0] * mesh.ndim
    rest = tuple(-1 if i in dims else int(s) for i, s in enumerate(x_local.shape)) if error is None else ()
    config = {"dim": dims, "dtype": str(getattr(x_local, "dtype", None)), "ndim": ndim, "other dims": rest}
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    table = exchange_agreed(sizes, config, groups, "tplayers.gather", "gather.layout", error=error)
    me = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    if len(dims) == 2:
        # Along W (mesh dim 1) within my mesh row, then along H (mesh dim 0) within my column.
        for c0, line in enumerate(table):
            if len({r[0] for r in line}) != 1 or sum(r[1] for r in line) != sum(r[1] for r in table[0]):
                raise ValueError(
                    f"tplayers.gather: the shards do not form a grid: mesh row {c0} holds "
                    f"{[tuple(r) for r in line]} rows along dims {dims}"
                )
        x_local = gather_along_dim(x_local, dims[1], groups[1], [r[1] for r in table[me[0]]])
        return gather_along_dim(x_local, dims[0], groups[0], [line[0][0] for line in table])
    return gather_along_dim(x_local, dims[0], groups[0], [line[0][0] for line in table])


def _blocks(shape: Sequence[int], dims: Sequence[int], mesh: DeviceMesh):
    """``[(global rank, [(dim, start, length), ...]), ...]`` for every mesh position."""
    out = []
    ranks = mesh.mesh.reshape(-1).tolist()
    coords = torch.stack(torch.meshgrid(*[torch.arange(s) for s in mesh.shape], indexing="ij"), -1).reshape(
        -1, mesh.ndim
    )
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
    @once_differentiable
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


_SCATTER_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_NDIM = 16


def scatter(x: Optional[torch.Tensor], dim: Dims, mesh: Optional[DeviceMesh] = None, src: int = 0) -> torch.Tensor:
    """This rank's balanced slice of ``x``, which only mesh rank ``src`` holds.

    ``src`` is a position in the flattened mesh (``0`` = first rank). Other ranks
    pass ``None`` (or any tensor; it is ignored). One small exchange over the
    mesh carries ``src``'s shape, dtype and whether the result needs a gradient
    (plain integers, no pickle) and compares ``dim`` and ``src`` across ranks:
    ranks that disagree get a ``ValueError`` on every rank naming the field.
    Backward sends the gradient slices back to ``src``.

    Args:
        x: the full tensor on rank ``src``; ignored elsewhere (pass ``None``).
        dim: the sharded tensor dim, or one per mesh dim.
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).
        src: the holder's position in the flattened mesh.

    Returns:
        This rank's balanced slice (the one :func:`shard` would take), a new tensor.

    Raises:
        TypeError: rank ``src`` passed no tensor.
        ValueError: on every rank: a bad ``src`` or ``dim``, an unsupported dtype, or ranks
            calling with different ``dim`` / ``src``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.distributed as dist, tplayers
        mesh = tplayers.init_mesh()
        full = torch.arange(40.).reshape(1, 1, 8, 5)
        x = full if dist.get_rank() == 0 else None            # only rank 0 has the data
        mine = tplayers.scatter(x, 2, mesh, src=0)
        torch.testing.assert_close(mine, tplayers.shard(full, 2, mesh))
    """
    mesh = resolve_mesh(mesh, (1, 2))
    ranks = mesh.mesh.reshape(-1).tolist()
    me = dist.get_rank()
    error, meta = None, [0] * (3 + _MAX_NDIM)
    try:
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < len(ranks):
            raise ValueError(f"scatter: src must be a mesh position in [0, {len(ranks)}), got {src!r}")
        if me == ranks[src]:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"scatter: the src rank must pass a tensor, got {type(x).__name__}")
            if x.dtype not in _SCATTER_DTYPES or x.dim() > _MAX_NDIM:
                raise ValueError(
                    f"scatter: x must have one of the dtypes {_SCATTER_DTYPES} and at most "
                    f"{_MAX_NDIM} dims, got {x.dtype} with {x.dim()} dims"
                )
            resolve_domain(x.dim(), dim, mesh)
            shape = list(x.shape) + [0] * (_MAX_NDIM - x.dim())
            meta = [x.dim(), _SCATTER_DTYPES.index(x.dtype), int(x.requires_grad)] + shape
    except (TypeError, ValueError) as e:
        error = e
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    config = {
        "dim": dim if isinstance(dim, int) else tuple(dim) if isinstance(dim, (tuple, list)) else repr(dim),
        "src": src,
    }
    table = exchange_agreed(meta, config, groups, "tplayers.scatter", "scatter.layout", error=error)
    ndim, dtype_code, needs_grad, *shape = [r for line in table for r in line][src]
    shape, dtype = tuple(shape[:ndim]), _SCATTER_DTYPES[dtype_code]
    _, dims = resolve_domain(ndim, dim, mesh)
    src_rank = int(ranks[src])
    if me == src_rank:
        dummy = x.new_empty(0)
    else:
        x = torch.empty(0, dtype=dtype, device=_device(mesh))
        dummy = torch.empty(0, dtype=dtype, device=x.device, requires_grad=bool(needs_grad))
    return ScatterDomain.apply(x, dummy, shape, dims, mesh, src_rank)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reset_layouts(module: torch.nn.Module) -> int:
    """Forget every cached domain layout in ``module`` (itself and all submodules); returns how many
    layers were reset. Call it on **every** rank. Rarely needed now: a partition that changes on
    some ranks only (H 9 -> 10 on 2 ranks is 5+4 -> 5+5 rows, rank 0 keeps 5) is noticed by the
    per-call agreement of a ``DomainParallel`` region, which resets its layers on every rank, and
    by layers called outside one, which agree on their partition every call
    (:mod:`tplayers.layers._domain`). Still needed for layers compiled with ``torch.compile``,
    which read the layouts primed while tracing and agree on nothing per call.

    Args:
        module: a model or layer; every submodule with a ``reset_layout()`` is reset.

    Returns:
        How many layers were reset.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        conv = tplayers.DistributedConv2d(2, 2, 3, padding=1, mesh=mesh)
        for h in (9, 10):                       # the global height changes between batches
            assert tplayers.reset_layouts(conv) == 1          # on every rank
            y = conv(tplayers.shard(torch.randn(1, 2, h, 5), 2, mesh))
            assert tplayers.gather(y, 2, mesh).shape == (1, 2, h, 5)
    """
    count = 0
    for m in module.modules():
        reset = getattr(m, "reset_layout", None)
        if callable(reset):
            reset()
            count += 1
    return count
