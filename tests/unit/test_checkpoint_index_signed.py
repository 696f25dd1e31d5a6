"""The index's digest checked over its bytes as written (no re-serialising), and over its canonical JSON
for an index someone reformatted: both load, any edit is an error."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from ckpt_util import serial_net

from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tplayers.checkpoint.index import _signed_body, open_source


def _saved(tmp_path):
    path = str(tmp_path / "ck")
    save_checkpoint(serial_net(3), path, progress=False)
    with open(os.path.join(path, "index.json"), "rb") as f:
        return path, f.read()


def _write(path, data: bytes) -> None:
    with open(os.path.join(path, "index.json"), "wb") as f:
        f.write(data)


def test_a_saved_index_takes_the_byte_path_and_parses_the_same(tmp_path):
    path, data = _saved(tmp_path)
    signed = _signed_body(data)
    assert signed is not None and signed == json.loads(data)
    net = serial_net(99)
    load_checkpoint(net, path)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), serial_net(3).state_dict().values()))


def test_a_reformatted_index_still_loads_through_its_canonical_json(tmp_path):
    path, data = _saved(tmp_path)
    pretty = json.dumps(json.loads(data), indent=2).encode()
    assert _signed_body(pretty) is None
    _write(path, pretty)
    assert open_source(path).tensors.keys() == json.loads(data)["tensors"].keys()
    net = serial_net(99)
    load_checkpoint(net, path)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), serial_net(3).state_dict().values()))


@pytest.mark.parametrize("pretty", [False, True])
def test_an_edited_digest_byte_is_an_error_either_way(tmp_path, pretty):
    path, data = _saved(tmp_path)
    m = re.search(rb'"digests":\["([0-9a-f])', data)  # the first block digest: still valid hex after the edit
    flipped = b"1" if m.group(1) == b"0" else b"0"
    edited = data[: m.start(1)] + flipped + data[m.end(1) :]
    if pretty:
        edited = json.dumps(json.loads(edited), indent=2).encode()
    assert _signed_body(edited) is None
    _write(path, edited)
    with pytest.raises(CheckpointError, match="index digest mismatch"):
        open_source(path)


def test_the_signature_text_inside_a_value_cannot_take_the_byte_path(tmp_path):
    """A canonical index edited next to an intact signature (a value now holding its text, escaped): the byte
    path declines and the canonical check names the edit."""
    path, data = _saved(tmp_path)
    doc = json.loads(data)
    sig = ',"index_sha256":"' + doc["index_sha256"] + '"'
    doc["convention"] = doc["convention"] + sig  # an edit: the digest no longer matches
    edited = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert _signed_body(edited) is None
    _write(path, edited)
    with pytest.raises(CheckpointError, match="index digest mismatch"):
        open_source(path)


def test_digest_strings_are_checked_together_exactly():
    """The index parser's one pass over every digest string: exact length, lowercase hex only."""
    from tplayers.checkpoint.index import _digest_pool_ok as ok

    h = "0123456789abcdef" * 2
    assert ok([[h, h], [h]], 32) and ok([], 32) and ok([[]], 32)
    bad = [
        [[h.upper()]],
        [[h[:31]]],
        [[h + "0"]],
        [[h[:16] + " " + h[17:]]],
        [[h[:31] + "g"]],
        [[h[:20] + " " + h[20:], h[:31]]],  # a space inside one, another short: the same total length
        [[h, 5]],
        [[h, None]],
        [[h[:30] + "\t0"]],
        [[h, h[:16] + "\u0660" * 16]],
    ]
    for pool in bad:
        assert not ok(pool, 32), pool


def test_a_malformed_digest_string_names_its_tensor(tmp_path):
    """The one-pass check fails, and the slow path names the tensor and the field."""
    path, data = _saved(tmp_path)
    doc = json.loads(data)
    key = sorted(doc["tensors"])[0]
    doc["tensors"][key]["pieces"][0]["digests"][0] = doc["tensors"][key]["pieces"][0]["digests"][0].upper()
    _write(path, json.dumps(doc).encode())
    with pytest.raises(CheckpointError, match=f"tensor {key!r}.*digests must be 32-character lowercase hex"):
        open_source(path)
