"""Shared pieces of the distributed FFTs (:mod:`tplayers.functional.fft`, :mod:`tplayers.functional.fft_shift`):
norm modes, the ``"leave"`` sentinel, and the argument checks both use."""

from __future__ import annotations

from typing import Optional, Tuple

from tplayers.comm.all_to_all import mesh_tensor_dims

__all__ = ["LEAVE"]

_NORMS = (None, "backward", "ortho", "forward")
#: ``out_shard_dims="leave"``: the result sharded where the decomposition left it (fewer all-to-alls)
LEAVE = "leave"


def _norm_dims(dim, s, ndim: int, name: str) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
    """The transformed dims (non-negative, in order) and the signal sizes, as ``torch.fft.fftn`` reads them."""
    if s is not None:
        s = (s,) if isinstance(s, int) else tuple(s)
        if any(isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1) for v in s):
            raise ValueError(f"{name}: s must hold positive ints (or -1), got {s!r}")
    if dim is None:
        dims = tuple(range(ndim)) if s is None else tuple(range(ndim - len(s), ndim))
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if any(isinstance(d, bool) or not isinstance(d, int) for d in dims) or not dims:
        raise TypeError(f"{name}: dim must be an int or a non-empty tuple of ints, got {dim!r}")
    if any(not -ndim <= d < ndim for d in dims):
        raise ValueError(f"{name}: dim {dim!r} names a dim outside a {ndim}-D tensor")
    dims = tuple(d % ndim for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{name}: dim must name distinct dims, got {dim!r}")
    if s is not None and len(s) != len(dims):
        raise ValueError(f"{name}: s needs one size per transformed dim ({len(dims)}), got {s!r}")
    return dims, s


def _mesh_dims(value, mesh_ndim: int, ndim: int, name: str, what: str) -> Tuple[int, ...]:
    return mesh_tensor_dims(value, mesh_ndim, ndim, f"{name}: {what}")
