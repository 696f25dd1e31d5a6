"""Whole GPT-2 and Llama (GQA) models, tensor-parallel vs serial in fp64 (docs/design.md, tensor-parallel linears).

GPT-2: fused c_attn (sections, whole heads), vocab-parallel embedding, lm_head tied to it
(vocab-parallel too, one Parameter), vocab_parallel_cross_entropy with label smoothing and
ignored positions. Llama: 8 query heads, 2 kv heads (replicated on 2 ranks each at tp=4),
fused gate_up, separate or fused q/k/v. Each: forward, backward, one AdamW step, a second
input; every parameter and gradient against this rank's slice of the serial one;
gather_state_dict in the serial layout; collectives counted.
"""

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import assert_local_slices

import tplayers

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
)
from gpt2_tp import GPT2, gpt2_plan  # noqa: E402
from llama_tp import Llama, llama_plan  # noqa: E402

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _batch(gen, b, s, vocab):
    inp = torch.randint(0, vocab, (b, s), generator=gen)
    target = torch.randint(0, vocab, (b, s), generator=gen)
    target[0, :2] = -100  # ignored positions
    return inp, target


def _compare(serial, model, mesh, vocab, smoothing, steps=2):
    """Train both for ``steps`` AdamW steps on the same batches; compare everything each step."""
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    logs = []
    for _ in range(steps):
        inp, target = _batch(gen, 2, 7, vocab)
        ls = F.cross_entropy(serial(inp).reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing)
        with tplayers.count_collectives() as fwd:
            lp = tplayers.vocab_parallel_cross_entropy(model(inp), target, mesh, label_smoothing=smoothing)
        torch.testing.assert_close(lp, ls, **TIGHT)
        with tplayers.count_collectives() as bwd:
            lp.backward()
        ls.backward()
        assert_local_slices(model, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **TIGHT)
        logs.append((fwd.summary(), bwd.summary()))
    full = tplayers.gather_state_dict(model, all_ranks=True)
    ref = serial.state_dict()
    assert list(full) == list(ref)
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], **TIGHT, msg=lambda m: f"{k}: {m}")
    return logs


def _gpt2(rank, world, layers):
    mesh = tplayers.default_mesh()
    torch.manual_seed(3)
    vocab, d, heads = 37, 12, 3  # vocab uneven at 2 and 4 ranks; 3 heads: uneven at 2 ranks, an empty rank at 4
    serial = GPT2(vocab, d, heads, layers, 16).double()
    model = tplayers.parallelize_module(copy.deepcopy(serial), gpt2_plan(d, heads), mesh=mesh)
    assert model.lm_head.weight is model.wte.weight, "the tie must survive parallelize_module"
    assert len(list(model.parameters())) == len(list(serial.parameters()))
    logs = _compare(serial, model, mesh, vocab, smoothing=0.1)
    assert model.lm_head.weight is model.wte.weight
    return logs, tuple(model.h[0].attn.c_attn.local_sections)


@pytest.mark.parametrize("world", [2, 4])
def test_gpt2_fused_qkv_tied_vocab_parallel(world):
    layers = 2
    out = run_ranks(_gpt2, world, args=(layers,), timeout=120)
    heads = tplayers.shard_sizes(3, world)
    for rank, (logs, local_sections) in enumerate(out):
        assert local_sections == (heads[rank] * 4,) * 3
        for fwd, bwd in logs:
            # forward: embedding 1 + (attn c_proj + mlp c_proj) per block + the loss's 2
            assert fwd["all_reduce"][0] == 1 + 2 * layers + 2 and set(fwd) == {"all_reduce"}
            # backward: (c_attn + c_fc) input gradients per block + lm_head's; the loss needs none
            assert bwd == {"all_reduce": (2 * layers + 1, bwd["all_reduce"][1])}


def _llama(rank, world, fused):
    mesh = tplayers.default_mesh()
    torch.manual_seed(4)
    vocab, d, heads, kv, ffn, layers = 29, 16, 8, 2, 11, 2
    serial = Llama(vocab, d, heads, kv, ffn, layers, fused).double()
    model = tplayers.parallelize_module(copy.deepcopy(serial), llama_plan(d, heads, kv, ffn, fused), mesh=mesh)
    logs = _compare(serial, model, mesh, vocab, smoothing=0.0)
    attn = model.layers[0].attn
    k = attn.qkv_proj if fused else attn.k_proj
    return logs, k.weight_ranges


@pytest.mark.parametrize("fused", [False, True], ids=["separate_qkv", "fused_qkv"])
@pytest.mark.parametrize("world", [2, 4])
def test_llama_gqa(world, fused):
    out = run_ranks(_llama, world, args=(fused,), timeout=120)
    layers, hd = 2, 2
    replicas = world > 2  # 2 kv heads on 4 ranks: each kv head on 2 ranks
    for rank, (logs, ranges) in enumerate(out):
        kv_head = rank * 2 // world
        if fused:
            assert ranges[1] == (16 + kv_head * hd, 16 + (kv_head + 1) * hd)
        else:
            assert ranges == ((kv_head * hd, (kv_head + 1) * hd),)
        per_block = (2 if fused else 4) + (2 if replicas and not fused else 1 if replicas else 0)
        for fwd, bwd in logs:
            assert fwd == {"all_reduce": (1 + 2 * layers + 2, fwd["all_reduce"][1])}
            assert bwd == {"all_reduce": (per_block * layers + 1, bwd["all_reduce"][1])}


def _tie_errors(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = GPT2(11, 8, 2, 1, 8).double()
    before = {n: p for n, p in serial.named_parameters(remove_duplicate=False)}
    msgs = []
    bad_plans = [
        {"lm_head": tplayers.ColumnParallel()},  # one side only
        {"wte": tplayers.RowParallel()},  # the other side only
        {"wte": tplayers.ColumnParallel(), "lm_head": tplayers.ColumnParallel()},  # sharded differently
    ]
    for i, plan in enumerate(bad_plans):
        with tplayers.count_collectives() as log:
            with pytest.raises(ValueError, match="tied") as err:
                tplayers.parallelize_module(serial, plan, mesh=mesh)
        msgs.append(str(err.value))
        after = {n: p for n, p in serial.named_parameters(remove_duplicate=False)}
        assert after.keys() == before.keys() and all(after[n] is before[n] for n in before), "model changed"
        assert type(serial.wte) is torch.nn.Embedding and type(serial.lm_head) is torch.nn.Linear
        # one side missing from the plan: refused before any collective; split differently: found
        # while building, and carried to every rank by src_rank's agreement exchange
        assert log.count() == (0 if i < 2 else log.count("all_gather")), log.summary()
    return msgs


def test_plan_breaking_a_tie_raises_naming_both_modules():
    for msgs in run_ranks(_tie_errors, 2, timeout=60):
        for m in msgs:
            assert "lm_head.weight" in m and "wte.weight" in m, m
        assert "not in the plan" in msgs[0] and "not in the plan" in msgs[1]
        assert "differently" in msgs[2]
