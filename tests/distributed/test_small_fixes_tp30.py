"""Issue 30 item 8: explain() counts a tied matrix's saving once (its totals equal the parallelized
model's real parameter bytes per rank); save_checkpoint(..., consolidated=True) into a folder that does
not exist creates it (and a plain model loads the file)."""

import copy
import os

import torch
from harness import run_ranks
from torch import nn

import tplayers


class TiedLM(nn.Module):
    def __init__(self, vocab=37, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)))


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _explain_ties(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = TiedLM().double()
    plan = {"emb": tplayers.RowParallel(), "head": tplayers.ColumnParallel(gather_output=True)}
    table = tplayers.explain(serial, plan, mesh, print_table=False)
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    assert model.head.weight is model.emb.weight
    assert table.total_before == _param_bytes(serial)
    assert table.total_after == _param_bytes(model), (table.total_after, _param_bytes(model))
    return table.total_before, table.total_after


def test_explain_counts_a_tied_matrix_once():
    out = run_ranks(_explain_ties, 2, timeout=60)
    before, after = out[0]
    table = 37 * 8 * 8  # the tied matrix, fp64
    assert before - after == table - tplayers.shard_sizes(37, 2)[0] * 8 * 8  # its saving, once


def _consolidated_new_folder(rank, world, root):
    torch.manual_seed(0)
    serial = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"0": tplayers.ColumnParallel(), "1": tplayers.RowParallel()}
    )
    path = os.path.join(root, "does", "not", "exist", "model.safetensors")
    tplayers.save_checkpoint(model, path, consolidated=True)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    tplayers.load_checkpoint(plain, path)
    return all(torch.equal(plain.state_dict()[k], v) for k, v in serial.state_dict().items())


def test_consolidated_save_creates_its_folder(tmp_path):
    assert run_ranks(_consolidated_new_folder, 2, args=(str(tmp_path),), timeout=60) == [True, True]
