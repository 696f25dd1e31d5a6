"""tplayers.region.lengths.ShardLen: local value for torch, serial value for Python logic (no process group:
the roots' partitions are set by hand)."""

import math

import torch

from tplayers.region.lengths import Root, ShardFloat, ShardLen, serial, shape_with_lengths


class _Group:
    def rank(self):
        return 0


def _root(sizes):
    r = Root(sizes[0], _Group(), 0)
    r._sizes = list(sizes)  # what the all-gather would have returned
    return r


def test_arithmetic_keeps_the_serial_value_and_the_local_one():
    h = shape_with_lengths((9,), (_root([9, 7]),))[0]  # 9 of 16 rows
    assert isinstance(h, ShardLen) and int(h) == 9 and serial(h) == 16
    m = h // 2 + 1
    assert isinstance(m, ShardLen) and int(m) == 5 and serial(m) == 9
    assert serial(2 * h - 3) == 29 and int(2 * h - 3) == 15
    assert serial(-h % 5) == (-16) % 5 and serial(abs(-h)) == 16
    w = shape_with_lengths((4,), (_root([4, 4]),))[0]
    assert serial(h * w) == 128 and int(h * w) == 36  # two roots


def test_comparisons_are_serial_and_plain_conversions_are_local():
    h = shape_with_lengths((9,), (_root([9, 7]),))[0]
    assert h == 16 and h != 9 and 12 < h and min(h, 12) == 12 and max(h, 12) is h
    assert bool(h) and int(h) == 9 and range(h) == range(9) and float(h) == 9.0
    third = h / 3  # true division: a float that keeps the derivation
    assert isinstance(third, ShardFloat) and float(third) == 3.0 and serial(third) == 16 / 3
    up = math.ceil(third)  # timm's "same" padding: math.ceil(ih / stride)
    assert isinstance(up, ShardLen) and int(up) == 3 and serial(up) == 6 and serial(round(h / 5)) == 3
    assert hash(h) == hash(shape_with_lengths((7,), (_root([7, 9]),))[0])  # one hash: rank-alike dict lookups


def test_torch_takes_the_local_value_and_sizes_keep_the_type():
    h = shape_with_lengths((3, 9), (None, _root([9, 7])))
    assert type(h[0]) is int and isinstance(h[1], ShardLen) and isinstance(h[-1:][0], ShardLen)
    assert torch.zeros(h).shape == (3, 9) and torch.arange(h[1]).numel() == 9
