"""transformers' own models, tensor-parallel vs serial in fp64 (tiny configs, random init, no downloads):
Llama with grouped-query attention (4 query / 2 kv heads) at tp 2 and 4 from its own plan in one call
and from the hand plan, Qwen2 (q/k/v biases), GPT-2 (Conv1D, fused c_attn, lm_head tied to wte, 3 heads
uneven on 2 ranks and an empty rank at 4) with the hand plan and the derived plan, sequence
parallelism on Llama, the vocab-parallel loss. Each: loss, every gradient, parameters after two SGD
steps, gather_state_dict in the serial layout."""

import copy

import pytest
from hf_util import require  # noqa: E402

require("transformers")

from harness import run_ranks  # noqa: E402
from hf_util import compare_lm, gpt2, gpt2_hand_plan, llama, localize_gpt2_split, qwen2  # noqa: E402

import tplayers  # noqa: E402


def _llama_derived(rank, world, vocab_parallel, tie):
    mesh = tplayers.default_mesh()
    serial = llama(tie=tie)
    model = copy.deepcopy(serial)
    plan = tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=vocab_parallel)
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    attn = model.model.layers[0].self_attn
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    losses = compare_lm(serial, model, mesh, vocab_parallel=vocab_parallel)
    return losses, attn.k_proj.weight_ranges, attn.num_key_value_groups


@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["gathered_logits", "vocab_parallel_loss"])
@pytest.mark.parametrize("world", [2, 4])
def test_llama_gqa_from_its_own_plan(world, vocab_parallel):
    out = run_ranks(_llama_derived, world, args=(vocab_parallel, False), timeout=120)
    hd = 4
    for rank, (losses, k_ranges, groups) in enumerate(out):
        kv_head = rank * 2 // world  # 2 kv heads: one per rank at tp 2, each on 2 ranks at tp 4
        assert k_ranges == ((kv_head * hd, (kv_head + 1) * hd),)
        assert groups == (4 // world) // 1  # this rank's query heads per kv head
        assert losses == out[0][0]


def test_llama_tied_embeddings_vocab_parallel():
    run_ranks(_llama_derived, 2, args=(True, True), timeout=120)


def _llama_hand(rank, world):
    mesh = tplayers.default_mesh()
    serial = llama()
    hd = 4
    plan = {
        r"model\.embed_tokens": tplayers.RowParallel(),
        r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj": tplayers.ColumnParallel(head_dim=hd),
        r"model\.layers\.\d+\.self_attn\.o_proj": tplayers.RowParallel(head_dim=hd),
        r"model\.layers\.\d+\.mlp\.(gate|up)_proj": tplayers.ColumnParallel(),
        r"model\.layers\.\d+\.mlp\.down_proj": tplayers.RowParallel(),
        "lm_head": tplayers.ColumnParallel(),
    }
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    for layer in model.model.layers:  # by hand: this rank's query heads per kv head
        attn = layer.self_attn
        attn.num_key_value_groups = attn.q_proj.local_sections[0] // attn.k_proj.local_sections[0]
    return compare_lm(serial, model, mesh, vocab_parallel=True)


@pytest.mark.parametrize("world", [2, 4])
def test_llama_gqa_hand_plan(world):
    run_ranks(_llama_hand, world, timeout=120)


def _llama_sp(rank, world):
    mesh = tplayers.default_mesh()
    serial = llama()
    plan = tplayers.plan_from_transformers(
        copy.deepcopy(serial), mesh=mesh, sequence_parallel=True, vocab_parallel=True
    )
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    assert isinstance(model.model.norm, tplayers.DomainReplicated)
    assert model.model.embed_tokens.sequence_parallel and model.lm_head.sequence_parallel
    with tplayers.count_collectives() as log:
        losses = compare_lm(serial, model, mesh, vocab_parallel=True, sequence_parallel=True, steps=1)
    return losses, sorted(log.summary())


@pytest.mark.parametrize("world", [2, 4])
def test_llama_sequence_parallel(world):
    out = run_ranks(_llama_sp, world, timeout=120)
    for _, kinds in out:
        assert "reduce_scatter" in kinds and "all_gather" in kinds  # the sequence moves, sharded between blocks


def _qwen2(rank, world):
    mesh = tplayers.default_mesh()
    serial = qwen2()
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), tplayers.plan_from_transformers(serial, mesh=mesh), mesh=mesh
    )
    return compare_lm(serial, model, mesh)


@pytest.mark.parametrize("world", [2, 4])
def test_qwen2_qkv_bias_from_its_own_plan(world):
    run_ranks(_qwen2, world, timeout=120)


def _gpt2(rank, world, derived):
    mesh = tplayers.default_mesh()
    serial = gpt2()
    model = copy.deepcopy(serial)
    if derived:
        model = tplayers.parallelize_module(
            model, tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=True), mesh=mesh
        )
    else:
        model = tplayers.parallelize_module(model, gpt2_hand_plan(model), mesh=mesh)
        localize_gpt2_split(model)
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.transposed and c_attn.weight.shape[0] == 12  # Conv1D storage (in, out_local)
    assert model.lm_head.weight is model.transformer.wte.weight, "the tie must survive"
    losses = compare_lm(serial, model, mesh, vocab_parallel=derived)
    assert model.lm_head.weight is model.transformer.wte.weight
    return losses, c_attn.local_sections


@pytest.mark.parametrize("derived", [False, True], ids=["hand_plan", "derived_plan"])
@pytest.mark.parametrize("world", [2, 4])
def test_gpt2_conv1d_fused_tied(world, derived):
    out = run_ranks(_gpt2, world, args=(derived,), timeout=120)
    heads = tplayers.shard_sizes(3, world)  # 2 + 1 at tp 2; 1, 1, 1, 0 at tp 4
    assert [tuple(s) for _, s in out] == [(h * 4,) * 3 for h in heads]
