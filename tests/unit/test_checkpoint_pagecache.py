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
