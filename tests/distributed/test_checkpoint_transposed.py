"""Pieces of a tensor sharded on dim 1 (stored in their natural layout, hashed in row blocks and in column
bands): exact bits at the same and another world size (a 3-rank reader checks the column bands it reads),
corruption in such a piece detected on every rank, and a failed load changes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from harness import run_ranks
from torch import nn

import tplayers
from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tplayers.checkpoint.format import read_header
from tplayers.checkpoint.layout import local_tensors

PLAN = {"0": tplayers.ColumnParallel(), "1": tplayers.RowParallel()}


def _serial(seed: int) -> nn.Module:
    """An MLP whose row-parallel weight pieces span several hash blocks and bands,
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


def _damaged_copy(good: str, bad: str, where, mask: int) -> str:
    """A copy of checkpoint ``good`` with one byte of rank 1's stored 1.weight XORed with ``mask``;
    ``where(begin, end)`` picks its offset from the tensor's data offsets."""
    shutil.copytree(good, bad)
    f1 = os.path.join(bad, "rank-00001-of-00002.safetensors")
    prefix, header, _ = read_header(f1)
    at = len(prefix) + where(*header["1.weight"]["data_offsets"])
    with open(f1, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))
    return bad


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
def test_dim_1_pieces_load_exactly_and_corruption_is_caught(tmp_path, load_world):
    good = str(tmp_path / "ckpt")
    run_ranks(_save, 2, args=(good,), timeout=60)
    _, header, meta = read_header(os.path.join(good, "rank-00001-of-00002.safetensors"))
    assert meta["layout"] == "natural"
    assert header["1.weight"]["shape"] == [64, 300]
    # the last column of rank 1's piece of 1.weight (its last stored bytes): read by every
    # loading layout that holds the last columns, after the blocks or bands before it checked out
    bad = _damaged_copy(good, str(tmp_path / "bad"), lambda begin, end: end - 3, 0x10)
    run_ranks(_load, load_world, args=(good, bad), timeout=90)


def test_resharded_reads_check_only_the_bands_they_touch(tmp_path):
    """A reader holding part of a dim-1 piece's columns reads and checks whole column bands (8 columns of
    the (64, 301) pieces here), never the piece's other bands; a reader of a whole piece checks row blocks."""
    from tplayers.checkpoint.index import open_source
    from tplayers.checkpoint.read import Reader
    from tplayers.sharding import ShardSpec

    path = str(tmp_path / "ck")
    run_ranks(
        lambda r, w: save_checkpoint(tplayers.parallelize_module(_serial(1), PLAN), path, block_bytes=2048) or True,
        2,
        timeout=60,
    )
    want = _serial(1).state_dict()["1.weight"]
    src = open_source(path)
    assert [(p.start, p.stop, p.band) for p in src.tensors["1.weight"].pieces] == [(0, 301, 8), (301, 601, 8)]
    spans = [ShardSpec.balanced((64, 601), 1, 3, r) for r in range(3)] + [ShardSpec.balanced((64, 601), 1, 2, 1)]
    for spec in spans:
        a, b = spec.start, spec.stop
        with Reader(src, verify=True) as r:
            parts = r.plan("1.weight", 1, a, b)
            got = torch.empty(64, b - a)
            for part, t in r.fetch_all(parts):
                got[part.dest] = t
                whole = (part.piece.start, part.piece.stop) == (max(a, part.piece.start), min(b, part.piece.stop))
                assert part.band_dim == (None if whole else 1)
                cols = part.mapped.shape[1]
                lo = max(a, part.piece.start) - part.piece.start
                hi = min(b, part.piece.stop) - part.piece.start
                assert (
                    cols == part.piece.stop - part.piece.start
                    if whole
                    else cols == min(-(-hi // 8) * 8, part.piece.stop - part.piece.start) - lo // 8 * 8
                )
        assert torch.equal(_bits(got), _bits(want[:, a:b]))
    # flip a bit in column 10 of rank 1's piece (global column 311): a reader of columns [201, 401) reads
    # that band and fails; a reader of columns [401, 601) reads bands from column 96 of the piece on: passes
    bad = _damaged_copy(path, str(tmp_path / "bad"), lambda begin, end: begin + (5 * 300 + 10) * 4 + 2, 0x01)
    src = open_source(bad)
    with Reader(src, verify=True) as r:
        with pytest.raises(CheckpointError, match=r"1.weight.*band 1 \(indices \[8, 16\)"):
            list(r.fetch_all(r.plan("1.weight", 1, 201, 401)))
    with Reader(src, verify=True) as r:
        assert torch.equal(_bits(r.read_box("1.weight", 1, 401, 601)), _bits(want[:, 401:601]))


def _load_exact(rank, world, path):
    net = tplayers.parallelize_module(_serial(2), PLAN)
    load_checkpoint(net, path)
    _assert_exact(net, _serial(1))
    return True


def test_cli_reshard_writes_natural_pieces_with_bands(tmp_path):
    """``python -m tplayers.checkpoint reshard`` writes pieces sharded on dim 1 with their column bands;
    the result loads exactly."""
    import json

    from tplayers.checkpoint.__main__ import main

    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    run_ranks(_save, 2, args=(src,), timeout=60)
    assert main(["reshard", src, out, "--world-size", "3"]) == 0
    idx = json.load(open(os.path.join(out, "index.json")))
    assert idx["layout"] == "natural" and idx["world_size"] == 3
    assert "band" in idx["tensors"]["1.weight"]["pieces"][0]
    run_ranks(_load_exact, 3, args=(out,), timeout=60)
