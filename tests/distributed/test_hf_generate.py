"""Issue 30 item 6: generate() on a model with a vocab-parallel lm_head (plan_from_transformers(...,
vocab_parallel=True), as the README builds it) raises ValueError on every rank naming the fix (was: a
gloo abort); with ``lm_head.gather_output = True`` it produces the serial model's greedy tokens (KV
cache, left padding), and back at False the vocab-parallel loss trains exactly as before."""

import copy

import torch
from hf_util import VOCAB, compare_lm, llama, require  # noqa: E402

require("transformers")

from harness import run_ranks  # noqa: E402

import tplayers  # noqa: E402


def _generate(rank, world):
    mesh = tplayers.default_mesh()
    serial = llama().eval()
    model = copy.deepcopy(serial)
    model = tplayers.parallelize_module(
        model, tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=True), mesh=mesh
    )
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on the second row
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        model.generate(ids, **kw)
        message = None
    except ValueError as e:
        message = str(e)
    model.lm_head.gather_output = True
    got = model.generate(ids, **kw)
    want = serial.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
    model.lm_head.gather_output = False
    model.train(), serial.train()
    compare_lm(serial, model, mesh, vocab_parallel=True, steps=1)
    return message, got.tolist()


def test_generate_with_a_vocab_parallel_head():
    out = run_ranks(_generate, 2, timeout=120)
    assert out[0] == out[1]
    message, tokens = out[0]
    assert message is not None and "vocab-parallel 'lm_head'" in message and "gather_output = True" in message
    assert len(tokens[0]) > 5  # new tokens (equal to the serial model's, checked on every rank)
