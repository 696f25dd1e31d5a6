"""Region-guard routes that read sizes and positions as the serial model does: global slices,
constants and grids of a serial shape, and replicated operands of a sharded dim's full length.

The model code inside a region was written for the serial tensor, so its indices and sizes are
global (the lengths it reads are :class:`~tplayers.region.lengths.ShardLen`, which remember their
serial value):

* **Slices of sharded dims** (``x[:, :, :m]``, ``x_ft[:, :, c - m: c + m]``, ``x[..., :-pad]``,
  steps too, and assignment into them): the slice is taken of the serial tensor, so each rank keeps
  the rows of the serial slice it holds, and the result stays sharded along that dim with those rows
  (an empty shard where a rank holds none). A contiguous slice no longer than the largest shard (the
  kept modes of a spectral convolution; a strided one, a patch merging's ``x[:, 0::2]``, stays
  sharded) is all-gathered instead and comes out whole on every rank: only its rows travel, the
  per-mode work on it is replicated, and code that reads its shape in Python (``opt_einsum``'s
  contraction planning in neuraloperator) sees the serial shape; its gradient is
  this rank's rows of the (replicated) gradient. An integer index picks one serial row the same way
  (gathered, its dim gone: ``x[:, :, 0]`` is the serial first row on every rank); assigning into it
  (``c[:, :, 0] = 1``) writes on the rank that holds it. ``out[idx] = v`` writes ``v``'s rows into this rank's
  rows of the serial slice: ``v`` must hold exactly them (it does when it was cut by the same
  slice), or be replicated with the serial slice's length (cut to them) or length 1. Integer and
  index-tensor indexing along sharded dims stays refused.
* **Factories with a sharded length** (``torch.zeros(n, c, x.size(-2), x.size(-1) // 2 + 1)``,
  ``ones``, ``full``, ``empty``): the rank's slice of the serial constant, sharded along each dim
  whose size is a ShardLen over that ShardLen's mesh dim, with the window core's partition (the
  tensor's own when the length is the one read, else balanced, as a distributed ``rfft`` cuts
  ``W // 2 + 1``). A size mixing two sharded dims is refused.
* **Grids** (``torch.linspace(0, 1, h + 1)``, ``arange``, ``logspace`` with a ShardLen): the serial
  grid, whole and replicated on every rank (the coordinates are global); ``view`` / ``reshape`` /
  ``expand`` / ``repeat`` of a replicated tensor read a ShardLen as its serial value too
  (``gridx.reshape(1, size_x, 1, 1)``). Where it meets sharded data it is cut to the rank's rows
  (next bullet).
* **Replicated operands with a sharded dim's full length** (a grid ``cat`` to the data, a
  per-mode weight in an ``einsum`` with a sliced spectrum, a value assigned into a slice): the
  serial op pairs row ``i`` of the operand with global row ``i`` of the sharded tensor, so each rank
  cuts the operand to its rows; its gradient is summed over the mesh dim (every rank's cut lands in
  the whole operand's gradient). A replicated operand of any other length (not 1) along a sharded
  dim is refused, as before.

Each of these asks every rank's local length along the mesh dim once per tensor dim and call (a
small all-gather).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from tplayers.comm.collectives import GatherAlongDim
from tplayers.region.lengths import ShardLen, serial
from tplayers.window_plan import out_partition

__all__ = [
    "global_index",
    "getitem",
    "fit",
    "fit_operands",
    "spans",
    "factory",
    "has_len",
    "serial_args",
    "FACTORIES",
    "SHAPED",
]

FACTORIES = frozenset(["zeros", "ones", "full", "empty", "linspace", "arange", "logspace", "range"])
#: ops that take a shape (or an index: ``table[:n, :n]``): on a replicated tensor (a grid, a table of the
#: serial model's size) a ShardLen in it is its serial value
SHAPED = frozenset(["view", "reshape", "expand", "repeat", "broadcast_to", "tile", "__getitem__"])


def _serial_item(b):
    if isinstance(b, slice):
        return slice(serial(b.start), serial(b.stop), serial(b.step))
    return serial(b)


def serial_args(args) -> list:
    """``args`` with every :class:`ShardLen` (top level, in a size list, or a slice bound) replaced by its
    serial value."""
    return [type(a)(_serial_item(b) for b in a) if isinstance(a, (list, tuple)) else _serial_item(a) for a in args]


def _is_len(b) -> bool:
    if isinstance(b, slice):
        return any(isinstance(v, ShardLen) for v in (b.start, b.stop, b.step))
    return isinstance(b, ShardLen)


def has_len(args, kwargs) -> bool:
    """Whether a factory's size arguments (or an index) hold a :class:`ShardLen` (top level, in a size list,
    or a slice bound)."""
    for a in list(args) + list(kwargs.values()):
        if _is_len(a):
            return True
        if isinstance(a, (list, tuple)) and any(_is_len(b) for b in a):
            return True
    return False


# ----------------------------------------------------------------------------- slices
def _items(x: torch.Tensor, idx) -> Optional[List[Tuple[int, object]]]:
    """``(tensor dim, item)`` for every index item that consumes a dim (``None`` dims skipped), or
    ``None`` for indices this route does not take (advanced indexing)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(i, (torch.Tensor, list)) for i in items):
        return None
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, d = [], 0
    for item in items:
        if item is Ellipsis:
            d += x.dim() - used
        elif item is None:
            continue
        else:
            out.append((d, item))
            d += 1
    return out


def _counts(sizes: Sequence[int], s: slice) -> List[Tuple[int, int]]:
    """Every rank's ``(first local row, row count)`` of serial slice ``s`` of a dim cut into ``sizes``."""
    start, stop, step = slice(serial(s.start), serial(s.stop), serial(s.step)).indices(sum(sizes))
    out, o = [], 0
    for n in sizes:
        first = start if start >= o else start + -(-(o - start) // step) * step
        last = min(stop, o + n)
        out.append((first - o, -(-(last - first) // step)) if first < last else (0, 0))
        o += n
    return out


def global_index(g, x: torch.Tensor, idx, gather: bool = True):
    """``(local index, layout, gathers, picked dims)`` of the serial ``x[idx]`` on this rank, for slices (and whole
    dims, integers, ``None``, ``...`` on whole dims) with slices along plain sharded dims; else ``None``.
    ``gathers``: ``(result dim, mesh dim, every rank's rows)`` of the slices no longer than the
    largest shard (with ``gather``): all-gathered by :func:`getitem`, so they come out whole."""
    lay = g.layout(x)
    items = _items(x, idx)
    if items is None:
        return None
    sliced, picks = {}, set()
    for d, item in items:
        entry = lay[d]
        if entry is not None and not isinstance(item, slice) and isinstance(serial(item), int):
            if len(entry) != 1 or entry[0][1] is None:
                return None
            i = serial(item)
            total = g.root(x, d).total()
            if not -total <= i < total:
                raise g.error(f"index {i} is out of bounds for sharded dim {d} of serial length {total}", lay)
            item = slice(i % total, i % total + 1)  # one row: a slice of length 1 whose dim goes away
            picks.add(d)
        if entry is None or not isinstance(item, slice):
            if entry is not None:
                return None  # an index tensor along a sharded dim
            continue
        if item.start is None and item.stop is None and item.step in (None, 1):
            continue
        if len(entry) != 1 or entry[0][1] is None:
            return None
        if serial(item.step) is not None and serial(item.step) <= 0:
            raise g.error(f"a slice with step {serial(item.step)} along a sharded dim", lay)
        root = g.root(x, d)
        sizes = root.sizes()
        counts = _counts(sizes, item)
        first, n = counts[root.group.rank()]
        step = serial(item.step) or 1
        local = slice(first, first + (n - 1) * step + 1, step) if n else slice(0, 0)
        whole = gather and step == 1 and sum(c for _, c in counts) <= max(sizes)  # strided: kept sharded
        sliced[d] = (local, n, root.axis, [c for _, c in counts], whole)
    orig = idx if isinstance(idx, tuple) else (idx,)
    used = sum(1 for i in orig if i is not None and i is not Ellipsis)
    local_idx, out_lay, gathers, d = [], [], [], 0
    for item in orig:
        if item is Ellipsis:
            local_idx.append(item)
            out_lay.extend(lay[d : d + x.dim() - used])
            d += x.dim() - used
        elif item is None:
            local_idx.append(None)
            out_lay.append(None)
        elif d in sliced:
            local, n, axis, counts, whole = sliced[d]
            local_idx.append(local)
            if whole:
                gathers.append((len(out_lay), axis, counts, d in picks))
            out_lay.append(None if whole else ((n, axis),))
            d += 1
        else:
            local_idx.append(_plain(item))
            if isinstance(item, slice):
                out_lay.append(lay[d])
            d += 1
    out_lay.extend(lay[d:])
    return tuple(local_idx), tuple(out_lay), gathers, picks


def getitem(g, x: torch.Tensor, found) -> torch.Tensor:
    """The serial ``x[idx]`` on this rank from :func:`global_index`'s answer (short slices gathered)."""
    local_idx, lay, gathers, _ = found
    out = x[local_idx]
    for dim, axis, counts, _ in gathers:
        out = GatherAlongDim.apply(out, dim, counts, g.groups[axis])
    picked = [dim for dim, _, _, pick in gathers if pick]
    if picked:
        out = out.squeeze(picked)
        lay = tuple(e for k, e in enumerate(lay) if k not in picked)
    return g.mark(out, lay)


def _plain(item):
    if isinstance(item, slice):
        return slice(*(serial(v) for v in (item.start, item.stop, item.step)))
    return serial(item)


# ----------------------------------------------------------------------------- full-length operands
def fit(g, t: torch.Tensor, d: int, ref: torch.Tensor, rd: int) -> Optional[torch.Tensor]:
    """Replicated ``t`` cut to this rank's rows of sharded dim ``rd`` of ``ref`` along its dim ``d``, when
    ``t`` has that dim's serial length there (its gradient summed over the mesh dim); else ``None``."""
    root = g.root(ref, rd)
    if root is None:
        return None
    sizes = root.sizes()
    if int(t.shape[d]) != sum(sizes):
        return None
    r = root.group.rank()
    whole = g.bound(t, (root.axis,))
    return whole.narrow(d, sum(sizes[:r]), sizes[r])


def fit_operands(g, tensors: Sequence[torch.Tensor], skip: Sequence[int] = (), keep=()) -> List[torch.Tensor]:
    """``tensors`` (broadcast right-aligned, as pointwise ops and ``cat`` pair them) with every replicated
    one that spans a sharded dim of another with its full serial length cut to the rank's rows
    (:func:`fit`) and tagged sharded there; ``skip``: dims (counted from the right, negative) left alone
    (a ``cat``'s dim); ``keep``: tensors never cut (an in-place op's target)."""
    out = list(tensors)
    for i, t in enumerate(tensors):
        if g.uniform(t) or any(t is k for k in keep):
            continue
        own = g.layout(t)
        entries = list(own) if own is not None else [None] * t.dim()
        for k in range(1, t.dim() + 1):
            if -k in skip or int(t.shape[-k]) == 1 or entries[t.dim() - k] is not None:
                continue
            for ref in tensors:
                lay = g.layout(ref)
                if lay is None or k > ref.dim() or lay[-k] is None:
                    continue
                used = {a for e in entries if e for _, a in e}
                if any(a in used for _, a in lay[-k]):
                    break  # already sharded over that mesh dim along another dim: not a whole operand
                cut = fit(g, out[i], out[i].dim() - k, ref, ref.dim() - k)
                if cut is not None:
                    out[i], entries[t.dim() - k] = cut, lay[-k]
                break
        if out[i] is not t:
            g.mark(out[i], tuple(entries))
    return out


def spans(g, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an operand (not a fresh constant) is whole, with a length other than 1, along a dim where
    another is sharded."""
    for t in tensors:
        if g.uniform(t):
            continue
        own = g.layout(t)
        for ref in tensors:
            lay = g.layout(ref)
            if (
                lay is not None
                and ref is not t
                and any(
                    lay[-k] is not None and int(t.shape[-k]) != 1 and (own is None or own[-k] is None)
                    for k in range(1, min(t.dim(), ref.dim()) + 1)
                )
            ):
                return True
    return False


# ----------------------------------------------------------------------------- factories
def _dim_of(g, s: ShardLen, what: str):
    axes = {r.axis for r in s.roots}
    if any(getattr(r, "folded", False) for r in s.roots):
        raise g.error(
            f"{what}: a size read from a dim that merges a sharded dim with others (windows folded into the "
            "batch, flattened pixels)",
            advice="Size it by a plain sharded dim's length, or make it with *_like of the tensor.",
        )
    if len(axes) != 1:
        raise g.error(f"{what}: a size that mixes lengths of different sharded dims ({s.roots and axes})")
    root = s.roots[0]
    total = serial(s)
    part = out_partition(root.sizes(), total)
    return root.axis, part[root.group.rank()], total


def factory(g, func, args, kwargs):
    """``torch.zeros`` / ``ones`` / ``full`` / ``empty`` / ``linspace`` / ``arange`` / ``logspace`` with a
    :class:`ShardLen` size (see the module docstring)."""
    name = func.__name__
    what = f"torch.{name}"
    kwargs = dict(kwargs)
    if name in ("linspace", "arange", "logspace", "range"):
        return func(*[serial(a) for a in args], **{k: serial(v) for k, v in kwargs.items()})
    if name == "full":
        size, rest = (args[0], args[1:]) if args else (kwargs.pop("size"), ())
    else:
        if not args:
            size, rest = kwargs.pop("size"), ()
        elif isinstance(args[0], (list, tuple)):
            size, rest = args[0], args[1:]
        else:
            size, rest = args, ()
    size = list(size)
    layout, seen = [], set()
    for k, s in enumerate(size):
        if isinstance(s, ShardLen):
            axis, local, _ = _dim_of(g, s, what)
            if axis in seen:
                raise g.error(f"{what}: two dims sized by lengths of the same sharded dim (sizes {tuple(size)})")
            seen.add(axis)
            size[k] = local
            layout.append(((local, axis),))
        else:
            layout.append(None)
    with_size = (tuple(size),) + tuple(rest)
    kwargs.pop("out", None)
    return g.mark(func(*with_size, **kwargs), tuple(layout))
