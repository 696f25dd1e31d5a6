"""The ranks' small JSON agreement: every rank gets every rank's bytes, in one all-gather when they
are short and two when any rank's are long (a long error message, a save's layout)."""

from __future__ import annotations

import pytest
from harness import run_ranks

from tplayers.checkpoint.layout import _INLINE_BYTES, allgather_bytes


def _payload(rank: int, case: str) -> bytes:
    sizes = {
        "empty": [0, 0, 0],
        "short": [0, 7, _INLINE_BYTES],
        "long": [_INLINE_BYTES + 1, 3, 0],
        "mixed": [5000, 0, 17],
    }[case]
    return bytes((rank * 31 + i) % 251 for i in range(sizes[rank]))


def _gather(rank, world, case):
    got = allgather_bytes(_payload(rank, case))
    assert got == [_payload(r, case) for r in range(world)]
    return True


@pytest.mark.parametrize("case", ["empty", "short", "long", "mixed"])
def test_allgather_bytes_short_and_long(case):
    run_ranks(_gather, 3, args=(case,), timeout=30)
