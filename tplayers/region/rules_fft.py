"""Region-guard routes for ``torch.fft``: transforms over sharded dims go to :mod:`tplayers.functional.fft`.

``torch.fft.fft`` / ``ifft`` / ``rfft`` / ``irfft``, their ``2`` and ``n`` forms, and ``fftshift`` /
``ifftshift`` on a tensor whose sharded dims are plain (one sharded dim per mesh dim) run as the
distributed transform. Where the result is sharded:

* **forward transforms and shifts** on a 1-D mesh leave the sharding where the decomposition put it
  (``out_shard_dims="leave"``): the spectrum of an H-sharded image is sharded along the modes of W,
  one all-to-all instead of two, and a shift along H of it is then local. A sharding parked on a
  batch or channel dim goes back (a contraction over channels follows in a spectral convolution).
  On a 2-D mesh the result is sharded like the input.
* **inverse transforms** go back where the tensor their signal sizes were read from was sharded
  (``s=x.shape[-2:]`` is :class:`~tplayers.region.lengths.ShardLen`), with that tensor's partition,
  so the result meets it again (``irfft2(...) + skip(x)``); without such sizes, like the input.

Operands that meet sharded along different dims are moved to one layout by the pointwise rule
(:mod:`tplayers.region.realign`), so a spectrum brought back to the grid by hand is exact too.

Signal sizes (``s=``, ``n=``) are global, as in the serial model. Sizes read from shapes carry their
serial value; a plain int equal to a local length the code read is read by :mod:`tplayers.region.sizes`
along sharded dims, and refused on every rank along dims that are whole here (it may have come from
a dim that was sharded in the grid). Every other ``torch.fft`` function on sharded data (``hfft``,
``ihfft``, ...) is refused (no rule).
"""

from __future__ import annotations

import torch

from tplayers.comm.collectives import exchange_grid_table
from tplayers.domain.layout import region_layout
from tplayers.functional import fft as dfft
from tplayers.region.lengths import ShardLen, serial
from tplayers.region.rules_ops import _bind, _simple
from tplayers.region.sizes import _derived, global_sizes

__all__ = ["TABLE"]

_ONE_DIM = ("fft", "ifft", "rfft", "irfft")
_NAMES = _ONE_DIM + ("fft2", "ifft2", "rfft2", "irfft2", "fftn", "ifftn", "rfftn", "irfftn")


def _sizes(g, x, shard_dims, dims, sizes, what):
    """``sizes`` (one per transformed dim) read as global along the sharded dims (see the module docstring);
    a length the code read (:class:`~tplayers.region.lengths.ShardLen`) is its serial value."""
    traced = [isinstance(n, ShardLen) for n in sizes]
    sizes = tuple(serial(n) for n in sizes)
    if any(traced):  # read from a tensor's shape (s=x.shape[-2:]): its plain entries are its whole dims, global
        return sizes
    _whole_dims_not_read(g, [n for d, n, t in zip(dims, sizes, traced) if d not in shard_dims and not t], what)
    sharded = [d for d, t in zip(dims, traced) if d in shard_dims and not t]
    if not sharded:
        return sizes
    if min(shard_dims) < 2:
        raise g.error(f"{what} with signal sizes and a sharded batch or channel dim", g.layout(x))
    spatial = [None] * (x.dim() - 2)
    for d, n, t in zip(dims, sizes, traced):
        if d in shard_dims and not t:
            spatial[d - 2] = n
    found = global_sizes(g, x, shard_dims, tuple(spatial), what)
    return tuple(found[d - 2] if d in sharded else n for d, n in zip(dims, sizes))


def _whole_dims_not_read(g, sizes, what) -> None:
    """Plain signal sizes along dims that are whole here but may have been sharded in the grid they came
    from (a spectrum left sharded along another dim): a size that is a local length the code read, or a
    multiple or fraction of one, on every rank (``s=[int(v) for v in x.shape[-2:]]``) cannot be told from
    a global one: ``ValueError`` on every rank (one small all-gather, only when a length was read)."""
    if not sizes or not any(g.reads.values()):
        return
    hit = int(all(any(_derived(n, r) for rs in g.reads.values() for r in rs) for n in sizes))
    table = exchange_grid_table([hit] + list(sizes), g.groups, "region.fft_sizes")
    rows = [r for line in table for r in line]
    if all(r[0] for r in rows) or any(r[1:] != rows[0][1:] for r in rows):
        raise g.error(
            f"{what}: signal sizes {tuple(sizes)} along dims that are whole here are local lengths this region's "
            "code read (or differ between ranks), and cannot be told apart from global sizes",
            advice="Pass the sizes the code read unchanged (s=x.shape[-2:] carries the serial lengths), or global ints.",
        )


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
    out_dims, out_sizes = dfft.LEAVE, None
    if sizes is not None:
        default = -1 if one else ((-2, -1) if name.endswith("2") else None)
        dim = a.get("dim", default)
        seq = (sizes,) if one else tuple(sizes)
        if dim is None:
            dims = tuple(range(x.dim() - len(seq), x.dim()))
        else:
            dims = tuple(d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim))
        if len(dims) == len(seq):  # else the functional form raises its own error, on every rank
            if name.startswith("i"):  # an inverse: back where the tensor its sizes were read from was sharded
                out_dims, out_sizes = _read_from(seq, dims, shard_dims)
            seq = _sizes(g, x, shard_dims, dims, seq, what)
            a[size_key] = seq[0] if one else seq
    elif name.startswith("i"):
        out_dims = None  # no sizes to say where: like the input
    out, dst = dfft.transform_landed(
        x,
        _KIND[name],
        a.get(size_key) if not one or a.get(size_key) is None else (a[size_key],),
        _dim_arg(one, name, a),
        a.get("norm"),
        g.mesh,
        shard_dims,
        out_dims,
        name,
        out_sizes,
    )
    return g.mark(out, region_layout(out.shape, dst))


def _read_from(seq, dims, shard_dims):
    """Where an inverse transform's result goes: each mesh dim to the transformed dim whose signal size is
    a length read from a dim sharded over it (``s=x.shape[-2:]``), with that tensor's partition; the other
    mesh dims stay where the input has them (``None`` when no size was read)."""
    out, sizes = list(shard_dims), {}
    for d, n in zip(dims, seq):
        if (
            isinstance(n, ShardLen)
            and len(n.roots) == 1
            and not getattr(n.roots[0], "folded", False)
            and n.fn(n.roots[0].local) == int(n)
        ):
            root = n.roots[0]
            if serial(n) == root.total() and d not in [o for j, o in enumerate(out) if j != root.axis]:
                out[root.axis] = d
                sizes[root.axis] = root.sizes()
    if not sizes:
        return None, None
    return tuple(out), sizes


_KIND = {}
for _n in _NAMES:
    _KIND[_n] = "c2r" if "irfft" in _n else "r2c" if "rfft" in _n else "ic2c" if _n.startswith("i") else "c2c"


def _dim_arg(one, name, a):
    if one:
        return (a.get("dim", -1),)
    return a.get("dim", (-2, -1) if name.endswith("2") else None)


def _shift(g, func, args, kwargs):
    g.acted = True
    name = func.__name__[len("fft_") :]
    a = _bind(args, kwargs, ("input", "dim"), {"dim": None})
    x = a["input"]
    lay = g.layout(x)
    shard_dims = _simple(g, lay, f"torch.fft.{name}")
    fn = torch.fft.fftshift if name == "fftshift" else torch.fft.ifftshift
    out, dst = dfft.shift_landed(fn, name, x, a["dim"], g.mesh, shard_dims, dfft.LEAVE)
    return g.mark(out, region_layout(out.shape, dst))  # a permutation of the rows, sharded where it moved


TABLE = {f"fft_{n}": _fft for n in _NAMES}
TABLE.update({"fft_fftshift": _shift, "fft_ifftshift": _shift})
