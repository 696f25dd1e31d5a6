"""Issue 30 item 2: attention dropout on split heads is refused in training, on every rank, naming the
config field (transformers' attention functions draw the mask per rank for this rank's heads, not the
serial mask's slice). GPT-2 (attn_pdrop, eager and sdpa, hand plan and derived plan) and Llama
(attention_dropout, own plan); eval mode and p = 0 run exactly as before; the hand-written block with
its attention dropout swapped by ShardedDropout (exact) is not refused."""

import copy

import pytest
import torch
from hf_util import TIGHT, VOCAB, gpt2_hand_plan, localize_gpt2_split, require  # noqa: E402

require("transformers")

import transformers  # noqa: E402
from harness import run_ranks  # noqa: E402

import tplayers  # noqa: E402


def _gpt2(attn, pdrop=0.1):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=12, n_layer=2, n_head=3, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=pdrop, bos_token_id=0, eos_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


def _llama(attn, pdrop=0.1):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=22, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=pdrop, attn_implementation=attn,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()


def _refused(rank, world, arch, attn, hand):
    mesh = tplayers.default_mesh()
    serial = _gpt2(attn) if arch == "gpt2" else _llama(attn)
    model = copy.deepcopy(serial)
    plan = gpt2_hand_plan(model) if hand else tplayers.plan_from_transformers(model, mesh=mesh)
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    if hand:
        localize_gpt2_split(model)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    serial.eval(), model.eval()  # eval: no dropout, exact
    torch.testing.assert_close(model(ids).logits, serial(ids).logits, **TIGHT)
    model.train()
    with pytest.raises(ValueError) as info:
        model(ids)
    model.eval()
    torch.testing.assert_close(model(ids).logits, serial(ids).logits, **TIGHT)  # still usable
    return str(info.value)


@pytest.mark.parametrize(
    "arch,attn,hand",
    [("gpt2", "sdpa", False), ("gpt2", "eager", True), ("llama", "sdpa", False), ("llama", "eager", False)],
)
def test_attention_dropout_in_training_is_refused_on_every_rank(arch, attn, hand):
    out = run_ranks(_refused, 2, args=(arch, attn, hand), timeout=120)
    assert out[0] == out[1]
    field = "config.attn_pdrop=0.1" if arch == "gpt2" else "config.attention_dropout=0.1"
    assert field in out[0] and "attention dropout in training on split heads" in out[0]
    assert "'transformer.h.0.attn'" in out[0] or "'model.layers.0.self_attn'" in out[0]


def _zero_p_trains(rank, world):
    mesh = tplayers.default_mesh()
    serial = _llama("sdpa", pdrop=0.0)
    model = copy.deepcopy(serial)
    model = tplayers.parallelize_module(model, tplayers.plan_from_transformers(model, mesh=mesh), mesh=mesh)
    model.train(), serial.train()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, serial(ids).logits, **TIGHT)
    return True


def test_zero_attention_dropout_trains():
    assert run_ranks(_zero_p_trains, 2, timeout=120) == [True, True]


def _hand_block(rank, world):
    from gpt_block import Block

    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = Block(8, 2, p=0.1, dtype=torch.float64)
    base = {r"attn\.c_attn": tplayers.ColumnParallel(), r"attn\.c_proj": tplayers.RowParallel()}
    plain = tplayers.parallelize_module(copy.deepcopy(serial), dict(base), mesh=mesh)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError) as info:
        plain(x)
    sharded = dict(base, **{r"attn\.attn_dropout": tplayers.ShardedDropout(dim=1, full_size=2)})
    exact = tplayers.parallelize_module(copy.deepcopy(serial), sharded, mesh=mesh)
    torch.manual_seed(5)
    want = serial(x)
    torch.manual_seed(5)
    torch.testing.assert_close(exact(x), want, **TIGHT)  # the serial mask's slice: not refused
    return str(info.value)


def test_hand_written_attention_dropout_refused_unless_sharded():
    out = run_ranks(_hand_block, 2, timeout=60)
    assert out[0] == out[1] and "module attribute attn_dropout=0.1" in out[0] and "'attn'" in out[0]
