"""Fuzzing both checkpoint readers: whatever the header or index holds, only CheckpointError escapes.

A few seconds by default; longer on demand:
``TPLAYERS_FUZZ_EXAMPLES=5000 pytest tests/unit/test_checkpoint_fuzz.py``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import tempfile

from ckpt_util import serial_net
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tplayers.checkpoint.__main__ import inspect, main
from tplayers.checkpoint.index import index_digest

EXAMPLES = int(os.environ.get("TPLAYERS_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("TPLAYERS_FUZZ_EXAMPLES"),
    suppress_health_check=list(HealthCheck),
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


DEEP = "@@deep@@"  # replaced by 3000 nested arrays in the serialised text (json itself cannot build it)


def _dumps(doc) -> bytes:
    return json.dumps(doc).replace(json.dumps(DEEP), "[" * 3000 + "]" * 3000).encode()


def _mutate(doc, data):
    """Replace one value somewhere in ``doc`` (a JSON tree) by random JSON, or nest it deeply."""
    node, depth = doc, 0
    while isinstance(node, (dict, list)) and node and depth < 8:
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or data.draw(st.booleans()):
            if data.draw(st.integers(0, 9)) == 0:
                value = DEEP if data.draw(st.booleans()) else "x"
            else:
                value = data.draw(JSON)
            node[key] = value
            return
        node, depth = child, depth + 1


def _model_and_files():
    root = tempfile.mkdtemp(prefix="tpl-fuzz-")
    save_checkpoint(serial_net(0), os.path.join(root, "ckpt"))
    save_checkpoint(serial_net(0), os.path.join(root, "one.safetensors"), consolidated=True)
    return root


ROOT = None


def _root():
    global ROOT
    if ROOT is None:
        ROOT = _model_and_files()
    return ROOT


def _expect_only_checkpoint_errors(path):
    """Load (strict and not) and inspect: succeed, or raise CheckpointError naming ``path``'s file."""
    for strict in (True, False):
        try:
            load_checkpoint(serial_net(1), path, strict=strict)
        except CheckpointError as e:
            assert os.path.basename(path.rstrip("/")) in str(e) or "index.json" in str(e) or ".safetensors" in str(e), (
                str(e)
            )
    try:
        inspect(path, verify=True, out=io.StringIO())
    except CheckpointError:
        pass


@FUZZ
@given(st.data())
def test_fuzz_safetensors_header(data):
    src = os.path.join(_root(), "one.safetensors")
    raw = open(src, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    _mutate(header, data)
    text = _dumps(header)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "fuzzed.safetensors")
        open(path, "wb").write(struct.pack("<Q", len(text)) + text + body)
        _expect_only_checkpoint_errors(path)


@FUZZ
@given(st.data())
def test_fuzz_index(data):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        shutil.copytree(os.path.join(_root(), "ckpt"), path)
        index = json.load(open(os.path.join(path, "index.json")))
        _mutate(index, data)
        if isinstance(index, dict) and data.draw(st.booleans()):  # re-sign, so structure checks are reached
            index["index_sha256"] = index_digest(index)
        open(os.path.join(path, "index.json"), "wb").write(_dumps(index))
        _expect_only_checkpoint_errors(path)


def test_reported_malformed_inputs(tmp_path, capsys):
    """The cases seen in the field, each a CheckpointError naming the file, and one CLI line."""
    shutil.copytree(os.path.join(_root(), "ckpt"), tmp_path / "ckpt")
    index_path = tmp_path / "ckpt" / "index.json"
    good = json.loads(index_path.read_text())
    key = sorted(good["tensors"])[0]

    def with_index(edit):
        idx = json.loads(json.dumps(good))
        edit(idx)
        idx["index_sha256"] = index_digest(idx)
        index_path.write_text(json.dumps(idx))

    for edit in (
        lambda i: i["tensors"][key]["pieces"][0].update(file=["a"]),  # non-string piece file
        lambda i: i.update(block_bytes="x"),
    ):  # block_bytes: "x"
        with_index(edit)
        try:
            load_checkpoint(serial_net(1), str(tmp_path / "ckpt"))
            raise AssertionError("loaded a malformed index")
        except CheckpointError as e:
            assert "index.json" in str(e)
        assert main(["inspect", str(tmp_path / "ckpt")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    index_path.write_text("[" * 100000 + "]" * 100000)  # deeply nested JSON
    assert main(["inspect", str(tmp_path / "ckpt")]) == 1
    assert "index.json" in capsys.readouterr().err
    raw = open(os.path.join(_root(), "one.safetensors"), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    for edit in (
        lambda h: h[sorted(k for k in h if k != "__metadata__")[0]].update(data_offsets=["0", "4"]),  # strings
        lambda h: h.update(__metadata__=[1, 2]),
    ):  # non-string metadata
        header = json.loads(raw[8 : 8 + n])
        edit(header)
        text = json.dumps(header).encode()
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
        for argv in (
            ["inspect", str(bad)],
            ["merge", str(bad), str(tmp_path / "m.safetensors")],
            ["reshard", str(bad), str(tmp_path / "r"), "--world-size", "2"],
        ):
            assert main(argv) == 1, argv
            err = capsys.readouterr().err
            assert "bad.safetensors" in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_cli_refuses_to_overwrite_user_data(tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("precious")
    for argv in (
        ["merge", os.path.join(_root(), "ckpt"), str(user)],
        ["reshard", os.path.join(_root(), "ckpt"), str(user), "--world-size", "2"],
    ):
        assert main(argv) == 1
        assert "refusing" in capsys.readouterr().err
    assert (user / "thesis.tex").read_text() == "precious" and sorted(os.listdir(user)) == ["thesis.tex"]
