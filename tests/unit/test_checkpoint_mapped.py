"""MappedFile: every tensor of a safetensors file, as a view, equals what safetensors reads."""

import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tplayers.checkpoint.format import read_header
from tplayers.checkpoint.mapped import MappedFile


def test_views_equal_safetensors_for_every_dtype_and_alignment(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {  # odd byte counts first, so later tensors start unaligned for their dtype
        "a_u8": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "b_f32": torch.randn(5, 3, generator=g),
        "c_bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "d_f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "e_bool": torch.tensor([True, False, True]),
        "f_i64": torch.tensor(-7),  # 0-d
        "g_empty": torch.empty(0, 4),
        "h_i32": torch.arange(6, dtype=torch.int32).view(3, 2),
    }
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    prefix, header, _ = read_header(path)
    mapped = MappedFile(path, header, len(prefix))
    with safe_open(path, "pt") as f:
        for name in tensors:
            got, want = mapped.tensor(name), f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want) and torch.equal(got, tensors[name]), name
    part = mapped.tensor("b_f32")[1:4, 1:]
    assert torch.equal(part, tensors["b_f32"][1:4, 1:])
    assert torch.equal(mapped.box("b_f32", [(1, 4), (1, 3)]), tensors["b_f32"][1:4, 1:])
    assert mapped.box("b_f32", [(0, 5), (0, 3)]).shape == (5, 3) and mapped.shape("b_f32") == (5, 3)
    assert mapped.box("f_i64", []).item() == -7
    mapped.close()


def test_empty_file_maps(tmp_path):
    path = str(tmp_path / "e.safetensors")
    save_file({"z": torch.empty(0)}, path)
    prefix, header, _ = read_header(path)
    assert MappedFile(path, header, len(prefix)).tensor("z").shape == (0,)


def test_unaligned_tensor_after_odd_bytes(tmp_path):
    """safetensors' writer aligns by sorting; another writer may not: an f32 at byte 3 still reads."""
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [3, 51]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = str(tmp_path / "u.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes([1, 2, 3]) + w.numpy().tobytes())
    prefix, parsed, _ = read_header(path)
    mapped = MappedFile(path, parsed, len(prefix))
    got = mapped.tensor("w")
    assert got.data_ptr() % 4 != 0  # the unaligned path
    assert torch.equal(got, w) and torch.equal(got[1:3, 2:], w[1:3, 2:])
    assert mapped.tensor("a").tolist() == [1, 2, 3]
