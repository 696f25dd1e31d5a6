"""advise_exact_read asks the kernel for pages only where they are not resident yet."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from tplayers.checkpoint import pagecache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/madvise hints are Linux-only")


def _calls(monkeypatch):
    calls = []
    monkeypatch.setattr(pagecache, "_madvise", lambda start, n, advice: calls.append((start, n, advice)))
    return calls


def test_resident_range_gets_no_hint(monkeypatch):
    t = torch.ones(1 << 18)  # written: every page resident
    assert pagecache._resident(t.data_ptr(), t.numel() * 4)
    calls = _calls(monkeypatch)
    pagecache.advise_exact_read(t)
    assert calls == []


def test_untouched_range_gets_willneed(monkeypatch):
    region = mmap.mmap(-1, 1 << 20)  # anonymous and never touched: no page is resident
    t = torch.frombuffer(region, dtype=torch.uint8)
    assert not pagecache._resident(t.data_ptr(), t.numel())
    calls = _calls(monkeypatch)
    pagecache.advise_exact_read(t)
    assert calls == [(t.data_ptr(), t.numel(), mmap.MADV_WILLNEED)]
    del t


def test_strided_parts_ask_for_their_span_or_their_rows(monkeypatch):
    """A column band of an untouched mapping: its whole span when at least half of it is wanted, else one
    request per row run; nothing at all once it is resident."""
    region = mmap.mmap(-1, 64 * 4096)
    whole = torch.frombuffer(region, dtype=torch.float32).view(64, 1024)  # 4 KiB rows, never touched
    calls = _calls(monkeypatch)
    dense = whole[:, 100:700]  # 600 of 1024 columns: more than half of the span
    pagecache.advise_exact_read(dense)
    span = (63 * 1024 + 600) * 4
    assert calls == [(dense.data_ptr(), span, mmap.MADV_WILLNEED)]
    calls.clear()
    sparse = whole[:, 100:200]
    pagecache.advise_exact_read(sparse)
    assert calls == [(sparse[i].data_ptr(), 400, mmap.MADV_WILLNEED) for i in range(64)]
    calls.clear()
    whole.fill_(1.0)  # now resident
    pagecache.advise_exact_read(sparse)  # a span under PROBE_BYTES: asked for without probing
    assert len(calls) == 64
    calls.clear()
    monkeypatch.setattr(pagecache, "PROBE_BYTES", 4096)
    pagecache.advise_exact_read(sparse)  # probed: resident, so nothing is asked
    assert calls == []
    del whole, dense, sparse
