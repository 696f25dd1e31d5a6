"""plan_from_transformers: what it maps each transformers style to, that every style the installed
transformers defines is either mapped or refused by name, the errors (on every rank, before any change),
explain on the result, and its docstring example run as written."""

import copy
import re
import textwrap

import pytest
from hf_util import require  # noqa: E402

require("transformers")

import torch  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf_util import gpt2, llama  # noqa: E402

import tplayers  # noqa: E402
from tplayers.parallelize.hf import _UNSUPPORTED, TRANSFORMERS_STYLES  # noqa: E402
from tplayers.parallelize.hf_generate import VocabParallelHead  # noqa: E402
from tplayers.parallelize.hf_sequence import SequenceGatheredAttention  # noqa: E402


def _installed_styles():
    import transformers.distributed.expert_parallel  # noqa: F401 - each registers its styles on import
    import transformers.distributed.tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return set(ALL_PARALLEL_STYLES.keys())


def test_every_installed_style_is_mapped_or_refused():
    # A new transformers style shows up here first: map it in tplayers/parallelize/hf.py or refuse it by name.
    assert _installed_styles() == set(TRANSFORMERS_STYLES) | set(_UNSUPPORTED)


def _mapping(rank, world):
    mesh = tplayers.default_mesh()
    model = llama()
    plan = tplayers.plan_from_transformers(model, mesh=mesh)
    q = plan[r"model\.layers\.\d+\.self_attn\.q_proj"]
    k = plan[r"model\.layers\.\d+\.self_attn\.k_proj"]
    o = plan[r"model\.layers\.\d+\.self_attn\.o_proj"]
    assert (q.head_dim, k.head_dim, o.head_dim) == (4, 4, 4)
    assert plan[r"model\.layers\.\d+\.mlp\.up_proj"] == tplayers.ColumnParallel()
    assert plan[r"model\.layers\.\d+\.mlp\.down_proj"] == tplayers.RowParallel()
    assert plan[r"model\.embed_tokens"] == tplayers.RowParallel()
    assert plan["lm_head"] == tplayers.ColumnParallel(gather_output=True)  # colwise_gather_output
    head = tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=True)["lm_head"]
    assert isinstance(head, VocabParallelHead) and not head.gather_output  # ColumnParallel; decoding gathers
    sp = tplayers.plan_from_transformers(model, mesh=mesh, sequence_parallel=True)
    attn = sp[r"model\.layers\.\d+\.self_attn"]
    assert isinstance(attn, SequenceGatheredAttention) and set(attn.children) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
    assert attn.children["o_proj"].sequence_parallel and not attn.children["q_proj"].sequence_parallel
    assert isinstance(sp[r"model\.layers\.0\.input_layernorm"], tplayers.ReplicatedGradSum)
    assert isinstance(sp[r"model\.norm"], tplayers.ReplicatedGradSum)

    other = {  # every other mapped style, by hand on the same model
        "colwise_rep": tplayers.ColumnParallel(gather_output=True),
        "rowwise_rep": tplayers.RowParallel(input_is_parallel=False),
        "rowwise_split_input": tplayers.RowParallel(input_is_parallel=False),
        "embedding_colwise": tplayers.ColumnParallel(gather_output=True),
        "packed_colwise": tplayers.ColumnParallel(sections=(11, 11)),
        "sequence_parallel": tplayers.ReplicatedGradSum(),
        "replicated_with_grad_allreduce": tplayers.ReplicatedGradSum(),
    }
    targets = {
        "colwise_rep": "lm_head",
        "rowwise_rep": "model.layers.*.mlp.down_proj",
        "embedding_colwise": "model.embed_tokens",
        "rowwise_split_input": "model.layers.*.mlp.down_proj",
        "packed_colwise": "model.layers.*.mlp.up_proj",
        "sequence_parallel": "model.norm",
        "replicated_with_grad_allreduce": "model.layers.*.input_layernorm",
    }
    for style, want in other.items():
        key = targets[style]
        got = tplayers.plan_from_transformers(model, mesh=mesh, tp_plan={key: style})
        assert list(got.values()) == [want], (style, got)
    assert tplayers.plan_from_transformers(
        model, mesh=mesh, tp_plan={"lm_head": "replicate", "model.norm": "sequence_parallel"}
    ) == {r"model\.norm": tplayers.ReplicatedGradSum()}  # replicate: left as it is
    text = str(tplayers.explain(model, plan, mesh=mesh))
    return text


def test_plan_contents_and_explain():
    for text in run_ranks(_mapping, 2, timeout=120):
        assert "model.layers.0.self_attn.q_proj" in text and "ColumnParallel" in text and "lm_head" in text


def _errors(rank, world):
    mesh = tplayers.default_mesh()
    model = llama()
    before = copy.deepcopy(model.state_dict())
    messages = []
    cases = [
        (
            {"model.layers.*.mlp.up_proj": "colwise_typo"},
            r"style 'colwise_typo' of tp_plan key 'model\.layers\.\*\.mlp\.up_proj' is unknown",
        ),
        ({"model.layers.*.mlp.up_proj": "moe_tp_experts"}, r"style 'moe_tp_experts' .* has no tplayers equivalent"),
        (
            {"model.layers.*.mlp.up_proj.weight": "colwise"},
            r"tp_plan key 'model\.layers\.\*\.mlp\.up_proj\.weight' \('colwise'\) names a parameter",
        ),
        ({"model.layers.*.mlp.up_proj": "packed_colwise", "model.layers.*.mlp.gate_proj": "packed_colwise"}, None),
        ({}, r"LlamaForCausalLM has no tensor-parallel plan"),
    ]
    for tp_plan, pattern in cases:
        if pattern is None:  # 22 output features: even, fine
            tplayers.plan_from_transformers(model, mesh=mesh, tp_plan=tp_plan)
            continue
        with pytest.raises(ValueError, match=pattern) as err:
            tplayers.plan_from_transformers(model, mesh=mesh, tp_plan=tp_plan)
        messages.append(str(err.value))
    with pytest.raises(TypeError, match="vocab_parallel must be a bool, got str"):
        tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel="yes")
    with pytest.raises(TypeError, match=r"tp_plan\['lm_head'\] must be a style name, got int"):
        tplayers.plan_from_transformers(model, mesh=mesh, tp_plan={"lm_head": 1})
    with pytest.raises(TypeError, match="sequence_parallel must be a bool, got int"):
        tplayers.VocabParallelEmbedding(10, 4, mesh=mesh, sequence_parallel=1)
    drop = llama()
    drop.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)  # a residual-stream dropout
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.dropout' is nn.Dropout\(p=0.1\)"):
        tplayers.plan_from_transformers(drop, mesh=mesh, sequence_parallel=True)
    # sequence parallelism refused up front where it cannot work: GPT-2's absolute positions, eager attention
    with pytest.raises(ValueError, match=r"absolute position embeddings \('transformer\.wpe', Embedding\(64, 12\)\)"):
        tplayers.plan_from_transformers(gpt2(), mesh=mesh, sequence_parallel=True)
    eager = llama()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"needs config._attn_implementation='sdpa' .*got 'eager'"):
        tplayers.plan_from_transformers(eager, mesh=mesh, sequence_parallel=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return messages


def test_errors_name_the_style_key_and_argument():
    run_ranks(_errors, 2, timeout=120)


def _gqa_at_three(rank, world):
    mesh = tplayers.default_mesh()
    model = llama()
    with pytest.raises(
        ValueError, match=r"on 3 ranks, rank \d holds query heads .* grouped-query attention needs a rank"
    ):
        tplayers.plan_from_transformers(model, mesh=mesh)
    return True


def test_gqa_split_group_raises_on_every_rank():
    # 4 query / 2 kv heads at tp 3: rank 1's query head 2 uses kv head 1, which it does not hold
    assert run_ranks(_gqa_at_three, 3, timeout=120) == [True] * 3


def _docstring_example(rank, world):
    doc = tplayers.plan_from_transformers.__doc__
    block = textwrap.dedent(doc.split("::", 1)[1].split("\n\n", 2)[1])
    scope = {}
    exec(compile(block, "plan_from_transformers docstring", "exec"), scope)
    return float(scope["loss"])


def test_docstring_example_runs():
    losses = run_ranks(_docstring_example, 2, timeout=120)
    assert losses[0] == losses[1] and re.match(r"\d", str(losses[0]))


def test_a_missing_peer_fails_and_never_skips(monkeypatch):
    for ci in ("true", ""):
        monkeypatch.setenv("CI", ci)
        with pytest.raises(ModuleNotFoundError):
            require("tplayers_no_such_peer")
