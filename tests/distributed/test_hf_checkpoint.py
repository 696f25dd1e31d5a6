"""Checkpoints of transformers models keep transformers' layout: GPT-2 (Conv1D (in, out) weights, the tied
head) and Llama (GQA) trained one SGD step at tp 2 (against the serial step, fp64), saved sharded, loaded at
tp 4, written consolidated, and the consolidated file loaded by ``from_pretrained``: bit-exact at each stage."""

import copy
import os
import shutil

import pytest
from hf_util import require  # noqa: E402

require("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import run_ranks  # noqa: E402
from hf_util import TIGHT, VOCAB, gpt2, llama  # noqa: E402
from oracle import assert_local_slices  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import tplayers  # noqa: E402

BUILD = {"gpt2": gpt2, "llama": llama}


def _step(model, causal_lm_loss=None, mesh=None):
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    logits = model(ids).logits
    if causal_lm_loss is not None:
        loss = causal_lm_loss(logits, ids, mesh)
    else:
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return float(loss)


def _train_save(rank, world, kind, tmp):
    mesh = tplayers.default_mesh()
    serial = BUILD[kind](seed=1)
    model = copy.deepcopy(serial)
    model = tplayers.parallelize_module(
        model, tplayers.plan_from_transformers(model, mesh=mesh, vocab_parallel=True), mesh=mesh
    )
    assert _step(model, tplayers.causal_lm_loss, mesh) == pytest.approx(_step(serial), rel=1e-12)
    tplayers.save_checkpoint(model, os.path.join(tmp, "sharded"))
    full = tplayers.gather_state_dict(model, all_ranks=True)  # what was saved, bit for bit
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, **TIGHT, msg=lambda m: f"{k}: {m}")
    if rank == 0:  # clones: a tied pair becomes two entries, as in the serial state_dict
        save_file({k: v.contiguous().clone() for k, v in full.items()}, os.path.join(tmp, "reference.safetensors"))
    return True


def _load_consolidate(rank, world, kind, tmp):
    mesh = tplayers.default_mesh()
    fresh = BUILD[kind](seed=2)  # other weights: everything must come from the checkpoint
    model = tplayers.parallelize_module(fresh, tplayers.plan_from_transformers(fresh, mesh=mesh), mesh=mesh)
    tplayers.load_checkpoint(model, os.path.join(tmp, "sharded"))
    reference = BUILD[kind](seed=3)
    reference.load_state_dict(load_file(os.path.join(tmp, "reference.safetensors")))
    assert_local_slices(model, reference, grads=False, rtol=0, atol=0)  # bit-exact
    tplayers.save_checkpoint(model, os.path.join(tmp, "consolidated.safetensors"), consolidated=True)
    return True


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sharded_at_2_loaded_at_4_consolidated_from_pretrained(tmp_path, kind):
    tmp = str(tmp_path)
    run_ranks(_train_save, 2, args=(kind, tmp), timeout=120)
    run_ranks(_load_consolidate, 4, args=(kind, tmp), timeout=120)
    reference = load_file(os.path.join(tmp, "reference.safetensors"))
    consolidated = load_file(os.path.join(tmp, "consolidated.safetensors"))
    assert set(consolidated) == set(reference)
    if kind == "gpt2":
        assert consolidated["transformer.h.0.attn.c_attn.weight"].shape == (12, 36)  # Conv1D's (in, out)
    for k in reference:
        assert torch.equal(consolidated[k], reference[k]), k
    pretrained = os.path.join(tmp, "pretrained")
    serial = BUILD[kind](seed=4)
    serial.config.save_pretrained(pretrained)
    shutil.copy(os.path.join(tmp, "consolidated.safetensors"), os.path.join(pretrained, "model.safetensors"))
    loaded = type(serial).from_pretrained(pretrained, dtype=torch.float64)
    state = loaded.state_dict()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
    ids = torch.randint(0, VOCAB, (1, 5))
    expected = BUILD[kind](seed=5)
    expected.load_state_dict(reference)
    torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, **TIGHT)
