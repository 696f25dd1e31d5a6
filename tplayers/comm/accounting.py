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
    """The collectives recorded while a :func:`count_collectives` block was active, on this rank.

    ``records`` holds one :class:`CollectiveRecord` (kind, bytes, group size, tag) per collective;
    :meth:`count`, :meth:`bytes` and :meth:`summary` add them up. A group of one rank issues
    nothing, so records nothing. :func:`count_collectives` yields one.

    >>> from tplayers.comm.accounting import CollectiveRecord, CommLog
    >>> log = CommLog([CollectiveRecord("all_reduce", 64, 2), CollectiveRecord("send", 16, 2)])
    >>> log.count(), log.bytes("all_reduce"), log.summary()
    (2, 64, {'all_reduce': (1, 64), 'send': (1, 16)})
    """

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
    """Context manager that records the collectives tplayers issues inside it (forward and
    backward alike, autograd's threads included), on this rank.

    Yields:
        A :class:`CommLog`, filled while the block runs (nested blocks each get every record).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        fc1 = tplayers.ColumnParallelLinear(8, 16, mesh=mesh)
        fc2 = tplayers.RowParallelLinear(16, 8, mesh=mesh)
        x = torch.randn(4, 8, requires_grad=True)
        with tplayers.count_collectives() as log:
            fc2(torch.relu(fc1(x))).sum().backward()
        # Megatron's pair: one all-reduce forward (fc2), one backward (fc1's input gradient)
        assert log.count("all_reduce") == (2 if mesh.size() > 1 else 0)
        assert log.bytes("all_reduce") == (2 * 4 * 8 * 4 if mesh.size() > 1 else 0)   # two fp32 (4, 8)
    """
    log = CommLog()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)
