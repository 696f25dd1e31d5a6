"""Checkpoints of fused (sections), whole-head and GQA-replicated layers keep the serial layout:
saved at 2 or 4 ranks, loaded at 3 ranks, at 1 and into the plain serial model; CLI reshard/merge."""

import json
import os

import pytest
import torch
from ckpt_util import assert_local_equals
from harness import run_ranks
from safetensors.torch import load_file
from torch import nn

import tplayers
from tplayers.checkpoint import __main__ as cli
from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint

HD = 2


class Fused(nn.Module):
    """Every multi-range kind: fused MQA qkv (8, 1, 1 heads), a lone 2-head kv projection
    (replicated at 3 and 4 ranks), fused gate/up of odd width, o_proj in whole heads,
    a vocab-parallel embedding tied to a column-parallel head."""

    def __init__(self, d=6, vocab=7, ffn=5):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 10 * HD)
        self.k = nn.Linear(d, 2 * HD, bias=False)
        self.gate_up = nn.Linear(d, 2 * ffn)
        self.o = nn.Linear(8 * HD, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight


PLAN = {
    "wte": tplayers.RowParallel(),
    "qkv": tplayers.ColumnParallel(sections=(8 * HD, HD, HD), head_dim=HD),
    "k": tplayers.ColumnParallel(head_dim=HD),
    "gate_up": tplayers.ColumnParallel(sections=(5, 5)),
    "o": tplayers.RowParallel(head_dim=HD),
    "head": tplayers.ColumnParallel(),
}


def serial(seed):
    torch.manual_seed(seed)
    return Fused().double()


def _save(rank, world, path, seed):
    model = tplayers.parallelize_module(serial(seed), PLAN)
    save_checkpoint(model, path)
    return model.qkv.weight_ranges, model.k.weight_ranges


def _load(rank, world, path, seed):
    model = tplayers.parallelize_module(serial(seed + 100), PLAN)  # other weights until loaded
    load_checkpoint(model, path)
    ref = serial(seed).state_dict()
    assert_local_equals(model, ref)
    assert model.head.weight is model.wte.weight
    full = gather_state_dict(model, all_ranks=True)
    assert list(full) == list(ref) and all(torch.equal(full[k], ref[k]) for k in ref)
    return True


@pytest.mark.parametrize("save_world", [2, 4])
def test_fused_gqa_checkpoint_reshards(tmp_path, save_world):
    path = str(tmp_path / "ckpt")
    ranges = run_ranks(_save, save_world, args=(path, save_world), timeout=60)
    if save_world == 4:  # kv heads replicated: ranks 0-1 and 2-3 hold the same rows
        assert ranges[0][1] == ranges[1][1] != ranges[2][1] == ranges[3][1]
    index = json.load(open(os.path.join(path, "index.json")))
    qkv = index["tensors"]["qkv.weight"]
    assert qkv["dim"] == 0 and qkv["shape"] == [20, 6]
    named = [p for p in qkv["pieces"] if "name" in p]
    assert named, "a rank holding several ranges writes named pieces"
    covered = sorted((p["start"], p["stop"]) for p in qkv["pieces"])
    assert covered[0][0] == 0 and covered[-1][1] == 20  # disjoint, tiling (checked by the reader too)
    for world in (3, 1):
        run_ranks(_load, world, args=(path, save_world), timeout=60)
    plain = serial(123)  # single process, no process group: the plain serial model
    load_checkpoint(plain, path)
    ref = serial(save_world).state_dict()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert plain.head.weight is plain.wte.weight


def test_cli_reshard_and_merge_of_fused_checkpoint(tmp_path):
    path, out, merged = str(tmp_path / "c4"), str(tmp_path / "c3"), str(tmp_path / "m.safetensors")
    run_ranks(_save, 4, args=(path, 4), timeout=60)
    assert cli.main(["reshard", path, out, "--world-size", "3"]) == 0
    assert cli.main(["merge", out, merged]) == 0
    ref = serial(4).state_dict()
    got = load_file(merged)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    run_ranks(_load, 3, args=(out, 4), timeout=60)
