"""Issue 30 item 2: attention dropout on split heads in training. transformers' eager attention is exact:
each rank's mask is the serial mask's slice for its heads (HeadSliceDropout), so GPT-2 (attn_pdrop, and
its residual / embedding dropout, derived and hand plans, 3 heads at tp 2 and 4 with an empty rank) and
Llama (attention_dropout, its own plan at tp 2 and 4) train exactly as the serial model under one seed:
logits, every gradient, parameters after AdamW steps, fp64. SDPA (its kernel draws the mask) is refused
on every rank naming the config field; eval mode and p = 0 run exactly as before; the hand-written block
(no transformers config) is refused unless its attention dropout is swapped by ShardedDropout (exact).
Under HeadSliceDropout other random ops and SDPA with dropout_p > 0 raise."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hf_util import TIGHT, VOCAB, gpt2_hand_plan, localize_gpt2_split, require  # noqa: E402

require("transformers")

import transformers  # noqa: E402
from harness import run_ranks  # noqa: E402
from oracle import assert_local_slices  # noqa: E402

import tplayers  # noqa: E402


def _gpt2(attn, pdrop=0.1, others=0.0):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=12, n_layer=2, n_head=3, n_positions=64, resid_pdrop=others, embd_pdrop=others,
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


@pytest.mark.parametrize("arch,attn,hand", [("gpt2", "sdpa", False), ("llama", "sdpa", False)])
def test_attention_dropout_in_training_is_refused_on_every_rank(arch, attn, hand):
    out = run_ranks(_refused, 2, args=(arch, attn, hand), timeout=120)
    assert out[0] == out[1]
    field = "config.attn_pdrop=0.1" if arch == "gpt2" else "config.attention_dropout=0.1"
    assert field in out[0] and "attention dropout in training on split heads" in out[0]
    assert "'transformer.h.0.attn'" in out[0] or "'model.layers.0.self_attn'" in out[0]
    assert "implementation 'sdpa'" in out[0]


def _exact(rank, world, arch, hand):
    mesh = tplayers.default_mesh()
    serial = _gpt2("eager", others=0.1) if arch == "gpt2" else _llama("eager")
    model = copy.deepcopy(serial)
    plan = gpt2_hand_plan(model) if hand else tplayers.plan_from_transformers(model, mesh=mesh)
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    if hand:
        localize_gpt2_split(model)
    serial.train(), model.train()
    opt_s = torch.optim.AdamW(serial.parameters(), lr=0.01)
    opt_p = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    dropped = []
    for step in range(2):
        ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
        torch.manual_seed(100 + step)  # the same generator state on every rank and in the serial run
        want = serial(ids).logits
        torch.manual_seed(100 + step)
        got = model(ids).logits
        torch.testing.assert_close(got, want, **TIGHT)
        torch.manual_seed(100 + step)
        dropped.append(float((serial(ids).logits - serial.eval()(ids).logits).abs().max()))  # dropout acts
        serial.train()
        for logits in (want, got):
            F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        assert_local_slices(model, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **TIGHT)
    assert min(dropped) > 1e-3
    return True


@pytest.mark.parametrize(
    "arch,hand,world",
    [("gpt2", False, 2), ("gpt2", True, 2), ("gpt2", False, 4), ("llama", False, 2), ("llama", False, 4)],
)
def test_eager_attention_dropout_is_exact(arch, hand, world):
    assert run_ranks(_exact, world, args=(arch, hand), timeout=180) == [True] * world


def test_head_slice_dropout_mode():
    from tplayers.parallelize.attention_dropout import HeadSliceDropout

    x = torch.rand(2, 2, 3, 3, dtype=torch.float64)
    torch.manual_seed(4)
    full = F.dropout(torch.ones(2, 5, 3, 3, dtype=torch.float64), 0.3)
    after = torch.rand(1)
    torch.manual_seed(4)
    with HeadSliceDropout(heads=5, start=2, local=2, where="attn"):
        got = F.dropout(x, 0.3, training=True)
        other = F.dropout(torch.ones(2, 3), 0.0, training=True)  # not per-head data: as it is
    torch.testing.assert_close(got, x * full[:, 2:4], rtol=0, atol=0)
    assert torch.equal(torch.rand(1), after) and torch.equal(other, torch.ones(2, 3))  # the generator as serially
    for call in (
        lambda: torch.rand(3),
        lambda: torch.ones(2).bernoulli_(0.5),
        lambda: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1),
        lambda: F.dropout(x.transpose(2, 3), 0.1),  # this rank's heads, but not in the serial memory order
    ):
        with HeadSliceDropout(heads=5, start=2, local=2, where="attn"), pytest.raises(ValueError, match="attn"):
            call()
    with HeadSliceDropout(heads=5, start=2, local=2, where="attn"):
        F.scaled_dot_product_attention(x, x, x)  # no dropout: allowed


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


def _checkpointed(rank, world, arch):
    mesh = tplayers.default_mesh()
    serial = _gpt2("eager") if arch == "gpt2" else _llama("eager")
    model = copy.deepcopy(serial)
    model = tplayers.parallelize_module(model, tplayers.plan_from_transformers(model, mesh=mesh), mesh=mesh)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    outs = []
    for m in (serial, model):
        m.train()
        m.activation_checkpointing_enable()  # the recomputed forward draws the same masks (its RNG state restored)
        torch.manual_seed(3)
        outs.append(m(ids, use_cache=False).logits)
    torch.testing.assert_close(outs[1], outs[0], **TIGHT)
    for logits in outs:
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    assert_local_slices(model, serial, grads=True, **TIGHT)
    return True


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_eager_attention_dropout_with_activation_checkpointing(arch):
    assert run_ranks(_checkpointed, 2, args=(arch,), timeout=120) == [True, True]
