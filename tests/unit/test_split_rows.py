"""window_plan.split_rows: the interior output rows (windows reading only own rows) by brute force."""

import random

import pytest

from tplayers.window_plan import PADDING_MODES, conv_out_len, conv_window, plan_windows, split_rows
from partition_rule import window_partition_ok


def _own_rows_read(plan, o, kernel, stride, dilation, own):
    """Own-row indices read by output row ``o`` (None where a read row is a halo or boundary row)."""
    rows = []
    for j in range(kernel):
        r = o * stride + j * dilation + plan.trim[0] - plan.boundary[0] - plan.recv[0]
        rows.append(r if 0 <= r < own else None)
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_split_rows_brute_force(seed):
    rng = random.Random(seed)
    checked = with_edges = 0
    for _ in range(300):
        parts = rng.randint(2, 4)
        k, s, d = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 3)
        pad = (rng.randint(0, 3), rng.randint(0, 3))
        mode = rng.choice(PADDING_MODES)
        sizes = [rng.randint(1, 12) for _ in range(parts)]
        out_len = conv_out_len(sum(sizes), k, s, d, pad)
        if out_len <= 0:
            continue  # the serial op has no output either
        valid = window_partition_ok(sizes, out_len, k, s, d, pad[0], mode)  # the test's own rule
        try:
            plans = plan_windows(sizes, out_len, conv_window(k, s, d, pad[0]), mode=mode, what="H")
        except ValueError as err:
            assert not valid, f"refused a valid partition: sizes {sizes} k {k} s {s} d {d} pad {pad} {mode}: {err}"
            continue
        for plan, own in zip(plans, sizes):
            split = split_rows(plan, own, k, s, d)
            interior = [o for o in range(plan.out_rows)
                        if None not in _own_rows_read(plan, o, k, s, d, own)]
            if interior:
                assert interior == list(range(split.lo, split.hi)), (plan, own, split)
                a, b = split.own(split.lo, split.hi)
                assert 0 <= a and b <= own  # the interior's input is own rows only
                with_edges += split.lo > 0 or split.hi < plan.out_rows
            else:
                assert split.lo == split.hi == plan.out_rows and not split.has_interior, (plan, own, split)
            checked += 1
    assert checked > 100 and with_edges > 20
