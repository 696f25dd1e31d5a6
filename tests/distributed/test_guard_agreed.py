"""The region guard's refusals read from local sizes are agreed: every rank raises the same ValueError
within seconds (issue 33 item 4), naming the op, the module and the ranks whose shard triggered it.

Before, a rank holding a single row (or none) refused a reshape the other ranks accepted: those ranks
raised, the others waited in the next collective until they exited (gloo "connection closed") or until
the process group's timeout. Every case here runs at 3 ranks with an uneven partition on which only
some ranks refuse, and asserts ``pytest.raises(ValueError)`` on every rank.
"""

import copy
import time

import pytest
import torch
from harness import run_ranks
from torch import nn

import tplayers

SECONDS = 5  # a refusal reaches every rank at once; a hang would take the harness timeout


class Tokens(nn.Module):
    """Pixels as tokens and back: ``view`` merging the sharded H with W (diffusers' and SegFormer's
    attention do this) with sizes made plain local numbers (``int``), ambiguous on a 1-row shard and
    refused on an empty one. (With the lengths as read, ``ShardLen``s, the views are read as the serial
    views and are exact: ``test_guard_windows.py``.)"""

    def forward(self, h):
        n, c, rows, w = (int(s) for s in h.shape)
        return h.view(n, c, rows * w).view(n, c, rows, w)


class Views(nn.Module):
    """The reshape placed before, between or after the twins (``where``)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.mix = Tokens()

    def forward(self, x):
        if self.where == "first":  # refused before any collective: settled at the first twin
            x = self.mix(x)
        h = self.conv1(x)
        if self.where == "between":  # between two twins (the reported SegFormer case)
            h = self.mix(h)
        h = self.conv2(torch.relu(h))
        if self.where == "last":  # no collective after it: settled at the region's exit
            h = self.mix(h)
        return h


class Skip(nn.Module):
    """A U-Net skip whose halves are partitioned differently (the input is uneven, the up path balanced):
    equal local sizes on some ranks only, so ``cat`` is accepted there and refused elsewhere."""

    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = self.inc(x)
        return self.out(torch.cat([skip, self.up(self.down(skip))], dim=1))


def _local(x, sizes, rank):
    return x.narrow(2, sum(sizes[:rank]), sizes[rank])


def _refusal(rank, world, model, sizes, good_sizes):
    torch.manual_seed(0)
    serial = model.double()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(1, 2, sum(sizes), 6, dtype=torch.float64)
    messages = []
    for attempt in range(2):  # a refused partition is refused together again (it was never marked checked)
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            par(_local(x, sizes, rank))
        assert time.monotonic() - start < SECONDS
        messages.append(str(info.value))
    # the group is in step afterwards: a partition every rank accepts runs, exact
    y = torch.randn(1, 2, sum(good_sizes), 6, dtype=torch.float64)
    torch.testing.assert_close(par(_local(y, good_sizes, rank)), _local(serial(y), good_sizes, rank))
    return messages


def _check(outs, op, module, ranks):
    first = outs[0][0]
    for rank, msgs in enumerate(outs):
        assert msgs == [first, first], (rank, msgs, first)  # the same error on every rank, both times
    assert f"rank(s) {ranks} raised" in first, first
    assert op in first and f"in module {module!r}" in first, first


@pytest.mark.parametrize("where,sizes", [("first", [3, 1, 2]), ("between", [3, 1, 2]), ("last", [2, 4, 1])])
def test_reshape_of_a_single_row_shard_raises_on_every_rank(where, sizes):
    outs = run_ranks(_refusal, 3, args=(Views(where), sizes, [3, 3, 2]), timeout=60)
    _check(outs, "Tensor.view", "mix", [r for r, s in enumerate(sizes) if s == 1])
    assert "single row" in outs[0][0]


def test_reshape_of_an_empty_shard_raises_on_every_rank():
    outs = run_ranks(_refusal, 3, args=(Views("first"), [4, 0, 2], [2, 2, 2]), timeout=60)
    _check(outs, "Tensor.view", "mix", [1])
    assert "empty shard" in outs[0][0]


def test_cat_of_differently_partitioned_halves_raises_on_every_rank():
    # input [2, 3, 3]: the skip keeps it; down (stride 2) then up (x2) gives the balanced [3, 3, 2];
    # rank 1 holds 3 and 3 rows (accepted there alone), ranks 0 and 2 refuse
    outs = run_ranks(_refusal, 3, args=(Skip(), [2, 3, 3], [3, 3, 2]), timeout=60)
    _check(outs, "cat of tensors sharded differently", "<root>", [0, 2])


def _settles(rank, world):
    """A model whose reshapes pass: its first call settles before each collective that follows one;
    calls with a partition already run through settle nothing (the per-call cost is unchanged)."""
    torch.manual_seed(0)
    par = tplayers.parallelize_module(Views("between").double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    counts = []
    for h in (12, 12, 13, 13):  # a new partition is checked once
        x = tplayers.shard(torch.randn(1, 2, h, 6, dtype=torch.float64), 2)
        with tplayers.count_collectives() as log:
            par(x)
        counts.append([r.tag for r in log.records].count("domain.guard"))
    return counts


def test_settling_costs_one_small_all_gather_on_a_partitions_first_call_only():
    for counts in run_ranks(_settles, 3, timeout=60):
        assert counts == [1, 0, 1, 0], counts


def _segformer(rank, world):
    from transformers import SegformerConfig, SegformerModel

    torch.manual_seed(0)
    config = SegformerConfig(
        num_channels=3,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
    )
    model = tplayers.parallelize_module(SegformerModel(config).eval(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(1, 3, 44, 32)  # 11 rows after the stride-4 patch embedding: 4 + 4 + 3, then 2 + 2 + 1
    start = time.monotonic()
    with pytest.raises(ValueError) as info, torch.no_grad():
        model(tplayers.shard(x, 2))
    assert time.monotonic() - start < SECONDS
    return str(info.value)


def test_hf_segformer_single_row_shard_raises_on_every_rank():
    outs = run_ranks(_segformer, 3, timeout=90)
    assert len(set(outs)) == 1, outs
    assert "rank(s) [2] raised" in outs[0] and "Tensor.reshape" in outs[0], outs[0]
    assert "in module 'stages.0.blocks.0.attention.sequence_reduction'" in outs[0], outs[0]
