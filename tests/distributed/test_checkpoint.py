"""Checkpoints across world sizes: reshard matrix, exact byte ranges, corruption corpus, crash mid-save."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from ckpt_util import PLAN, Net, assert_local_equals, parallel_net, serial_net, snapshot
from harness import RankFailure, run_ranks
from safetensors.torch import load_model, save_file

import tplayers
import tplayers.checkpoint.read as read_mod
from tplayers.checkpoint import CheckpointError, gather_state_dict, load_checkpoint, save_checkpoint
from tplayers.checkpoint.format import read_header
from tplayers.checkpoint.layout import local_tensors

SAVE_WORLDS = (1, 2, 3, 4)


def _save(rank, world, path, seed, offset, block_bytes):
    net = tplayers.parallelize_module(serial_net(seed, offset), PLAN)
    save_checkpoint(net, path, block_bytes=block_bytes)
    if world == 2:
        save_checkpoint(net, path + ".consolidated.safetensors", consolidated=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints of the same kind of model saved at 1-4 ranks, a consolidated file and a plain file.

    Each has its own weights (seed, offset) so a load from the wrong one fails.
    The 3-rank one uses 1-byte blocks (every stored row hashed on its own).
    """
    root = tmp_path_factory.mktemp("ckpts")
    cases = []
    for w in SAVE_WORLDS:
        path = str(root / f"w{w}")
        run_ranks(_save, w, args=(path, 10 + w, 0.5 * w, 1 if w == 3 else 1 << 20), timeout=60)
        cases.append((path, 10 + w, 0.5 * w))
    cases.append((str(root / "w2.consolidated.safetensors"), 12, 1.0))
    plain = serial_net(42, 3.0)
    save_file(plain.state_dict(), str(root / "plain.safetensors"))
    cases.append((str(root / "plain.safetensors"), 42, 3.0))
    return root, cases


def _ideal_bytes(net):
    return sum(lt.tensor.numel() * lt.tensor.element_size() for lt in local_tensors(net).values())


def _load_matrix(rank, world, cases):
    for path, seed, offset in cases:
        ref = serial_net(seed, offset).state_dict()
        exact_blocks = path.endswith("w3") or path.endswith(".safetensors")
        for verify in (True, False):
            net = parallel_net()
            res = load_checkpoint(net, path, verify=verify)
            assert_local_equals(net, ref)
            assert res.missing_keys == [] and res.unexpected_keys == []
            if not verify or exact_blocks:  # no whole-block rounding: exactly this rank's bytes
                assert res.bytes_read == _ideal_bytes(net), (path, verify, res.bytes_read, _ideal_bytes(net))
            else:
                assert res.bytes_read >= _ideal_bytes(net)
        full = gather_state_dict(net)
        if rank == 0:
            assert list(full) == list(ref)
            for k in ref:
                assert torch.equal(full[k], ref[k]), k
        else:
            assert full == {}
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reshard_matrix(ckpts, world):
    """Saved at 1, 2, 3, 4 ranks, consolidated, or plain -> loaded at `world` ranks, bitwise equal."""
    _, cases = ckpts
    run_ranks(_load_matrix, world, args=(cases,), timeout=120)


def test_load_into_plain_model_and_consolidated_is_standard(ckpts):
    root, cases = ckpts
    for path, seed, offset in cases:
        net = serial_net(1234)
        load_checkpoint(net, path)  # no process group: a plain single-device model
        ref = serial_net(seed, offset).state_dict()
        for k, v in net.state_dict().items():
            assert torch.equal(v, ref[k]), (path, k)
    # consolidated: exactly the serial state_dict's keys and shapes, loadable by safetensors itself
    path = str(root / "w2.consolidated.safetensors")
    _, header, _ = read_header(path)
    ref = serial_net(12, 1.0).state_dict()
    assert {k: tuple(e["shape"]) for k, e in header.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    plain = serial_net(777)
    load_model(plain, path)
    assert all(torch.equal(plain.state_dict()[k], ref[k]) for k in ref)


# ---------------------------------------------------------------------------
# Exact byte ranges: forbid any read outside what this rank holds
# ---------------------------------------------------------------------------


def _guarded_mapped(allowed, counter):
    """A MappedFile whose every box must lie inside this rank's rows (and counts the bytes it maps)."""

    class Guarded(read_mod.MappedFile):
        def box(self, key, box):
            name = os.path.basename(self.path)
            assert (name, key) in allowed, f"{name}:{key} is not needed by this rank"
            t = super().box(key, box)
            counter[0] += t.numel() * t.element_size()
            if not box:  # a 0-d tensor, read whole
                return t
            dim, lo, hi = allowed[(name, key)]
            a, b = box[dim]
            assert lo <= a and b <= hi, f"read [{a}, {b}) of dim {dim} outside [{lo}, {hi})"
            assert all((x, y) == (0, n) for g, ((x, y), n) in enumerate(zip(box, self.shape(key))) if g != dim), (
                "read part of a dim it needs whole"
            )
            return t

    return Guarded


def _allowed_rows(net, index):
    """{(file, key): (dim, lo, hi)}: the range of the shard dim of each stored piece (natural layout)
    that overlaps this rank's range."""
    allowed = {}
    for key, lt in local_tensors(net).items():
        entry = index["tensors"][key]
        for p in entry["pieces"]:
            if entry["dim"] is None:
                allowed[(p["file"], key)] = (0, 0, entry["shape"][0] if entry["shape"] else 1)
                continue
            assert lt.spec.dim == entry["dim"]
            lo, hi = max(lt.spec.start, p["start"]), min(lt.spec.stop, p["stop"])
            if hi > lo:
                allowed[(p["file"], key)] = (entry["dim"], lo - p["start"], hi - p["start"])
    return allowed


def _guarded_load(rank, world, path):
    net = parallel_net()
    with open(os.path.join(path, "index.json")) as f:
        allowed = _allowed_rows(net, json.load(f))
    counter = [0]
    real_mapped = read_mod.MappedFile
    read_mod.MappedFile = _guarded_mapped(allowed, counter)
    try:
        res = load_checkpoint(net, path, verify=False)
    finally:
        read_mod.MappedFile = real_mapped
    assert counter[0] == res.bytes_read == _ideal_bytes(net)
    return counter[0]


def test_reads_only_owned_rows(ckpts):
    """2 -> 3 and 4 -> 3 ranks: every box mapped stays inside this rank's rows; bytes == ideal."""
    root, _ = ckpts
    for saved in ("w2", "w4"):
        got = run_ranks(_guarded_load, 3, args=(str(root / saved),), timeout=60)
        assert all(b > 0 for b in got)


# ---------------------------------------------------------------------------
# Corruption corpus and model mismatches: every rank raises, nothing changes
# ---------------------------------------------------------------------------


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _edit_index(d, fn):
    p = os.path.join(d, "index.json")
    with open(p) as f:
        idx = json.load(f)
    fn(idx)
    with open(p, "w") as f:
        json.dump(idx, f)


def _corpus(base, consolidated, root):
    f1 = "rank-00001-of-00002.safetensors"
    key = "blocks.0.fc1.weight"  # rows [4, 7) live only in f1 and only rank 1 reads them

    def clone(name):
        d = str(root / name)
        shutil.copytree(base, d)
        return d

    cases = []
    d = clone("truncated")
    os.truncate(os.path.join(d, f1), os.path.getsize(os.path.join(d, f1)) - 7)
    cases.append((d, [f1, "truncated"]))
    d = clone("flip_data")
    prefix, header, _ = read_header(os.path.join(d, f1))
    _flip(os.path.join(d, f1), len(prefix) + header[key]["data_offsets"][0] + 5)
    cases.append((d, [f1, key, "XXH3-128", "rank 1:"]))
    d = clone("flip_header")
    _flip(os.path.join(d, f1), 12)
    cases.append((d, [f1]))
    d = clone("huge_header")
    with open(os.path.join(d, f1), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    cases.append((d, [f1, "header length"]))
    d = clone("bad_json")
    with open(os.path.join(d, "index.json"), "w") as f:
        f.write('{"format": "tplayers.checkpoint", ')
    cases.append((d, ["index.json", "malformed JSON"]))
    d = clone("missing_file")
    os.remove(os.path.join(d, f1))
    cases.append((d, [f1, "missing"]))
    d = clone("traversal")

    def traverse(idx):
        idx["files"]["../" + f1] = idx["files"].pop(f1)
        for t in idx["tensors"].values():
            for p in t["pieces"]:
                if p["file"] == f1:
                    p["file"] = "../" + f1

    _edit_index(d, traverse)
    cases.append((d, ["../" + f1, "path traversal"]))
    d = clone("gap")
    _edit_index(d, lambda idx: idx["tensors"][key]["pieces"][1].update(start=5))
    cases.append((d, [key, "held by no shard"]))
    d = clone("overlap")
    _edit_index(d, lambda idx: idx["tensors"][key]["pieces"][1].update(start=3))
    cases.append((d, [key, "overlaps"]))
    c = str(root / "cons_truncated.safetensors")
    shutil.copy(consolidated, c)
    os.truncate(c, os.path.getsize(c) - 3)
    cases.append((c, ["cons_truncated.safetensors", "truncated"]))
    return cases


def _expect_failure(net, path, needles, **kw):
    before = snapshot(net)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(net, path, **kw)
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"{n!r} not in error: {msg}"
    after = snapshot(net)
    assert all(torch.equal(before[k], after[k]) for k in before), "parameters changed by a failed load"
    return msg


def _corruption_ranks(rank, world, cases, good):
    for path, needles in cases:
        msg = _expect_failure(parallel_net(), path, needles)
        if "rank 1:" in needles:  # only rank 1 read the bad bytes, yet rank 0 raises too
            assert "rank 0:" not in msg
    # model mismatches against a good checkpoint
    _expect_failure(parallel_net(hiddens=(8, 2)), good, ["blocks.0.fc1.weight", "global shape"])
    _expect_failure(parallel_net().double(), good, ["cast=True"])
    wide = tplayers.parallelize_module(serial_net(3, hiddens=(7, 2, 4)), PLAN)
    _expect_failure(wide, good, ["missing", "blocks.2.fc1.weight", "blocks.2.ln.bias", "blocks.2.fc2.bias"])
    res = load_checkpoint(wide, good, strict=False)
    assert len(res.missing_keys) == 6 and res.unexpected_keys == []
    net = parallel_net().double()
    load_checkpoint(net, good, cast=True)
    ref = {k: v.double() if v.is_floating_point() else v for k, v in serial_net(12, 1.0).state_dict().items()}
    assert_local_equals(net, ref)
    return True


def test_corruption_corpus(ckpts, tmp_path):
    root, _ = ckpts
    cases = _corpus(str(root / "w2"), str(root / "w2.consolidated.safetensors"), tmp_path)
    run_ranks(_corruption_ranks, 2, args=(cases, str(root / "w2")), timeout=120)


# ---------------------------------------------------------------------------
# Crash during save
# ---------------------------------------------------------------------------


def _crashing_save(rank, world, path, victim, stage):
    net = tplayers.parallelize_module(serial_net(99, 9.0), PLAN)
    if rank == victim:
        import tplayers.checkpoint.format as fmt
        import tplayers.checkpoint.save as save_mod

        if stage == "write":  # die half-way through this rank's third write
            real, calls = fmt._write_all, [0]

            def dying(fd, data):
                calls[0] += 1
                if calls[0] == 3:
                    real(fd, memoryview(data)[: len(data) // 2])
                    os._exit(17)
                real(fd, data)

            fmt._write_all = dying
        else:  # die just before moving the finished checkpoint into place
            save_mod.commit = lambda tmp, target, **kw: os._exit(17)
    save_checkpoint(net, path)


@pytest.mark.parametrize("victim,stage", [(1, "write"), (0, "commit")])
def test_crash_mid_save_keeps_previous(ckpts, tmp_path, victim, stage):
    root, cases = ckpts
    path = str(tmp_path / "ck")
    shutil.copytree(str(root / "w2"), path)
    with pytest.raises(RankFailure):
        run_ranks(_crashing_save, 2, args=(path, victim, stage), timeout=30, grace=2)
    assert any(n.startswith(".ck.tmp-") for n in os.listdir(tmp_path)), "the save never started"
    net = Net()
    load_checkpoint(net, path)
    ref = serial_net(12, 1.0).state_dict()
    assert all(torch.equal(net.state_dict()[k], ref[k]) for k in ref)


# ---------------------------------------------------------------------------
# 2-D mesh: tensor parallel inside data-parallel replicas (each range written once)
# ---------------------------------------------------------------------------


def _save_2d(rank, world, path):
    mesh = tplayers.init_mesh((2, 2), ("dp", "tp"), device_type="cpu")
    net = tplayers.parallelize_module(serial_net(21, 2.0), PLAN, mesh=mesh["tp"])
    save_checkpoint(net, path)
    return os.path.getsize(os.path.join(path, f"rank-{rank:05d}-of-00004.safetensors"))


def test_dp_replicas_write_each_range_once(tmp_path):
    path = str(tmp_path / "ck2d")
    sizes = run_ranks(_save_2d, 4, args=(path,), timeout=60)
    with open(os.path.join(path, "index.json")) as f:
        idx = json.load(f)
    for key, t in idx["tensors"].items():
        files = [p["file"] for p in t["pieces"]]
        assert len(files) == len(set(files)) and (t["dim"] is None or len(files) <= 2), (key, files)
    # ranks 0 and 1 (dp replica 0) write every sharded piece; 2 and 3 only replicated tensors
    sharded = {p["file"] for t in idx["tensors"].values() if t["dim"] is not None for p in t["pieces"]}
    assert sharded == {"rank-00000-of-00004.safetensors", "rank-00001-of-00004.safetensors"}
    assert min(sizes) > 0
    net = Net()
    load_checkpoint(net, path)
    ref = serial_net(21, 2.0).state_dict()
    assert all(torch.equal(net.state_dict()[k], ref[k]) for k in ref)


# ---------------------------------------------------------------------------
# Saving over a previous checkpoint: the ranks share deleting it, nothing stray remains
# ---------------------------------------------------------------------------


def _overwrite(rank, world, root):
    net = tplayers.parallelize_module(serial_net(5, 1.5), PLAN)
    save_checkpoint(net, os.path.join(root, "ck"))  # replaces a 4-rank checkpoint: 5 old files, 2 deleters
    save_checkpoint(net, os.path.join(root, "file"))  # replaces a consolidated file: a file -> dir swap
    save_checkpoint(net, os.path.join(root, "ck"), block_bytes=64)


def test_overwrite_removes_previous_everywhere(ckpts, tmp_path):
    root, _ = ckpts
    shutil.copytree(str(root / "w4"), str(tmp_path / "ck"))
    shutil.copy(str(root / "w2.consolidated.safetensors"), str(tmp_path / "file"))
    run_ranks(_overwrite, 2, args=(str(tmp_path),), timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["ck", "file"], os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "index.json",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    ref = serial_net(5, 1.5).state_dict()
    for name in ("ck", "file"):
        net = Net()
        load_checkpoint(net, str(tmp_path / name))
        assert all(torch.equal(net.state_dict()[k], ref[k]) for k in ref)
