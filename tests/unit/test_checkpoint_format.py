"""Single-process checkpoint pieces: file writer, header checks, atomic commit, progress bar, CLI."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from ckpt_util import Net, serial_net
from safetensors import safe_open
from safetensors.torch import load_file

import tplayers.checkpoint.commit as durable
import tplayers.checkpoint.format as fmt
from tplayers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tplayers.checkpoint.__main__ import main
from tplayers.checkpoint.progress import Progress


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("f32", torch.randn(5, 3, generator=g)),
        ("bf16", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
        ("f64", torch.randn(7, generator=g, dtype=torch.float64)),
        ("i64", torch.arange(6).reshape(2, 3)),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 4)),
        ("zero_cols", torch.empty(3, 0)),
    ]


def test_writer_is_standard_safetensors_and_blocks_cover_rows(tmp_path):
    path = str(tmp_path / "a.safetensors")
    items = _tensors()
    size, digest, blocks = fmt.write_file(path, items, {"k": "v"}, block_bytes=16)
    assert size == os.path.getsize(path) and len(digest) == 32  # XXH3-128 by default
    back = load_file(path)
    for name, t in items:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
        rows = t.shape[0] if t.dim() else 1
        k, hexes, band, bands = blocks[name]
        assert len(hexes) == -(-rows // k) and band is None and bands is None
    assert blocks["f32"].block_rows == 1  # a 12-byte row: one row per 16-byte block
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_read_header_rejects_damage(tmp_path):
    path = str(tmp_path / "a.safetensors")
    fmt.write_file(path, _tensors()[:2])
    good = open(path, "rb").read()
    cases = {
        "short": (good[:5], "truncated"),
        "cut": (good[:-1], "truncated"),
        "long": (good + b"\0", "header describes"),
        "huge": ((1 << 50).to_bytes(8, "little") + good[8:], "header length"),
        "json": (good[:8] + b"{" * (len(good) - 8), "malformed header"),
    }
    for name, (data, needle) in cases.items():
        p = str(tmp_path / f"{name}.safetensors")
        open(p, "wb").write(data)
        with pytest.raises(CheckpointError, match=needle):
            fmt.read_header(p)
    with pytest.raises(CheckpointError, match="not found"):
        fmt.read_header(str(tmp_path / "nope.safetensors"))


@pytest.mark.parametrize("exchange", [True, False])
def test_commit_replaces_dirs_and_files(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    for kind in ("dir", "file"):
        target = str(tmp_path / f"t-{kind}")
        for gen in range(3):
            tmp = str(tmp_path / f".t-{kind}.tmp-{gen}")
            if kind == "dir":
                os.makedirs(tmp)
                open(os.path.join(tmp, "x"), "w").write(str(gen))
            else:
                open(tmp, "w").write(str(gen))
            durable.commit(tmp, target)
            got = open(os.path.join(target, "x") if kind == "dir" else target).read()
            assert got == str(gen)
        assert sorted(os.listdir(tmp_path)) == sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))


def test_overwriting_a_mapped_consolidated_file_is_safe(tmp_path):
    path = str(tmp_path / "m.safetensors")
    a, b = serial_net(1), serial_net(2)
    save_checkpoint(a, path, consolidated=True)
    with safe_open(path, "pt") as f:
        mapped = f.get_slice("head.weight")[0:5]  # lazily mapped from the old file
        save_checkpoint(b, path, consolidated=True)
        assert torch.equal(mapped, a.head.weight.detach())
    assert torch.equal(load_file(path)["head.weight"], b.head.weight.detach())


def test_progress_bar_draws_only_when_enabled():
    out = io.StringIO()
    bar = Progress(200, "save x", True, stream=out)
    bar.update(100)
    bar.update(100)
    bar.close()
    assert "save x" in out.getvalue() and "100%" in out.getvalue()
    quiet = io.StringIO()
    Progress(1 << 40, "save", None, stream=quiet).update(1 << 40)  # not a tty: no bar
    assert quiet.getvalue() == ""


def test_save_rejects_bad_block_bytes(tmp_path):
    with pytest.raises(ValueError, match="block_bytes"):
        save_checkpoint(Net(), str(tmp_path / "c"), block_bytes=0)


def test_unknown_index_version(tmp_path):
    path = str(tmp_path / "c")
    save_checkpoint(serial_net(0), path)
    idx = json.load(open(os.path.join(path, "index.json")))
    idx["version"] = 99
    json.dump(idx, open(os.path.join(path, "index.json"), "w"))
    with pytest.raises(CheckpointError, match="unsupported version 99"):
        load_checkpoint(Net(), path)


def test_cli_inspect_merge_reshard(tmp_path, capsys):
    src = str(tmp_path / "c")
    save_checkpoint(serial_net(5, 1.0), src, block_bytes=64)
    assert main(["inspect", src, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.fc1.weight" in out and "F32" in out and "verified" in out
    assert main(["reshard", src, str(tmp_path / "c3"), "--world-size", "3"]) == 0
    idx = json.load(open(tmp_path / "c3" / "index.json"))
    assert idx["world_size"] == 3 and len(idx["files"]) == 3
    assert main(["merge", str(tmp_path / "c3"), str(tmp_path / "m.safetensors")]) == 0
    ref = serial_net(5, 1.0).state_dict()
    merged = load_file(str(tmp_path / "m.safetensors"))
    assert set(merged) == set(ref) and all(torch.equal(merged[k], ref[k]) for k in ref)
    # a flipped data byte is caught by --verify and reported as an error, not a traceback
    f = str(tmp_path / "c3" / "rank-00002-of-00003.safetensors")
    data = bytearray(open(f, "rb").read())
    data[-2] ^= 0xFF
    open(f, "wb").write(bytes(data))
    assert main(["inspect", str(tmp_path / "c3"), "--verify"]) == 1
    assert "XXH3-128" in capsys.readouterr().err
    proc = subprocess.run(
        [sys.executable, "-m", "tplayers.checkpoint", "inspect", str(tmp_path / "m.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "head.weight" in proc.stdout


def test_writer_stages_strided_tensors_in_chunks(tmp_path, monkeypatch):
    """Strided views (transposes, movedim views, narrowed blocks) cut into many chunks: same bytes, same digests."""
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 96)
    g = torch.Generator().manual_seed(1)
    views = [
        ("t", torch.randn(5, 13, generator=g).t()),
        ("c", torch.randn(11, 3, generator=g)),
        ("u", torch.randn(3, 4, 6, generator=g).movedim(2, 0)),
        ("t2", torch.randn(9, 7, generator=g).t()),
    ]
    dense = [(k, v.contiguous()) for k, v in views]
    got = fmt.write_file(str(tmp_path / "a.safetensors"), views, block_bytes=40)
    want = fmt.write_file(str(tmp_path / "b.safetensors"), dense, block_bytes=40)
    assert got == want and all(len(got[2][k].digests) > 1 for k, _ in views)
    assert open(tmp_path / "a.safetensors", "rb").read() == open(tmp_path / "b.safetensors", "rb").read()
    back = load_file(str(tmp_path / "a.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in dense)


def test_band_digests_cover_each_band_in_row_major_order(tmp_path):
    """A piece sharded on dim d > 0 is also hashed in bands along d: the digest of band j is the digest of
    that band made contiguous; the file digest covers the bands too."""
    from tplayers.checkpoint.blocks import band_width, bands, byte_view
    from tplayers.checkpoint.digest import block_digest

    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 23, 3, generator=g, dtype=torch.float64)
    items = [("w", full[:, 4:17]), ("v", torch.randn(4, 30, generator=g))]  # a narrowed (strided) piece
    path = str(tmp_path / "a.safetensors")
    size, digest, hashed = fmt.write_file(path, items, block_bytes=200, band_dims={"w": 1, "v": 1})
    xxh = block_digest("xxh3_128")
    for name, t in items:
        width = band_width(t.shape, 1, t.element_size(), 200)
        assert hashed[name].band == width and 1 <= width < t.shape[1]
        assert hashed[name].band_digests == [xxh(byte_view(b.contiguous())).hex() for b in bands(t, 1, width)]
    _, plain, _ = fmt.write_file(str(tmp_path / "b.safetensors"), items, block_bytes=200)
    assert plain != digest  # same bytes, but the band digests are part of the file digest
    assert torch.equal(load_file(path)["w"], items[0][1])


def test_module_doctests():
    import doctest

    import tplayers.checkpoint.index as index
    import tplayers.checkpoint.pagecache as pagecache

    for mod in (index, pagecache):
        result = doctest.testmod(mod)
        assert result.attempted >= 1 and result.failed == 0, (mod.__name__, result)
