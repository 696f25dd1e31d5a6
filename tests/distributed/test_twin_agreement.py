"""Twins agree with every rank (issue 33 item 4): outside a region, on their partition every call; and on
the values of their replicated parameters, the first time.

* A standalone twin (hand-written code, no region) whose partition changes on some ranks only is
  re-planned on every rank, exactly. Before, the changed ranks ran the layout exchange alone while
  the others waited in their halo messages, until the process group's timeout.
* Twins built with ``from_module`` (or ``parallelize_module(..., src_rank=None)``) from modules whose
  replicated weights differ across ranks (a script that forgot its seed) raise ``ValueError`` on every
  rank, naming the tensors and the ranks. Before, the output was silently wrong.
"""

import copy
import time

import pytest
import torch
from harness import run_ranks
from torch import nn

import tplayers

SECONDS = 5


def _local(x, sizes, rank, dim=2):
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def _conv_partitions(rank, world, partitions):
    torch.manual_seed(0)
    serial = nn.Conv2d(2, 3, 3, padding=1).double()
    conv = tplayers.DistributedConv2d.from_module(serial)
    for sizes in partitions:  # this rank's rows by hand (no tplayers.shard), some ranks unchanged
        x = torch.randn(1, 2, sum(sizes), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(sizes)))
        start = time.monotonic()
        y = conv(_local(x, sizes, rank))
        assert time.monotonic() - start < SECONDS
        torch.testing.assert_close(y, _local(serial(x), sizes, rank), rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize(
    "world,partitions",
    [
        (2, [[5, 4], [5, 5], [5, 4], [5, 4]]),  # rank 0 keeps 5 rows throughout
        (3, [[4, 3, 3], [4, 3, 4], [4, 3, 3], [4, 4, 3]]),  # one rank changes at a time; rank 0 never
    ],
)
def test_standalone_twin_whose_partition_changes_on_one_rank_is_replanned_on_every_rank(world, partitions):
    assert all(run_ranks(_conv_partitions, world, args=(partitions,), timeout=60))


def _unplannable(rank, world):
    torch.manual_seed(0)
    conv = tplayers.DistributedConv2d(2, 3, 5, padding=2).double()
    conv(torch.randn(1, 2, [4, 4, 3][rank], 5, dtype=torch.float64))
    start = time.monotonic()
    with pytest.raises(ValueError) as info:  # rank 0 keeps its 4 rows; rank 1's single row cannot feed a 5-row window
        conv(torch.randn(1, 2, [4, 1, 6][rank], 5, dtype=torch.float64))
    assert time.monotonic() - start < SECONDS
    return str(info.value)


def test_standalone_twin_given_an_unplannable_partition_on_some_ranks_raises_on_every_rank():
    outs = run_ranks(_unplannable, 3, timeout=60)
    assert len(set(outs)) == 1 and "shard sizes [4, 1, 6]" in outs[0], outs


def _na_partitions(rank, world):
    torch.manual_seed(0)
    serial = tplayers.NeighborhoodAttention(8, 2, 3).double()
    layer = tplayers.NeighborhoodAttention.from_module(serial, shard_dims=(1,))
    for sizes in ([5, 4], [5, 5], [5, 4]):
        x = torch.randn(1, sum(sizes), 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(sizes)))
        y = layer(_local(x, sizes, rank, dim=1))
        torch.testing.assert_close(y, _local(serial(x), sizes, rank, dim=1), rtol=1e-12, atol=1e-12)
    return True


def test_standalone_neighborhood_attention_whose_partition_changes_on_one_rank_is_replanned():
    assert all(run_ranks(_na_partitions, 2, timeout=60))


# ------------------------------------------------------------------ replicated values
def _built_from(rank, world, seeded, kind):
    torch.manual_seed(0 if seeded else rank)  # unseeded in effect: every rank draws its own weights
    if kind == "conv":
        layer, x = tplayers.DistributedConv2d.from_module(nn.Conv2d(2, 3, 3, padding=1)), torch.randn(1, 2, 4, 5)
    else:
        layer = tplayers.NeighborhoodAttention.from_module(tplayers.NeighborhoodAttention(8, 2, 3), shard_dims=(1,))
        x = torch.randn(1, 4, 6, 8)
    start = time.monotonic()
    if seeded:
        layer(x)
        return ""
    with pytest.raises(ValueError) as info:
        layer(x)
    assert time.monotonic() - start < SECONDS
    return str(info.value)


@pytest.mark.parametrize("kind,names", [("conv", ["'weight'", "'bias'"]), ("na", ["'qkv.weight'", "'proj.weight'"])])
def test_from_module_of_differently_seeded_modules_raises_on_every_rank(kind, names):
    assert run_ranks(_built_from, 2, args=(True, kind), timeout=60) == ["", ""]
    outs = run_ranks(_built_from, 2, args=(False, kind), timeout=60)
    assert outs[0] == outs[1], outs
    assert "hold different values across ranks" in outs[0] and "(ranks [0] / ranks [1])" in outs[0], outs[0]
    assert all(name in outs[0] for name in names), outs[0]


def _region_from(rank, world, seeded, src_rank):
    torch.manual_seed(0 if seeded else rank)
    serial = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, src_rank=src_rank
    )
    x = torch.randn(1, 2, 9, 5, generator=torch.Generator().manual_seed(1))
    if seeded or src_rank is not None:  # one seed, or rank src_rank's values everywhere: exact
        serial = serial if seeded or rank == src_rank else None
        y = model(tplayers.shard(x, 2))
        if serial is not None:
            torch.testing.assert_close(y, tplayers.shard(serial(x), 2))
        return ""
    with pytest.raises(ValueError) as info:
        model(tplayers.shard(x, 2))
    return str(info.value)


def test_plan_with_src_rank_none_of_differently_seeded_models_raises_on_every_rank():
    assert run_ranks(_region_from, 2, args=(True, None), timeout=60) == ["", ""]
    assert run_ranks(_region_from, 2, args=(False, 0), timeout=60) == ["", ""]
    outs = run_ranks(_region_from, 2, args=(False, None), timeout=60)
    assert outs[0] == outs[1], outs
    for name in ("'0.weight'", "'0.bias'", "'3.weight'", "'3.bias'"):
        assert name in outs[0], outs[0]
    assert "'1.weight'" not in outs[0], outs[0]  # GroupNorm's affine starts at ones on every rank: equal
    assert "(ranks [0] / ranks [1])" in outs[0], outs[0]
