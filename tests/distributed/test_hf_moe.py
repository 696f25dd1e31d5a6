"""Issue 30 item 5 (first step): a mixture of experts from its own plan with
``replicate_experts=True``: attention (and shared linears) sharded, the experts and the router whole on
every rank; Mixtral and Qwen3-MoE exact at tp 2 in fp64 (logits, the router's load-balancing loss,
every gradient, parameters after two AdamW steps). Without the option the experts' entries are refused
on every rank, naming it."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hf_util import TIGHT, require  # noqa: E402

require("transformers")

import hf_registry  # noqa: E402
from harness import run_ranks  # noqa: E402
from oracle import assert_local_slices  # noqa: E402

import tplayers  # noqa: E402


def _moe(rank, world, model_type):
    mesh = tplayers.default_mesh()
    serial = hf_registry.tiny_model(model_type).train()
    serial.config.router_aux_loss_coef = 0.1
    with pytest.raises(ValueError) as info:
        tplayers.plan_from_transformers(serial, mesh=mesh)
    model = copy.deepcopy(serial)
    plan = tplayers.plan_from_transformers(model, mesh=mesh, replicate_experts=True)
    assert not any("experts" in k for k in plan)
    assert any(n.endswith(".experts") for n, _ in serial.named_modules())  # a mixture of experts indeed
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    assert isinstance(model.model.layers[0].self_attn.q_proj, tplayers.ColumnParallelLinear)
    opt_s = torch.optim.AdamW(serial.parameters(), lr=0.01)
    opt_p = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(0, hf_registry.VOCAB, (2, 8), generator=gen)
        outs = [m(ids, output_router_logits=True) for m in (serial, model)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, **TIGHT)
        torch.testing.assert_close(outs[1].aux_loss, outs[0].aux_loss, **TIGHT)
        for out in outs:
            loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, hf_registry.VOCAB), ids[:, 1:].reshape(-1))
            (loss + 0.1 * out.aux_loss).backward()
        assert_local_slices(model, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **TIGHT)
    return str(info.value)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_with_replicated_experts(model_type):
    out = run_ranks(_moe, 2, args=(model_type,), timeout=120)
    assert out[0] == out[1] and "replicate_experts=True" in out[0]
