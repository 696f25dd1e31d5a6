"""One checkpoint format before 1.0: a checkpoint written by an older tplayers is refused, clearly.

Index versions 1 and 2, and version 3 saved with the dropped ``layout="shard-dim-first"``, stored
pieces of tensors sharded on a dim > 0 with that dim moved first. Loading one raises
:class:`CheckpointError` on every rank, before any parameter changes, naming the format and the
way out (re-save with tplayers <= 0.1); the CLI prints the same line and exits 1.

The fixture ``tests/data/ckpt_v2_shard_dim_first`` is a real version-2 checkpoint, written by
tplayers 0.x at 2 ranks from ``ckpt_util.serial_net(5)`` under ``ckpt_util.PLAN``; the version-1 and
the shard-dim-first version-3 indexes are rewritten from fresh saves the way those versions wrote them.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ckpt_util import parallel_net, serial_net, snapshot
from harness import run_ranks

from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tplayers.checkpoint.__main__ import main
from tplayers.checkpoint.index import index_digest, older_format

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
FIXTURE = os.path.join(DATA, "ckpt_v2_shard_dim_first")
WAY_OUT = "re-save it with tplayers <= 0.1"


def _rewrite(src: str, dst: str, fn) -> str:
    shutil.copytree(src, dst)
    p = os.path.join(dst, "index.json")
    idx = json.load(open(p))
    fn(idx)
    json.dump(idx, open(p, "w"))
    return dst


def _as_version_1(idx):
    """A SHA-256 index the way version 1 wrote it: no index digest, no digest name, fields called sha256."""
    idx.pop("index_sha256")
    assert idx.pop("digest") == "sha256"
    idx.pop("layout")
    idx["version"] = 1
    for info in idx["files"].values():
        info["sha256"] = info.pop("digest")
    for t in idx["tensors"].values():
        for p in t["pieces"]:
            p["sha256"] = p.pop("digests")
            p.pop("band", None), p.pop("band_digests", None)


def _as_shard_dim_first(idx):
    """A version-3 index that names the dropped layout, correctly signed (only the layout is refused)."""
    idx["layout"] = "shard-dim-first"
    idx["index_sha256"] = index_digest(idx)


def _refused(rank, world, cases):
    net = parallel_net(7) if world > 1 else serial_net(7)
    before = snapshot(net)
    out = []
    for path, what in cases:
        for verify in (True, False):
            with pytest.raises(CheckpointError) as info:
                load_checkpoint(net, path, verify=verify)
            msg = str(info.value)
            assert f"written by an older tplayers ({what})" in msg and WAY_OUT in msg, msg
            assert "index.json" in msg, msg
            after = net.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the model"
            out.append(msg)
    return out


@pytest.fixture(scope="module")
def old_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("old")
    sha = str(root / "sha")
    save_checkpoint(serial_net(3), sha, digest="sha256")
    cur = str(root / "cur")
    run_ranks(lambda r, w: save_checkpoint(parallel_net(3), cur) or True, 2, timeout=60)
    return [
        (FIXTURE, "format v2"),
        (_rewrite(sha, str(root / "v1"), _as_version_1), "format v1"),
        (_rewrite(cur, str(root / "sdf"), _as_shard_dim_first), "format v3, layout 'shard-dim-first'"),
    ]


def test_fixture_is_a_real_version_2_checkpoint():
    idx = json.load(open(os.path.join(FIXTURE, "index.json")))
    assert idx["version"] == 2 and idx["world_size"] == 2 and index_digest(idx) == idx["index_sha256"]
    assert older_format(idx) is not None and older_format({"version": 3, "layout": "natural"}) is None


@pytest.mark.parametrize("world", [1, 2, 3])
def test_older_formats_are_refused_on_every_rank_with_the_model_unchanged(old_checkpoints, world):
    outs = (
        [_refused(0, 1, old_checkpoints)]
        if world == 1
        else run_ranks(_refused, world, args=(old_checkpoints,), timeout=60)
    )
    assert len(outs) == world and all(len(o) == 2 * len(old_checkpoints) for o in outs)
    if world > 1:  # every rank names the same failure (each found it locally; the agreement lists them all)
        assert all(f"checkpoint failed on {world} of {world} rank(s)" in m for o in outs for m in o)


@pytest.mark.parametrize("cmd", ["inspect", "merge", "reshard"])
def test_cli_says_written_by_an_older_tplayers(old_checkpoints, tmp_path, capsys, cmd):
    for i, (path, what) in enumerate(old_checkpoints):
        out = str(tmp_path / f"out{i}")
        argv = {
            "inspect": [path, "--verify"],
            "merge": [path, out + ".safetensors"],
            "reshard": [path, out, "--world-size", "3"],
        }[cmd]
        assert main([cmd] + argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and f"written by an older tplayers ({what})" in err and WAY_OUT in err, err
        assert not os.path.exists(out) and not os.path.exists(out + ".safetensors")
