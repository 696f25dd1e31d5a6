"""Checkpoint saves never destroy user data; an edited index is an error, not wrong weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ckpt_util import PLAN, assert_local_equals, parallel_net, serial_net
from harness import run_ranks

import tplayers
from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def _tree(path: str) -> dict:
    """Every file and folder under ``path`` with its bytes (what must survive a refused save)."""
    if os.path.islink(path):
        return {"<link>": os.readlink(path)}
    if os.path.isfile(path):
        return {"<file>": open(path, "rb").read()}
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path) + "/"] = None
        for f in files:
            out[os.path.relpath(os.path.join(root, f), path)] = open(os.path.join(root, f), "rb").read()
    return out


def _foreign(root: str) -> dict:
    """User data a save must refuse to replace, by case name."""
    cases = {}
    d = os.path.join(root, "runs_with_file")
    os.makedirs(d)
    open(os.path.join(d, "notes.txt"), "w").write("my experiment notes")
    cases["dir with a file"] = d
    d = os.path.join(root, "runs_with_subfolder")
    os.makedirs(os.path.join(d, "sub"))
    open(os.path.join(d, "sub", "data.bin"), "wb").write(b"\x00\x01")
    open(os.path.join(d, "top.txt"), "w").write("top")
    cases["dir with a subfolder"] = d
    f = os.path.join(root, "runs.txt")
    open(f, "w").write("not a safetensors file")
    cases["non-safetensors file"] = f
    link = os.path.join(root, "latest")
    os.symlink(cases["dir with a file"], link)
    cases["symlink"] = link
    return cases


def _refused_saves(rank, world, cases, ckpt_plus):
    net = tplayers.parallelize_module(serial_net(1), PLAN)
    messages = {}
    for name, path in list(cases.items()) + [("checkpoint plus user file", ckpt_plus)]:
        for consolidated in (False, True):
            with pytest.raises(CheckpointError) as info:
                save_checkpoint(net, path, consolidated=consolidated)
            messages[(name, consolidated)] = str(info.value)
    return messages


def _allowed_saves(rank, world, empty_dir, empty_dir2, old_file):
    net = tplayers.parallelize_module(serial_net(2), PLAN)
    save_checkpoint(net, empty_dir)  # an empty folder the user made first
    save_checkpoint(net, empty_dir2, consolidated=True)  # ... or a consolidated file into its place
    save_checkpoint(net, old_file)  # a previous consolidated checkpoint
    for path in (empty_dir, empty_dir2, old_file):
        fresh = parallel_net()
        load_checkpoint(fresh, path)
        assert_local_equals(fresh, serial_net(2).state_dict())
    return True


def test_save_refuses_to_replace_user_data(tmp_path):
    cases = _foreign(str(tmp_path))
    ckpt_plus = str(tmp_path / "ckpt_plus")
    run_ranks(
        lambda r, w: save_checkpoint(tplayers.parallelize_module(serial_net(0), PLAN), ckpt_plus) or True, 2, timeout=60
    )
    open(os.path.join(ckpt_plus, "README.md"), "w").write("the user's own notes beside a checkpoint")
    before = {name: _tree(p) for name, p in list(cases.items()) + [("ckpt_plus", ckpt_plus)]}
    outs = run_ranks(_refused_saves, 2, args=(cases, ckpt_plus), timeout=60)
    for rank, messages in enumerate(outs):  # every rank raised, for every case and both forms
        assert len(messages) == 2 * (len(cases) + 1)
        for (name, consolidated), msg in messages.items():
            assert "refusing to replace it" in msg, (rank, name, msg)
        assert "notes.txt" in messages[("dir with a file", False)]
        assert "'sub'" in messages[("dir with a subfolder", True)]
        assert "symlink" in messages[("symlink", False)]
        assert "README.md" in messages[("checkpoint plus user file", False)]
    after = {name: _tree(p) for name, p in list(cases.items()) + [("ckpt_plus", ckpt_plus)]}
    assert after == before, "a refused save changed user data"
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["runs_with_file", "runs_with_subfolder", "runs.txt", "latest", "ckpt_plus"]
    ), "a refused save left temporary files behind"


def test_save_onto_empty_dir_and_old_consolidated_file(tmp_path):
    empty, empty2 = str(tmp_path / "empty"), str(tmp_path / "empty2")
    os.makedirs(empty)
    os.makedirs(empty2)
    old = str(tmp_path / "old.safetensors")
    save_checkpoint(serial_net(5), old, consolidated=True)
    run_ranks(_allowed_saves, 2, args=(empty, empty2, old), timeout=60)
    assert os.path.isdir(old) and os.path.isfile(empty2)


# ---------------------------------------------------------------------------
# The index digest: an edited index is a CheckpointError naming index.json
# ---------------------------------------------------------------------------


def _edit(src: str, dst: str, fn, redigest: bool = False) -> str:
    shutil.copytree(src, dst)
    p = os.path.join(dst, "index.json")
    idx = json.load(open(p))
    fn(idx)
    if redigest:  # a forger who recomputes the digest: only structure checks can catch it
        from tplayers.checkpoint.index import index_digest

        idx["index_sha256"] = index_digest(idx)
    json.dump(idx, open(p, "w"))
    return dst


def _square_net():
    return tplayers.parallelize_module(serial_net(7, hiddens=(6, 2), d=6), PLAN)


def _index_cases(root: str, base: str) -> list:
    key = "blocks.0.fc1.weight"  # (6, 6) column-parallel: a square weight, sharded along dim 0

    def swap_ranges(idx):
        a, b = idx["tensors"][key]["pieces"]
        a["file"], b["file"] = b["file"], a["file"]
        a["digests"], b["digests"] = b["digests"], a["digests"]
        a["block_rows"], b["block_rows"] = b["block_rows"], a["block_rows"]

    return [
        _edit(base, os.path.join(root, "dim"), lambda idx: idx["tensors"][key].update(dim=1)),
        _edit(base, os.path.join(root, "swap"), swap_ranges),
        _edit(base, os.path.join(root, "dtype"), lambda idx: idx["tensors"]["head.bias"].update(dtype="I32")),
        _edit(base, os.path.join(root, "block"), lambda idx: idx.update(block_bytes=7)),
        _edit(base, os.path.join(root, "nodigest"), lambda idx: idx.pop("index_sha256")),
    ]


def _index_ranks(rank, world, cases):
    out = []
    for path in cases:
        for verify in (True, False):
            net = _square_net()
            before = {k: v.clone() for k, v in net.state_dict().items()}
            with pytest.raises(CheckpointError) as info:
                load_checkpoint(net, path, verify=verify)
            assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
            out.append(str(info.value))
    return out


def test_edited_index_is_an_error_on_every_rank(tmp_path):
    base = str(tmp_path / "base")
    run_ranks(lambda r, w: save_checkpoint(_square_net(), base) or True, 2, timeout=60)
    cases = _index_cases(str(tmp_path), base)
    outs = run_ranks(_index_ranks, 2, args=(cases,), timeout=60)
    for msgs in outs:
        assert len(msgs) == 2 * len(cases)
        for i, m in enumerate(msgs):
            # dim 0 -> 1 also drops the band digests a version-3 piece sharded on dim 1 must list
            why = "band / band_digests malformed" if i < 2 else "digest mismatch"
            assert "index.json" in m and why in m, m


def test_sha256_option_loads_and_catches_corruption(tmp_path):
    base = str(tmp_path / "sha")
    save_checkpoint(serial_net(3), base, digest="sha256")
    assert json.load(open(os.path.join(base, "index.json")))["digest"] == "sha256"
    net = serial_net(9)
    load_checkpoint(net, base)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), serial_net(3).state_dict().values()))
    # a flipped data byte is caught, and named by its algorithm
    f = os.path.join(base, "rank-00000-of-00001.safetensors")
    data = bytearray(open(f, "rb").read())
    data[-3] ^= 0xFF
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(serial_net(9), base)
    with pytest.raises(ValueError, match="digest must be one of"):
        save_checkpoint(serial_net(3), str(tmp_path / "x"), digest="md5")


def test_default_digest_is_xxh3(tmp_path):
    path = str(tmp_path / "c")
    save_checkpoint(serial_net(4), path)
    idx = json.load(open(os.path.join(path, "index.json")))
    assert idx["digest"] == "xxh3_128" and idx["version"] == 3
    piece = next(iter(idx["tensors"].values()))["pieces"][0]
    assert all(len(d) == 32 for d in piece["digests"])
