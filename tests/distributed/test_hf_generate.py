"""Issue 30 item 6: generate() on a model with a vocab-parallel lm_head (plan_from_transformers(...,
vocab_parallel=True), as the README builds it) produces the serial model's tokens: greedy and, under
one seed, sampled (temperature, top-k), with the KV cache and left padding, and without the cache;
Llama at tp 2 and 4 (uneven vocabulary slices, replicated kv heads) and GPT-2 with its tied head. The decoding forwards
gather the logits (one all-gather of the kept position per step); a plain forward keeps the local
logits, so the vocab-parallel loss trains exactly as before, after generating too. A sequence-parallel
head refuses decoding with a ValueError on every rank."""

import copy

import pytest
import torch
from hf_util import TIGHT, VOCAB, compare_lm, gpt2, llama, require  # noqa: E402

require("transformers")

from harness import run_ranks  # noqa: E402

import tplayers  # noqa: E402

BUILD = {"llama": llama, "gpt2": gpt2}


def _same(model, serial, ids, seed, **kw):
    torch.manual_seed(seed)
    want = serial.generate(ids, **kw)
    torch.manual_seed(seed)
    with tplayers.count_collectives() as log:
        got = model.generate(ids, **kw)
    assert torch.equal(got, want), (got, want)
    assert got.shape[1] == ids.shape[1] + kw["max_new_tokens"]
    return got, log


def _generate(rank, world, kind):
    mesh = tplayers.default_mesh()
    serial = BUILD[kind]().eval()
    model = copy.deepcopy(serial)
    model = tplayers.parallelize_module(
        model, tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=True), mesh=mesh
    )
    assert not model.lm_head.gather_output
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    local = tplayers.shard_sizes(VOCAB, world)[rank]
    assert model(ids).logits.shape[-1] == local  # a plain forward: the local logits
    assert model(ids, logits_to_keep=0).logits.shape[-1] == local  # 0 keeps every position: a plain forward
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, serial(ids, logits_to_keep=1).logits, **TIGHT)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on the second row
    base = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    greedy, log = _same(model, serial, ids, 0, do_sample=False, **base)
    gathers = [r for r in log.records if r.kind == "all_gather" and r.tag == "gather.fwd"]
    assert len(gathers) == 6  # one all-gather per decoding step, of the kept position's logits only
    assert all(r.nbytes == 2 * max(tplayers.shard_sizes(VOCAB, world)) * world * 8 for r in gathers)
    sampled, _ = _same(model, serial, ids, 7, do_sample=True, temperature=0.7, top_k=8, **base)
    uncached, _ = _same(model, serial, ids, 3, do_sample=True, use_cache=False, **base)
    assert not model.lm_head.gather_output  # restored after every decoding forward
    model.train(), serial.train()
    compare_lm(serial, model, mesh, vocab_parallel=True, steps=1)  # the local logits and loss as before
    return greedy.tolist(), sampled.tolist(), uncached.tolist()


@pytest.mark.parametrize("kind, world", [("llama", 2), ("llama", 4), ("gpt2", 2)])
def test_generate_with_a_vocab_parallel_head(kind, world):
    out = run_ranks(_generate, world, args=(kind,), timeout=180)
    assert all(o == out[0] for o in out)  # every rank the same (serial) tokens


def _sequence_parallel(rank, world):
    mesh = tplayers.default_mesh()
    model = llama().eval()
    plan = tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=True, sequence_parallel=True)
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    ids = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError) as info:
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not model.lm_head.gather_output
    return str(info.value)


def test_generate_refused_with_a_sequence_parallel_head():
    out = run_ranks(_sequence_parallel, 2, timeout=120)
    assert out[0] == out[1] and "sequence-parallel 'lm_head'" in out[0]
