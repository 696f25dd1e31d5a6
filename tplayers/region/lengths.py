"""Lengths read from sharded dims inside a region: this rank's number that remembers the serial one.

Inside a domain region ``x.shape[2]`` of an H-sharded ``x`` is this rank's row count, but the model
was written for the serial tensor, where it is the global length: ``torch.zeros(n, c, x.size(-2),
x.size(-1) // 2 + 1)`` (an FNO's spectrum), ``center = h // 2`` and ``x_ft[:, :, center - m:
center + m]``, ``torch.linspace(0, 1, h + 1)`` (a grid of coordinates), ``irfft2(s=x.shape[-2:])``.
So the guard hands the region's code a :class:`ShardLen` for every length of a sharded dim it reads
(``x.shape``, ``x.size()``): an ``int`` whose value is the local length (the tensor ops the code runs
on its local data take it as they always did) and which remembers how it was derived: arithmetic
with ints (``+ - * // %``, unary ``-``) gives another :class:`ShardLen`, so ``h // 2 + 1`` still
knows it is ``H // 2 + 1`` serially. Comparisons (``<``, ``==``, ``min``, ``max``) compare the serial
values, so a branch the model takes on a length is the serial model's branch on every rank; the
routes that take sizes (factories, slices, ``linspace``, signal and interpolation sizes) read the
serial value with :func:`serial`.

The serial value needs every rank's local length along the dim's mesh dim: one small all-gather,
made the first time it is needed and cached per tensor dim and region call (:class:`Root`). Every
rank runs the same code, so every rank asks at the same point (comparisons are global, so the ranks'
branches agree). True division gives a :class:`ShardFloat`, which keeps the derivation through
float arithmetic and comes back a ShardLen through ``math.ceil`` / ``floor`` / ``round`` (timm's
"same" padding: ``math.ceil(ih / s)``). A length passed through ``int()`` / ``float()`` is a plain
local number again, and the region notes where model code did so (:func:`lost`). Lengths of merged
dims holding sharded factors (windows folded into the batch) have a root too
(:func:`tplayers.region.rules_windows.folded_root`).
Every ShardLen hashes alike (equality is serial, and a local hash would make a dict keyed by
lengths compare, and so exchange, on some ranks only), so it is a valid but slow dict key, and it
never matches a plain int key.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from tplayers.comm.collectives import exchange_grid_table
from tplayers.domain.active import active_guard, stepped_aside

__all__ = ["Root", "MeshRoot", "ShardLen", "ShardFloat", "serial", "is_len", "is_read", "lost", "shape_with_lengths"]


class Root:
    """One sharded tensor dim's local length on this rank, and (once asked) every rank's along its mesh dim."""

    def __init__(self, local: int, group, axis: int):
        self.local, self.group, self.axis = int(local), group, axis
        self._sizes: Optional[List[int]] = None

    def sizes(self) -> List[int]:
        """Every rank's local length along the mesh dim, in mesh order (one all-gather, cached)."""
        if self._sizes is None:
            g = active_guard()
            if g is not None and getattr(g, "pending", 0):
                g.settle()  # a refusal decided from local sizes meets the other ranks before this collective
            with stepped_aside(g, settle=False) if g is not None else _nothing():
                table = exchange_grid_table([self.local], [self.group], "region.lengths")
            self._sizes = [row[0][0] for row in table]
        return self._sizes

    def total(self) -> int:
        return sum(self.sizes())

    def offset(self) -> int:
        return sum(self.sizes()[: self.group.rank()])


class MeshRoot(Root):
    """The local length of a dim merging factors sharded over every mesh dim (windows folded into the batch on
    a 2-D mesh): its serial length is the sum of every rank's local length (each rank holds one block of
    the grid of factors). Only :meth:`total` has a meaning; ``axis`` and ``group`` are ``None``."""

    folded = True

    def __init__(self, local: int, groups):
        super().__init__(local, None, None)
        self.groups = list(groups)

    def sizes(self) -> List[int]:
        if self._sizes is None:
            g = active_guard()
            if g is not None and getattr(g, "pending", 0):
                g.settle()
            with stepped_aside(g, settle=False) if g is not None else _nothing():
                table = exchange_grid_table([self.local], self.groups, "region.lengths")
            self._sizes = [row[0] for plane in table for row in plane]
        return self._sizes

    def offset(self) -> int:  # pragma: no cover - the rank's elements are strided: no offset
        raise ValueError("a length merging dims sharded over every mesh dim has no offset")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_HASH = hash("tplayers.ShardLen")


def _ident(v: int) -> int:
    return v


class _Derived:
    """What :class:`ShardLen` and :class:`ShardFloat` share: ``roots`` and ``fn`` (the derivation),
    arithmetic that keeps it (each class's ``_bin``), serial comparisons, and one hash for all
    (equality is serial, and a local hash would make a dict keyed by lengths compare, and so
    exchange, on some ranks only)."""

    roots: Tuple[Root, ...]
    fn: Callable[..., Any]

    def __hash__(self):
        return _HASH

    def __add__(self, o):
        return self._bin(o, operator.add)

    def __radd__(self, o):
        return self._bin(o, operator.add, True)

    def __sub__(self, o):
        return self._bin(o, operator.sub)

    def __rsub__(self, o):
        return self._bin(o, operator.sub, True)

    def __mul__(self, o):
        return self._bin(o, operator.mul)

    def __rmul__(self, o):
        return self._bin(o, operator.mul, True)

    def __truediv__(self, o):
        return _float(self, o, operator.truediv) if _number(o) else NotImplemented

    def __rtruediv__(self, o):
        return _float(o, self, operator.truediv) if _number(o) else NotImplemented

    def __eq__(self, o):
        return serial(self) == serial(o) if _number(o) else NotImplemented

    def __ne__(self, o):
        return serial(self) != serial(o) if _number(o) else NotImplemented

    def __lt__(self, o):
        return serial(self) < serial(o) if _number(o) else NotImplemented

    def __le__(self, o):
        return serial(self) <= serial(o) if _number(o) else NotImplemented

    def __gt__(self, o):
        return serial(self) > serial(o) if _number(o) else NotImplemented

    def __ge__(self, o):
        return serial(self) >= serial(o) if _number(o) else NotImplemented

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """numpy on a length (``np.ceil(h / ws)``): the local number, and the region notes that model code
        turned a length read from a sharded dim into a plain local number (:func:`lost`)."""
        lost(f"numpy.{getattr(ufunc, '__name__', ufunc)}", 2)
        plain = [_local(v) for v in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)


def _number(o) -> bool:
    return isinstance(o, (int, float)) and not isinstance(o, bool)


class ShardLen(_Derived, int):
    """An ``int`` equal to this rank's length, derived by ``fn`` from the sharded dims ``roots`` (see the
    module docstring): ``serial(n)`` is ``fn`` of the roots' global lengths."""

    __hash__ = _Derived.__hash__

    def __new__(cls, value: int, roots: Tuple[Root, ...], fn: Callable[..., int]):
        obj = int.__new__(cls, int(value))
        obj.roots, obj.fn = roots, fn
        return obj

    def __repr__(self) -> str:
        return f"ShardLen({int(self)})"

    def _bin(self, other, op, reflected=False):
        if isinstance(other, float) and not isinstance(other, bool):
            return _float(other, self, op) if reflected else _float(self, other, op)
        if isinstance(other, bool) or not isinstance(other, int):
            return NotImplemented
        a, b = (other, self) if reflected else (self, other)
        ra, fa = _parts(a)
        rb, fb = _parts(b)
        n = len(ra)
        return ShardLen(op(int(a), int(b)), ra + rb, lambda *v: op(fa(*v[:n]), fb(*v[n:])))

    def __floordiv__(self, o):
        return self._bin(o, operator.floordiv)

    def __rfloordiv__(self, o):
        return self._bin(o, operator.floordiv, True)

    def __mod__(self, o):
        return self._bin(o, operator.mod)

    def __rmod__(self, o):
        return self._bin(o, operator.mod, True)

    def __neg__(self):
        fn = self.fn
        return ShardLen(-int(self), self.roots, lambda *v: -fn(*v))

    def __pos__(self):
        return self

    def __abs__(self):
        fn = self.fn
        return ShardLen(abs(int(self)), self.roots, lambda *v: abs(fn(*v)))

    def __bool__(self):
        return serial(self) != 0

    def __int__(self):
        lost("int()", 2)
        return int.__int__(self)

    def __float__(self):
        lost("float()", 2)
        return int.__float__(self)


def _parts(x) -> Tuple[Tuple[Root, ...], Callable[..., Any]]:
    if isinstance(x, _Derived):
        return x.roots, x.fn
    v = x
    return (), lambda: v


class ShardFloat(_Derived, float):
    """A :class:`ShardLen` through true division (``h / 2``, ``math.ceil(h / s)`` in a "same" padding):
    a ``float`` with the local value that keeps the derivation through ``+ - * /`` and comes back a
    :class:`ShardLen` through ``math.ceil`` / ``floor`` / ``trunc`` / ``round``. Comparisons are serial."""

    __hash__ = _Derived.__hash__

    def __new__(cls, value: float, roots: Tuple[Root, ...], fn: Callable[..., float]):
        obj = float.__new__(cls, float(value))
        obj.roots, obj.fn = roots, fn
        return obj

    def _bin(self, other, op, reflected=False):
        if not _number(other):
            return NotImplemented
        return _float(other, self, op) if reflected else _float(self, other, op)

    def __int__(self):
        lost("int()", 2)
        return float.__int__(self)

    def __float__(self):
        lost("float()", 2)
        return float.__float__(self)

    def _int(self, fn):
        f = self.fn
        return ShardLen(fn(float(self)), self.roots, lambda *v: fn(f(*v)))

    def __ceil__(self):
        return self._int(math.ceil)

    def __floor__(self):
        return self._int(math.floor)

    def __trunc__(self):
        return self._int(math.trunc)

    def __round__(self, ndigits=None):
        return self._int(round) if ndigits is None else round(float(self), ndigits)


def _float(a, b, op) -> Any:
    ra, fa = _parts(a)
    rb, fb = _parts(b)
    n = len(ra)
    return ShardFloat(op(_local(a), _local(b)), ra + rb, lambda *v: op(fa(*v[:n]), fb(*v[n:])))


def _local(x):
    return float.__float__(x) if isinstance(x, ShardFloat) else int.__int__(x) if isinstance(x, ShardLen) else x


def lost(how: str, depth: int = 1) -> None:
    """Model code (not tplayers', torch's or numpy's own) made a plain local number of a length read from a
    sharded dim (``int(h)``, ``np.ceil(h / ws)``): noted on the active region guard (``lost``), which
    then follows the replicated tensors built from that point on (:mod:`tplayers.region.taint`)."""
    f = sys._getframe(depth)
    while f is not None and f.f_globals.get("__name__", "").startswith(("numpy", "torch.overrides")):
        f = f.f_back
    name = "" if f is None else f.f_globals.get("__name__", "")
    if f is None or name.startswith(("tplayers.", "torch.", "numpy")):
        return  # the library's own int() of a length (the layout code reads sizes): nothing lost
    g = active_guard()
    if g is not None and getattr(g, "lost", None) is not None:
        g.lost = f"{how} of a length read from a sharded dim at {f.f_code.co_filename}:{f.f_lineno}"


def is_len(x: Any) -> bool:
    return isinstance(x, ShardLen)


def is_read(x: Any) -> bool:
    """Whether ``x`` is a length read as is from one sharded dim (``x.shape[d]``: no arithmetic on it)."""
    return isinstance(x, ShardLen) and len(x.roots) == 1 and x.fn is _ident


def serial(x: Any) -> Any:
    """The serial model's value of ``x``: a :class:`ShardLen`'s derivation at the global lengths, anything
    else as it is (one all-gather per sharded dim the first time, see :class:`Root`)."""
    if isinstance(x, ShardFloat):
        return float(x.fn(*[r.total() for r in x.roots]))
    if not isinstance(x, ShardLen):
        return x
    return int(x.fn(*[r.total() for r in x.roots]))


def shape_with_lengths(shape: Sequence[int], roots: Sequence[Optional[Root]]) -> torch.Size:
    """``shape`` with the length of every dim that has a root made a :class:`ShardLen` of it."""
    return torch.Size([int(n) if r is None else ShardLen(int(n), (r,), _ident) for n, r in zip(shape, roots)])
