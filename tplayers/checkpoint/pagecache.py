"""Page-cache hints for memory-mapped checkpoint reads (Linux ``madvise``; no-ops elsewhere).

The reader maps whole files (:class:`~tplayers.checkpoint.mapped.MappedFile`,
which turns read-ahead off: ``MADV_RANDOM``). These hints make the kernel read
exactly the pages a rank needs, requested ahead of use (``MADV_WILLNEED``), and
tell whether they are already cached.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

_LIBC = None

#: Spans at least this long are probed for residency before a ``MADV_WILLNEED``.
PROBE_BYTES = 256 << 10


def _libc():
    """libc with ``madvise`` and ``mincore`` (where it has one) typed, loaded on first use."""
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if hasattr(lib, "mincore"):
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _LIBC = lib
    return _LIBC


def _madvise(start: int, length: int, advice: int) -> None:
    page = mmap.PAGESIZE
    lo = start // page * page
    hi = -(-(start + length) // page) * page
    _libc().madvise(lo, hi - lo, advice)


def _resident(start: int, length: int) -> bool:
    """Whether the first, middle and last pages of ``[start, start + length)`` are in the page cache
    (``mincore``); False where it cannot tell."""
    fn = getattr(_libc(), "mincore", None)
    if fn is None:
        return False
    page = mmap.PAGESIZE
    vec = ctypes.create_string_buffer(1)
    for at in (start, start + length // 2, start + length - 1):
        if fn(at // page * page, page, vec) != 0 or not (vec.raw[0] & 1):
            return False
    return True


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (its whole span in memory)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size() if t.numel() else 0


def cached(t: torch.Tensor) -> bool:
    """Whether ``t``'s pages look resident (first, middle and last page of its span; ``mincore``).
    True for an empty tensor; False where it cannot tell."""
    n = _extent(t)
    return n == 0 or (t.device.type == "cpu" and _resident(t.data_ptr(), n))


def advise_exact_read(t: torch.Tensor) -> None:
    """Start reading exactly ``t``'s pages of a memory-mapped file now (``MADV_WILLNEED``; a hint).

    Skipped when :func:`cached` (a hot load: the kernel would otherwise walk
    every cached page of it, which costs time on a large span); a span under
    :data:`PROBE_BYTES` is asked for unprobed (walking it costs what probing
    does). A strided ``t`` (part of
    each row of a piece) asks for its whole span when at least half of it is
    wanted (the pages in between hold wanted bytes anyway), else for each row's
    run. Harmless on ordinary memory; skipped where ``madvise`` is missing.
    """
    extent = _extent(t)
    if not hasattr(mmap, "MADV_WILLNEED") or extent == 0 or (extent >= PROBE_BYTES and cached(t)):
        return
    rows = t.flatten(1) if t.dim() >= 2 and dense_from(t, 1) else None  # a view: dims 1.. are dense
    if t.is_contiguous() or 2 * t.numel() * t.element_size() >= extent or rows is None or rows.shape[0] > 4096:
        _madvise(t.data_ptr(), extent, mmap.MADV_WILLNEED)
        return
    run = rows.shape[1] * t.element_size()
    for i in range(rows.shape[0]):
        _madvise(rows[i].data_ptr(), run, mmap.MADV_WILLNEED)


def dense_from(t: torch.Tensor, d: int) -> bool:
    """The dims from ``d`` on are dense: ``t`` is a narrow along ``d`` of a contiguous tensor, or (``d = 1``)
    rows of contiguous runs, such as a column band.

    >>> dense_from(torch.zeros(4, 6)[:, 1:3], 1), dense_from(torch.zeros(4, 6).t(), 1)
    (True, False)
    """
    expect = 1
    for i in range(t.dim() - 1, d - 1, -1):
        if t.shape[i] != 1 and t.stride(i) != expect:
            return False
        expect *= t.shape[i]
    return True
