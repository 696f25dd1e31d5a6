"""The runnable examples in the docstrings of the TP pieces run on 2 gloo ranks as written."""

import textwrap

import pytest
from harness import run_ranks

import tplayers
from tplayers.parallelize.attention_dropout import HeadSliceDropout
from tplayers.parallelize.hf_generate import VocabParallelHead

OBJECTS = {
    "parallelize_module": tplayers.parallelize_module,
    "ParallelDropout": tplayers.ParallelDropout,
    "SequenceParallel": tplayers.SequenceParallel,
    "ShardedDropout": tplayers.ShardedDropout,
    "RowParallelLinear": tplayers.RowParallelLinear,
    "ColumnParallelLinear": tplayers.ColumnParallelLinear,
    "clip_grad_norm_": tplayers.clip_grad_norm_,
    "ExpertParallelExperts": tplayers.ExpertParallelExperts,
    "ExpertParallel": tplayers.ExpertParallel,
    "HeadSliceDropout": HeadSliceDropout,
    "VocabParallelHead": VocabParallelHead,
}


def examples(obj):
    """Every ``::`` literal block of ``obj``'s docstring, dedented."""
    lines = obj.__doc__.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].rstrip().endswith("::"):
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            indent = len(lines[j]) - len(lines[j].lstrip())
            body = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) >= indent):
                body.append(lines[j])
                j += 1
            blocks.append(textwrap.dedent("\n".join(body)))
            i = j
        else:
            i += 1
    return blocks


def _run(rank, world, name):
    import torch

    for code in examples(OBJECTS[name]):
        exec(compile(code, f"<{name} example>", "exec"), {"torch": torch, "tplayers": tplayers})
    return len(examples(OBJECTS[name]))


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_docstring_example_runs(name):
    assert all(n >= 1 for n in run_ranks(_run, 2, args=(name,), timeout=60))
