"""The window-op axis plans, simulated on row indices: for random windows, modes and partitions
(uneven, empty edges), every shard ends up with exactly the rows its outputs read."""

import random

import pytest
from partition_rule import window_partition_ok

from tplayers.sharding import offsets_from_sizes
from tplayers.window_plan import conv_out_len, conv_window, out_partition, plan_windows


def _source(r, length, mode):
    """The global row an extended row ``r`` shows (None: a constant / zero row)."""
    if 0 <= r < length:
        return r
    if mode == "circular":
        return r % length
    if mode == "reflect":
        return -r if r < 0 else 2 * (length - 1) - r
    if mode == "replicate":
        return 0 if r < 0 else length - 1
    return None


def _simulate(sizes, plans, mode):
    """What each shard holds after exchange, boundary padding and trim (rows as global indices)."""
    starts, parts, length = offsets_from_sizes(sizes), len(sizes), sum(sizes)
    own = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    out = []
    for c, p in enumerate(plans):
        lo_nb, hi_nb = (c - 1) % parts, (c + 1) % parts
        has_lo = mode == "circular" or c > 0
        has_hi = mode == "circular" or c < parts - 1
        lo = (own[lo_nb][len(own[lo_nb]) - p.recv[0] :] if p.recv[0] else []) if has_lo else [None] * p.recv[0]
        hi = own[hi_nb][: p.recv[1]] if has_hi else [None] * p.recv[1]
        if has_lo:
            assert plans[lo_nb].send[1] == p.recv[0]
        if has_hi:
            assert plans[hi_nb].send[0] == p.recv[1]
        rows = lo + own[c] + hi
        bl, bh = p.boundary
        if mode in ("reflect", "replicate") and (bl or bh):  # pad from the rows held, as F.pad does
            first, last = rows[0], rows[-1]
            left = [_source(first - j, length, mode) for j in range(bl, 0, -1)]
            right = [_source(last + j, length, mode) for j in range(1, bh + 1)]
            rows = left + rows + right
        else:
            rows = [None] * bl + rows + [None] * bh
        t_lo, t_hi = p.trim
        out.append(rows[t_lo : len(rows) - t_hi])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_plans_deliver_exactly_the_rows_read(seed):
    rng = random.Random(seed)
    checked = refused = 0
    for _ in range(300):
        parts = rng.randint(1, 4)
        length = rng.randint(1, 30)
        k, s, d = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        p = rng.randint(0, 3)
        mode = rng.choice(["zeros", "circular", "reflect", "replicate", "fill"])
        if mode in ("reflect", "replicate", "circular") and p > length - (mode == "reflect"):
            continue
        cuts = sorted(rng.randint(0, length) for _ in range(parts - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [length])]
        out_len = conv_out_len(length, k, s, d, (p, p))
        if out_len <= 0:
            continue
        # valid by the test's own rule (tests/partition_rule.py): the planner must accept those; one
        # it accepts beyond them must still deliver exactly the rows read (checked below)
        valid = window_partition_ok(sizes, out_len, k, s, d, p, mode)
        try:
            plans = plan_windows(sizes, out_len, conv_window(k, s, d, p), mode=mode, what="H")
        except ValueError as err:
            assert not valid, f"refused a valid partition: sizes {sizes} k {k} s {s} d {d} p {p} {mode}: {err}"
            assert "halo" in str(err) or "too few" in str(err)
            refused += 1
            continue
        held = _simulate(sizes, plans, mode)
        outs = out_partition(sizes, out_len)
        for c, (o0, n) in enumerate(zip(offsets_from_sizes(outs), outs)):
            assert (plans[c].out_start, plans[c].out_rows) == (o0, n)
            if not n:
                assert held[c] == []
                continue
            a = o0 * s - p
            want = [
                _source(r, length, mode if mode != "fill" else "zeros")
                for r in range(a, (o0 + n - 1) * s - p + d * (k - 1) + 1)
            ]
            assert held[c] == want, (sizes, k, s, d, p, mode, c, held[c], want)
            assert plans[c].in_start == a
        checked += 1
    assert checked > 100 and refused > 10, (checked, refused)
