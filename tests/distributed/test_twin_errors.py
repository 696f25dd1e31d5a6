"""The spatial twins' "raises" promises, on every rank, within seconds, with no rank left hanging:
ranks built differently, partitions the shards cannot supply, bad inputs."""

import re
import time

import pytest
import torch
from harness import run_ranks
from torch import nn

import tplayers


def _disagree(rank, world):
    x2, x3 = torch.randn(1, 2, 8, 6), torch.randn(1, 2, 6, 5, 4)
    cases = {
        "kernel_size": lambda: tplayers.DistributedMaxPool2d(3 if rank == 1 else 2)(x2),
        "mode": lambda: tplayers.DistributedUpsample(scale_factor=2, mode="nearest" if rank else "bilinear")(x2),
        "stride": lambda: tplayers.DistributedConvTranspose3d(2, 2, 2, stride=2 if rank else 1)(x3),
        "count_include_pad": lambda: tplayers.DistributedAvgPool2d(3, 1, 1, count_include_pad=bool(rank))(x2),
        "output_size": lambda: tplayers.DistributedAdaptiveAvgPool2d(2 if rank else 3)(x2),
        "padding_mode": lambda: tplayers.DistributedConv1d(
            2, 2, 3, padding=1, padding_mode="reflect" if rank else "zeros"
        )(x2[:, :, :, 0]),
        "input dtype": lambda: tplayers.DistributedMaxPool2d(2)(x2.double() if rank else x2),
    }
    out = {}
    for name, call in cases.items():
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            call()
        out[name] = (str(info.value), time.monotonic() - start)
    assert tplayers.DistributedMaxPool2d(2)(x2).shape == (1, 2, 4, 3)  # the group is still healthy
    return out


def test_twins_built_differently_raise_on_every_rank():
    outs = run_ranks(_disagree, 2, timeout=30)
    for rank, out in enumerate(outs):
        for name, (msg, seconds) in out.items():
            assert f"{name} differs across ranks" in msg, (rank, name, msg)
            assert seconds < 5, (rank, name, seconds)


def _partitions(rank, world):
    mesh = tplayers.default_mesh()
    rows = [9, 1, 9][rank]  # the middle shard cannot supply a 2-row halo
    layers = [
        tplayers.DistributedMaxPool2d(5, 1, 2, mesh=mesh),
        tplayers.DistributedAvgPool1d(5, 1, 2, mesh=mesh),
        tplayers.DistributedConv3d(2, 2, 5, padding=2, mesh=mesh),
        tplayers.DistributedConvTranspose2d(2, 2, 5, padding=2, mesh=mesh),
        tplayers.DistributedAdaptiveMaxPool1d(4, mesh=mesh),
    ]
    shapes = [(1, 2, rows, 4), (1, 2, rows), (1, 2, rows, 3, 3), (1, 2, rows, 4), (1, 2, [2, 1, 16][rank])]
    for layer, shape in zip(layers, shapes):
        try:
            layer(torch.randn(shape))
        except ValueError as e:
            assert re.search(r"holds 1 rows .* halo of \d+ rows", str(e)), (layer, e)
        else:
            raise AssertionError(f"{layer} did not raise")
    # wrong number of dims on one rank: every rank raises
    pool = tplayers.DistributedMaxPool3d(2, mesh=mesh)
    with pytest.raises(ValueError, match="5-D"):
        pool(torch.randn(1, 2, 4, 4) if rank == 1 else torch.randn(1, 2, 4, 4, 4))
    # ConvTranspose: the serial module's argument checks, before any communication
    with pytest.raises(ValueError, match="output_padding"):
        tplayers.DistributedConvTranspose1d(2, 2, 3, stride=2, output_padding=2, mesh=mesh)
    with pytest.raises(ValueError, match="return_indices"):
        tplayers.DistributedMaxPool2d(2, return_indices=True, mesh=mesh)
    with pytest.raises(TypeError, match="expects nn.MaxPool2d"):
        tplayers.DistributedMaxPool2d.from_module(nn.AvgPool2d(2), mesh=mesh)
    assert pool(torch.randn(1, 2, 4, 4, 4)).shape == (1, 2, 2, 2, 2)  # nobody hangs
    return True


def test_partitions_the_shards_cannot_supply_raise_on_every_rank():
    run_ranks(_partitions, 3, timeout=60)
