"""Issue 30 item 4 (hand plans): parallelize_module sets a transformers attention's head counts to this
rank's after any plan splits its projections by heads (GPT-2's split_size, Llama's
num_key_value_groups), so the hand plans of docs/huggingface.md need no user patch: exact in fp64
(loss, every gradient, parameters after SGD steps) at tp 2 and 4."""

import copy

import pytest
from hf_util import compare_lm, gpt2, gpt2_hand_plan, llama, require  # noqa: E402

require("transformers")

from harness import run_ranks  # noqa: E402

import tplayers  # noqa: E402


def _gpt2_hand(rank, world):
    mesh = tplayers.default_mesh()
    serial = gpt2()
    model = tplayers.parallelize_module(copy.deepcopy(serial), gpt2_hand_plan(serial), mesh=mesh)
    split = model.transformer.h[0].attn.split_size
    assert split == list(model.transformer.h[0].attn.c_attn.local_sections)  # set by the swap
    compare_lm(serial, model, mesh)
    return split


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
        "lm_head": tplayers.ColumnParallel(gather_output=True),
    }
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    groups = model.model.layers[0].self_attn.num_key_value_groups
    compare_lm(serial, model, mesh)
    return groups


@pytest.mark.parametrize("world", [2, 4])
def test_hand_plans_need_no_head_patch(world):
    splits = run_ranks(_gpt2_hand, world, timeout=120)
    assert sum(s[0] for s in splits) == 12  # 3 heads of 4: the ranks' q widths add up
    groups = run_ranks(_llama_hand, world, timeout=120)
    assert groups == [4 // world] * world  # this rank's q heads (4 / world) per its one kv head
