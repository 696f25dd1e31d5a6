"""Domain layers built with different arguments on different ranks: a ValueError on EVERY rank,
naming the field and the ranks, within seconds (was: a gloo abort on one rank, or a hang)."""

import time

import pytest
import torch
from harness import run_ranks

import tplayers


def _conv(rank, world, **kw):
    args = dict(in_channels=2, out_channels=3, kernel_size=3, padding=1)
    args.update(kw)
    return tplayers.DistributedConv2d(**args)


def _layers_disagree(rank, world):
    x = torch.randn(1, 2, 6, 8)
    na_x = torch.randn(1, 6, 8, 8)
    cases = {
        "kernel_size": lambda: _conv(rank, world, kernel_size=5 if rank == 1 else 3, padding=2 if rank == 1 else 1)(x),
        "padding_mode": lambda: _conv(rank, world, padding_mode="circular" if rank == 0 else "zeros")(x),
        "shard_dims": lambda: _conv(rank, world, shard_dims=(3,) if rank == 1 else (2,))(x),
        "stride": lambda: _conv(rank, world, stride=2 if rank == 1 else 1)(x),
        "na kernel_size": lambda: tplayers.NeighborhoodAttention(8, 2, 5 if rank == 1 else 3, shard_dims=(1,))(na_x),
    }
    out = {}
    for name, call in cases.items():
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            call()
        out[name] = (str(info.value), time.monotonic() - start)
    # the group is still healthy: agreeing layers run afterwards
    y = _conv(rank, world)(x)
    assert y.shape == (1, 3, 6, 8)
    return out


def test_domain_layers_built_differently_raise_on_every_rank():
    outs = run_ranks(_layers_disagree, 2, timeout=30)
    for rank, out in enumerate(outs):
        for name, (msg, seconds) in out.items():
            field = name.replace("na ", "")
            assert f"{field} differs across ranks" in msg, (rank, name, msg)
            assert "ranks [0]" in msg and "ranks [1]" in msg, (rank, name, msg)
            assert seconds < 5, (rank, name, seconds)
