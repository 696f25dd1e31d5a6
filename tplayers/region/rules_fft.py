"""Region-guard routes for ``torch.fft``: transforms over sharded dims go to :mod:`tplayers.functional.fft`.

``torch.fft.fft`` / ``ifft`` / ``rfft`` / ``irfft``, their ``2`` and ``n`` forms, on a tensor whose
sharded dims are plain (one sharded dim per mesh dim) run as the distributed transform, and the
result is tagged sharded like the input (the same tensor dims over the same mesh dims: the
spectrum of an H-sharded image is H-sharded, ``irfft2`` of it H-sharded again), so the layout the
guard follows keeps its shape across the transform; a sharded dim whose length changes (the
``W // 2 + 1`` modes of an ``rfft`` along a sharded W) is cut by :func:`tplayers.shard_sizes`.
``fftshift`` / ``ifftshift`` are routed too (the sharding moves aside for the shift and returns).

Signal sizes (``s=``, ``n=``) are global, as in the serial model; one derived from a sharded
tensor's local shape (``s=x.shape[-2:]``) is recognised as the ranks' shares where it can be told
apart, and refused on every rank where it cannot (:mod:`tplayers.region.sizes`). Every other
``torch.fft`` function on sharded data (``hfft``, ``ihfft``, ...) is refused (no rule).
"""

from __future__ import annotations

from tplayers.domain.layout import region_layout
from tplayers.functional import fft as dfft
from tplayers.region.rules_ops import _bind, _simple
from tplayers.region.sizes import global_sizes

__all__ = ["TABLE"]

_ONE_DIM = ("fft", "ifft", "rfft", "irfft")
_NAMES = _ONE_DIM + ("fft2", "ifft2", "rfft2", "irfft2", "fftn", "ifftn", "rfftn", "irfftn")


def _sizes(g, x, shard_dims, dims, sizes, what):
    """``sizes`` (one per transformed dim) read as global along the sharded dims (see the module docstring)."""
    sharded = [d for d in dims if d in shard_dims]
    if not sharded:
        return sizes
    if min(shard_dims) < 2:
        raise g.error(f"{what} with signal sizes and a sharded batch or channel dim", g.layout(x))
    spatial = [None] * (x.dim() - 2)
    for d, n in zip(dims, sizes):
        if d in shard_dims:
            spatial[d - 2] = n
    found = global_sizes(g, x, shard_dims, tuple(spatial), what)
    return tuple(found[d - 2] if d in shard_dims else n for d, n in zip(dims, sizes))


def _fft(g, func, args, kwargs):
    g.acted = True
    name = func.__name__[len("fft_") :]
    what = f"torch.fft.{name}"
    one = name in _ONE_DIM
    a = _bind(args, kwargs, ("input", "n" if one else "s", "dim", "norm", "out"), {"norm": None, "out": None})
    x = a.pop("input")
    lay = g.layout(x)
    if lay is None or a.pop("out") is not None:
        raise g.error(f"{what} with out= or a sharded out= on replicated input", lay)
    shard_dims = _simple(g, lay, what)
    size_key = "n" if one else "s"
    sizes = a.get(size_key)
    if sizes is not None:
        default = -1 if one else ((-2, -1) if name.endswith("2") else None)
        dim = a.get("dim", default)
        seq = (sizes,) if one else tuple(sizes)
        if dim is None:
            dims = tuple(range(x.dim() - len(seq), x.dim()))
        else:
            dims = tuple(d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim))
        if len(dims) == len(seq):  # else the functional form raises its own error, on every rank
            seq = _sizes(g, x, shard_dims, dims, seq, what)
            a[size_key] = seq[0] if one else seq
    out = getattr(dfft, name)(x, **a, mesh=g.mesh, shard_dims=shard_dims)
    return g.mark(out, region_layout(out.shape, shard_dims))


def _shift(g, func, args, kwargs):
    g.acted = True
    name = func.__name__[len("fft_") :]
    a = _bind(args, kwargs, ("input", "dim"), {"dim": None})
    x = a["input"]
    lay = g.layout(x)
    shard_dims = _simple(g, lay, f"torch.fft.{name}")
    out = getattr(dfft, name)(x, a["dim"], mesh=g.mesh, shard_dims=shard_dims)
    return g.mark(out, lay)  # a permutation of the rows: the same partition


TABLE = {f"fft_{n}": _fft for n in _NAMES}
TABLE.update({"fft_fftshift": _shift, "fft_ifftshift": _shift})
