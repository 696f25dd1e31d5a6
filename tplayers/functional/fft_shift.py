"""``fftshift`` / ``ifftshift`` over domain-sharded dims: a permutation of the global rows (see
:mod:`tplayers.functional.fft`, which re-exports them)."""

from __future__ import annotations

import contextlib

import torch

from tplayers.comm.agree import exchange_agreed
from tplayers.comm.all_to_all import AllToAllDim, grid_sizes
from tplayers.domain.active import active_guard, stepped_aside
from tplayers.domain.layout import region_layout
from tplayers.functional.fft_common import LEAVE, _mesh_dims, _norm_dims
from tplayers.mesh import resolve_mesh
from tplayers.sharding import shard_sizes

__all__ = ["fftshift", "ifftshift", "shift_landed"]


def _shift(fn, name: str):
    def shift(input, dim=None, *, mesh=None, shard_dims=(2,), out_shard_dims=None):
        return shift_landed(fn, name, input, dim, mesh, shard_dims, out_shard_dims)[0]

    shift.__name__ = shift.__qualname__ = name
    shift.__doc__ = f"""``torch.fft.{name}`` over domain-sharded dims: a permutation of the global rows.

    Each mesh dim sharding a shifted dim hands its sharding to the largest dim that is neither
    shifted nor sharded (one all-to-all), the shift runs locally, and the sharding returns with the
    input's partition (one more). The result is sharded like the input.

    Args:
        input: this rank's slice, sharded along ``shard_dims`` (one tensor dim per mesh dim).
        dim: as ``torch.fft.{name}`` (``None``: every dim).
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the tensor dim sharded over each mesh dim.
        out_shard_dims: ``None`` (the input's), or ``"leave"``: where the shift moved it (no second
            all-to-all; :func:`shift_landed` says where).

    Returns:
        This rank's slice of ``torch.fft.{name}`` of the gathered input.

    Raises:
        TypeError: a non-tensor input or non-int dims.
        ValueError: on every rank, when ranks disagree on the arguments or unsharded sizes, or no
            dim is left to hold a shifted dim's sharding (``dim=None`` over a sharded tensor).
    """
    return shift


def shift_landed(fn, name, x, dim, mesh, shard_dims, out_shard_dims=None):
    """A shift and the result's sharded dims (where ``out_shard_dims="leave"`` left them)."""
    guard = active_guard()  # called by hand inside a region: run unguarded, tag the result
    with stepped_aside(guard) if guard is not None else contextlib.nullcontext():
        out, dst = _shifted(x, fn, dim, mesh, shard_dims, f"tplayers.functional.fft.{name}", out_shard_dims == LEAVE)
    if guard is not None and hasattr(guard, "mark"):
        guard.mark(out, region_layout(out.shape, dst))
    return out, dst


def _shifted(x, fn, dim, mesh, shard_dims, name, leave=False):
    mesh = resolve_mesh(mesh, (1, 2))
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    error, src, dims, moves = None, (), (), []
    try:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        src = _mesh_dims(shard_dims, mesh.ndim, x.dim(), name, "shard_dims")
        dims, _ = _norm_dims(dim, None, x.dim(), name)
        cur = list(src)
        for i, d in enumerate(src):
            if d in dims:
                free = [t for t in sorted(range(x.dim()), key=lambda t: -x.size(t)) if t not in dims and t not in cur]
                if not free:
                    raise ValueError(f"{name}: dim {dim!r} leaves no dim to hold the sharding of dim {d}")
                moves.append((i, d, free[0]))
                cur[i] = free[0]
    except (TypeError, ValueError) as e:
        error = e
    ok = error is None
    row = [int(x.size(d)) for d in src] + [0] * (2 - len(src)) if ok else [0, 0]
    rest = tuple(-1 if d in src else int(v) for d, v in enumerate(x.shape)) if ok else ()
    config = {"shard_dims": src, "dim": dims, "dtype": str(getattr(x, "dtype", None)), "other dims": rest}
    sizes = grid_sizes(exchange_agreed(row, config, groups, name, "fft.layout", error=error), mesh, name)
    moved = {}
    for i, a, b in moves:
        if groups[i].size() > 1:
            moved[i] = shard_sizes(x.size(b), groups[i].size())
            x = AllToAllDim.apply(x, a, b, sizes[i], moved[i], groups[i])
    x = fn(x, dim=dims)
    if leave and len(src) == 1 and all(b >= 2 for _, _, b in moves):  # 1-D mesh, not on a batch / channel dim
        return x, tuple(b for b in _after(src, moves))
    for i, a, b in reversed(moves):
        if groups[i].size() > 1:
            x = AllToAllDim.apply(x, b, a, moved[i], sizes[i], groups[i])
    return x, src


def _after(src, moves):
    cur = list(src)
    for i, _, b in moves:
        cur[i] = b
    return cur


fftshift = _shift(torch.fft.fftshift, "fftshift")
ifftshift = _shift(torch.fft.ifftshift, "ifftshift")
