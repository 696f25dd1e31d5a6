"""Issue 30 item 4: every causal-LM architecture of the installed transformers whose config ships a
tensor-parallel plan, tiny, fp64, from its own plan at tp 2 (tests/hf_registry.py): none is silent
and none crashes; each is exact, within float32 rounding (a known list: their norms compute in
float32 even in an fp64 model), refused with a ValueError on every rank, or has no generic tiny
config. A representative set by default; ``TPLAYERS_HF_REGISTRY=all`` runs the whole registry
(about 8 minutes on two cores), whose table is in docs/huggingface.md."""

import os

import pytest
from hf_util import require  # noqa: E402

require("transformers")

import hf_registry  # noqa: E402

#: their RMSNorm (or, with replicated experts, their router's softmax) computes in float32 also in an
#: fp64 model, and meets a last-bit difference of a sliced matmul: a float32 rounding flip, not a bug
FLOAT32_NORMS = {
    "olmo2",
    "olmo3",
    "olmo_hybrid",
    "olmoe",
    "flex_olmo",
    "minimax_m2",
    "minimax_m3_vl_text",
    "llama4",
    "llama4_text",
}
REPRESENTATIVE = [
    "llama",  # exact
    "gemma2",  # scaled embedding kept
    "gemma3_text",  # scaled embedding, q/k norms summed over heads
    "phi3",  # gathered fused qkv
    "apertus",  # xIELU scalars beside the sharded MLP: gradients summed
    "olmo2",  # float32-level
    "mixtral",  # mixture of experts: refused; exact with replicate_experts=True and with expert_parallel=True
    "deepseek_v2",  # latent attention: refused
    "doge",  # a norm beside a sharded linear the plan does not cover: refused
]


def _selected():
    if os.environ.get("TPLAYERS_HF_REGISTRY") == "all":
        return hf_registry.architectures()
    return REPRESENTATIVE


@pytest.mark.parametrize("model_type", _selected())
def test_architecture_is_exact_or_refused(model_type):
    [(_, (verdict, detail, *again))] = hf_registry.survey(only=[model_type], timeout=120)
    allowed = {"exact", "refused", "no tiny config"} | ({"float32-level"} if model_type in FLOAT32_NORMS else set())
    assert verdict in allowed, f"{model_type}: {verdict}: {detail}"
    for option, retry in zip(("replicate_experts", "expert_parallel"), again):  # a mixture of experts' options
        assert retry[0] in allowed, f"{model_type} with {option}=True: {retry}"
    if model_type in REPRESENTATIVE:  # pinned: a change of verdict is a change of behaviour
        want = {"olmo2": "float32-level", "mixtral": "refused", "deepseek_v2": "refused", "doge": "refused"}
        assert verdict == want.get(model_type, "exact"), f"{model_type}: {verdict}: {detail}"
        if model_type == "mixtral":
            assert [r[0] for r in again] == ["exact", "exact"], again  # experts replicated, or split: exact


#: attention dropout 0.1 in training (eager attention, every rank seeded alike), pinned verdicts
DROPOUT = {
    "llama": "exact",
    "qwen2": "exact",
    "mistral": "exact",
    "gemma2": "exact",
    "phi3": "exact",
    "mixtral": "exact",  # experts replicated
    "olmo2": "float32-level",
    "gpt_neox": "refused",  # its fused query_key_value is split without whole-head bookkeeping: refused by name
    "ernie4_5": "no attention dropout",  # its attention sets the dropout to 0 whatever the config says
}


@pytest.mark.parametrize("model_type", sorted(DROPOUT))
def test_attention_dropout_is_exact_or_refused(model_type):
    [(_, (verdict, detail))] = hf_registry.survey(only=[model_type], timeout=120, attention_dropout=0.1)
    assert verdict == DROPOUT[model_type], f"{model_type}: {verdict}: {detail}"
    if verdict == "refused":
        assert "attention dropout in training on split heads" in detail and "config.attention_dropout=0.1" in detail
