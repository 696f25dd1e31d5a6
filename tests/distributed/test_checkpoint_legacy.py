"""Checkpoints written before the natural layout (index version 2: pieces of tensors sharded on dim > 0
stored shard dim first, 48-byte hash blocks) still load exactly at any world size, and corruption in a
transposed piece is still caught on every rank with the model unchanged.

The fixture ``tests/data/ckpt_v2_shard_dim_first`` was written by tplayers 0.x at 2 ranks from
``ckpt_util.serial_net(5)`` under ``ckpt_util.PLAN``; ``ckpt_v2_expected.safetensors`` holds that
serial model's state dict.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckpt_util import assert_local_equals, parallel_net, serial_net, snapshot
from harness import run_ranks
from tplayers.checkpoint import CheckpointError, load_checkpoint
from tplayers.checkpoint.format import read_header

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
FIXTURE = os.path.join(DATA, "ckpt_v2_shard_dim_first")
EXPECTED = os.path.join(DATA, "ckpt_v2_expected.safetensors")


def test_fixture_is_the_old_layout():
    idx = json.load(open(os.path.join(FIXTURE, "index.json")))
    assert idx["version"] == 2 and idx["world_size"] == 2 and idx["block_bytes"] == 48
    _, header, meta = read_header(os.path.join(FIXTURE, "rank-00001-of-00002.safetensors"))
    assert meta["layout"] == "shard-dim-first"
    assert header["blocks.0.fc2.weight"]["shape"] == [3, 6]  # columns [4, 7) of a (6, 7) weight, stored transposed


def _load(rank, world, good, bad):
    want = load_file(EXPECTED)
    net = parallel_net() if world > 1 else serial_net(999)
    for verify in (True, False):
        load_checkpoint(net, good, verify=verify)
        assert_local_equals(net, want)
    fresh = parallel_net(7) if world > 1 else serial_net(7)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match="blocks.0.fc2.weight"):
        load_checkpoint(fresh, bad)
    after = fresh.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed the model"
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_version_2_checkpoints_load_at_any_world_size(tmp_path, world):
    bad = str(tmp_path / "bad")
    shutil.copytree(FIXTURE, bad)
    f1 = os.path.join(bad, "rank-00001-of-00002.safetensors")
    prefix, header, _ = read_header(f1)
    begin, _ = header["blocks.0.fc2.weight"]["data_offsets"]
    with open(f1, "r+b") as f:  # a bit of stored row 0 = global column 4, which every layout reads
        f.seek(len(prefix) + begin + 1)
        b = f.read(1)
        f.seek(len(prefix) + begin + 1)
        f.write(bytes([b[0] ^ 0x04]))
    if world == 1:
        assert _load(0, 1, FIXTURE, bad)
    else:
        run_ranks(_load, world, args=(FIXTURE, bad), timeout=60)
