"""Checkpoint loads through the fast transposing copies: exact bits at the same and another world size,
corruption in a transposed piece still detected on every rank, and a failed load changes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

import tplayers
from harness import run_ranks
from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tplayers.checkpoint.format import read_header
from tplayers.checkpoint.layout import local_tensors

PLAN = {"0": tplayers.ColumnParallel(), "1": tplayers.RowParallel()}


def _serial(seed: int) -> nn.Module:
    """An MLP whose row-parallel weight pieces are large enough for torch's blocked transpose (>= 4096 items),
    holding awkward bit patterns (-0.0, NaN with a payload) that only an exact copy keeps."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 601), nn.Linear(601, 64))
    with torch.no_grad():
        w = net[1].weight.view(-1)
        w[7] = -0.0
        w[8:9].view(torch.int32).fill_(0x7FC0ABCD)  # a NaN with a payload
    return net


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _assert_exact(net: nn.Module, ref: nn.Module) -> None:
    want = ref.state_dict()
    for key, lt in local_tensors(net).items():
        assert torch.equal(_bits(lt.tensor), _bits(lt.spec.take(want[key]))), key


def _save(rank, world, path):
    save_checkpoint(tplayers.parallelize_module(_serial(1), PLAN), path)
    return True


def _load(rank, world, good, bad):
    ref = _serial(1)
    net = tplayers.parallelize_module(_serial(2), PLAN)
    for verify in (True, False):
        load_checkpoint(net, good, verify=verify)
        _assert_exact(net, ref)
    fresh = tplayers.parallelize_module(_serial(3), PLAN)
    before = {k: _bits(v).clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(fresh, bad)
    assert "1.weight" in str(info.value) and "XXH3-128" in str(info.value)
    after = fresh.state_dict()
    assert all(torch.equal(before[k], _bits(after[k])) for k in before), "a failed load changed parameters"
    return True


@pytest.mark.parametrize("load_world", [2, 3])
def test_transposed_pieces_load_exactly_and_corruption_is_caught(tmp_path, load_world):
    good = str(tmp_path / "ckpt")
    run_ranks(_save, 2, args=(good,), timeout=60)
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    f1 = os.path.join(bad, "rank-00001-of-00002.safetensors")
    prefix, header, _ = read_header(f1)
    # the last stored row of rank 1's piece of 1.weight (stored as (in_local, out)): read by every
    # loading layout that holds the last columns, after the blocks before it checked out
    begin, end = header["1.weight"]["data_offsets"]
    with open(f1, "r+b") as f:
        f.seek(len(prefix) + end - 3)
        b = f.read(1)
        f.seek(len(prefix) + end - 3)
        f.write(bytes([b[0] ^ 0x10]))
    run_ranks(_load, load_world, args=(good, bad), timeout=90)
