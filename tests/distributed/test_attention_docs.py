"""The runnable examples in the docstrings of the attention pieces run on gloo ranks as written."""

import pytest
from harness import run_ranks
from test_docstring_examples_tp import examples

import tplayers
from tplayers import functional

OBJECTS = {
    "scaled_dot_product_attention": (functional.scaled_dot_product_attention, 2),
    "multi_head_attention_forward": (functional.multi_head_attention_forward, 2),
    "token_positions": (functional.token_positions, 4),
    "ContextParallelAttention": (tplayers.ContextParallelAttention, 2),
    "DistributedMultiheadAttention": (tplayers.DistributedMultiheadAttention, 2),
}


def _run(rank, world, name):
    import torch

    scope = {"torch": torch, "tplayers": tplayers}
    for code in examples(OBJECTS[name][0]):
        exec(compile(code, f"<{name} example>", "exec"), scope)
    return len(examples(OBJECTS[name][0]))


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_attention_docstring_example_runs(name):
    assert all(n >= 1 for n in run_ranks(_run, OBJECTS[name][1], args=(name,), timeout=60))
