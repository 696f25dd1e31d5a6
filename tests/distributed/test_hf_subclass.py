"""Swaps keep what a subclass adds, or refuse it (issue 30 item 3). Gemma2 and Gemma3 (their word
embedding multiplies by sqrt(hidden) in its own forward) from their own plans at tp 2 (and Gemma3 at
4), fp64: loss, every gradient, parameters after SGD steps, with the lm_head tied to the embedding,
gathered logits and vocab-parallel loss. Subclasses of nn.Linear / nn.Embedding / Conv1D whose class
defines its own forward are refused naming the class on every rank; one that only borrows the name
of a known class is refused too; a subclass that does not override forward is swapped."""

import copy

import pytest
import torch
from hf_util import compare_lm, gemma, require  # noqa: E402
from torch import nn

require("transformers")

from harness import run_ranks  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import tplayers  # noqa: E402


def _gemma(rank, world, kind, vocab_parallel):
    mesh = tplayers.default_mesh()
    serial = gemma(kind)
    model = copy.deepcopy(serial)
    plan = tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=vocab_parallel)
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    emb = model.model.embed_tokens
    assert isinstance(emb, tplayers.VocabParallelEmbedding) and float(emb.embed_scale) == 4.0
    assert model.lm_head.weight is emb.weight  # the tie kept
    assert "embed_scale" not in model.state_dict() and "model.embed_tokens.embed_scale" not in model.state_dict()
    # Gemma3RMSNorm computes in float32 even in an fp64 model (.float(), then back): its q_norm / k_norm
    # (one RMSNorm over every head, gradients summed over the ranks' heads) sum their gradients in
    # float32 in a different order than the serial model, and every norm output after that is rounded
    # to float32. So Gemma3 is compared at float32 level (1e-5) after its first forward (exact, TIGHT);
    # a lost embedding scale is 3e-2 off.
    tol = dict(rtol=1e-5, atol=1e-7) if kind == "gemma3" else None
    return compare_lm(serial, model, mesh, vocab_parallel=vocab_parallel, tol=tol)


@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["gathered_logits", "vocab_parallel_loss"])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_from_its_own_plan(kind, vocab_parallel):
    out = run_ranks(_gemma, 2, args=(kind, vocab_parallel), timeout=120)
    assert out[0] == out[1]


def test_gemma3_at_4_ranks():
    run_ranks(_gemma, 4, args=("gemma3", True), timeout=120)


class Scaled(nn.Embedding):  # a user's own subclass: output 4x
    def forward(self, ids):
        return super().forward(ids) * 4.0


class FakeScaledWordEmbedding(nn.Embedding):  # borrows a known name, does something else
    def __init__(self, *args):
        super().__init__(*args)
        self.embed_scale = nn.Buffer(torch.tensor(2.0), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale + 1


class CastLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


class BiasConv1D(Conv1D):
    def forward(self, x):
        return super().forward(x) + 1


class PlainLinear(nn.Linear):  # no forward of its own: swapped as an nn.Linear
    pass


def _refusals(rank, world):
    mesh = tplayers.default_mesh()
    msgs = []
    cases = [
        (Scaled(10, 4), tplayers.RowParallel()),
        (Scaled(10, 4), tplayers.ColumnParallel()),
        (FakeScaledWordEmbedding(10, 4), tplayers.RowParallel()),
        (CastLinear(4, 6), tplayers.ColumnParallel()),
        (BiasConv1D(6, 4), tplayers.RowParallel()),
    ]
    for module, style in cases:
        model = nn.Sequential(nn.Identity(), module)
        with pytest.raises(ValueError) as info:
            tplayers.parallelize_module(model, {"1": style}, mesh=mesh)
        assert model[1] is module  # nothing changed
        msgs.append(str(info.value))
    torch.manual_seed(0)
    serial = nn.Sequential(PlainLinear(4, 6))
    model = tplayers.parallelize_module(copy.deepcopy(serial), {"0": tplayers.ColumnParallel(gather_output=True)})
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), serial(x))
    return msgs


def test_subclasses_with_their_own_forward_are_refused_on_every_rank():
    out = run_ranks(_refusals, 2, timeout=60)
    assert out[0] == out[1]
    scaled_row, scaled_col, fake, cast, conv = out[0]
    assert "class test_hf_subclass.Scaled" in scaled_row and "replaces nn.Embedding's" in scaled_row
    assert "RowParallel would swap module '1'" in scaled_row and "ColumnParallel" in scaled_col
    assert "FakeScaledWordEmbedding" in fake
    assert "CastLinear" in cast and "replaces nn.Linear's" in cast
    assert "BiasConv1D" in conv and "replaces Conv1D's" in conv
