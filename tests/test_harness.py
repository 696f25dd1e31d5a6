"""The multi-process harness itself: a failing rank is reported, a hang is cut short."""

import time

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank one")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 blocks here until killed or gloo times out


def _hang(rank, world):
    time.sleep(60)


def test_results_in_rank_order():
    assert run_ranks(_sum_ranks, 3, timeout=20) == [3.0, 3.0, 3.0]


def test_failing_rank_traceback_is_reported_and_nobody_hangs():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 of 2 failed(.|\n)*boom on rank one"):
        run_ranks(_fail_on_one, 2, timeout=20, grace=1.0)
    assert time.monotonic() - start < 15


def test_hanging_rank_times_out():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish"):
        run_ranks(_hang, 2, timeout=2)
    assert time.monotonic() - start < 10
