"""Comm accounting: count every collective tplayers issues, with its bytes.

Every collective in ``tplayers.comm`` reports itself here just before it is
issued. :func:`count_collectives` collects those reports for the code it wraps
(forward and backward alike), on this rank.

>>> import torch, tplayers
>>> with tplayers.count_collectives() as log:   # doctest: +SKIP
...     loss = model(x).sum(); loss.backward()
>>> log.count("all_reduce"), log.bytes("all_reduce")   # doctest: +SKIP
(2, 65536)

``bytes`` is the payload of this rank's local buffer (for an all-reduce, the
tensor reduced; for an all-gather, this rank's contribution times the group
size, i.e. the gathered buffer; for point-to-point, what this rank sends).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

__all__ = ["CollectiveRecord", "CommLog", "count_collectives", "record_collective"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: its kind (``all_reduce``, ``all_gather``, ``send``...), bytes, group size."""

    kind: str
    nbytes: int
    group_size: int
    tag: str = ""


@dataclass
class CommLog:
    """The collectives recorded while a :func:`count_collectives` block was active."""

    records: List[CollectiveRecord] = field(default_factory=list)

    def count(self, kind: Optional[str] = None) -> int:
        """Number of collectives (of ``kind`` if given)."""
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def bytes(self, kind: Optional[str] = None) -> int:
        """Total bytes (of ``kind`` if given)."""
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def summary(self) -> dict:
        """``{kind: (count, bytes)}``."""
        out: dict = {}
        for r in self.records:
            c, b = out.get(r.kind, (0, 0))
            out[r.kind] = (c + 1, b + r.nbytes)
        return out

    def clear(self) -> None:
        self.records.clear()


# Active logs. A plain list guarded by a lock (not a contextvar) so that
# collectives issued from autograd's worker threads during backward are counted.
_active: List[CommLog] = []
_lock = threading.Lock()


def record_collective(kind: str, nbytes: int, group_size: int, tag: str = "") -> None:
    """Report one collective to every active :class:`CommLog` (cheap when none is active)."""
    if not _active:
        return
    rec = CollectiveRecord(kind, int(nbytes), int(group_size), tag)
    with _lock:
        for log in _active:
            log.records.append(rec)


@contextmanager
def count_collectives() -> Iterator[CommLog]:
    """Context manager that records the collectives tplayers issues inside it."""
    log = CommLog()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)
