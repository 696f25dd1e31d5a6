"""Issue 30 item 5: expert parallelism. ``ExpertParallelExperts`` (whole experts per rank, tokens
routed by all-to-all and back) against the serial experts module in fp64 over random sizes at 2 and
3 ranks (uneven expert counts, a rank with no experts, fewer tokens than ranks): output, the hidden
states' and routing weights' gradients, every expert's gradient, the collectives per call. Mixtral
and Qwen3-MoE from their own plan with ``expert_parallel=True`` at tp 2: logits, the load-balancing
loss, every gradient and the parameters after AdamW steps; their checkpoint saves and gathers to the
serial names and loads back. Refusals on every rank: a module without the experts interface, the
option combined with ``replicate_experts`` / ``sequence_parallel`` or on a model without experts,
expert ids out of range, ranks whose routing differs."""

import copy
import os
import pickle
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hf_util import TIGHT, require  # noqa: E402

transformers = require("transformers")

import hf_registry  # noqa: E402
from harness import run_ranks  # noqa: E402
from oracle import assert_local_slices  # noqa: E402

import tplayers  # noqa: E402


def _experts(num, hidden=8, inter=6, k=2, seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num, num_experts_per_tok=k
    )
    config._experts_implementation = "eager"
    serial = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config).double()
    torch.nn.init.normal_(serial.gate_up_proj)
    torch.nn.init.normal_(serial.down_proj)
    return serial


def _layer_cases(rank, world, cases):
    mesh = tplayers.default_mesh()
    held = []
    for num, tokens, k, weights_dtype in cases:
        serial = _experts(num, k=k)
        ep = tplayers.ExpertParallelExperts(copy.deepcopy(serial), mesh=mesh)
        held.append(ep.expert_counts[rank])
        gen = torch.Generator().manual_seed(num * 100 + tokens)
        h = torch.randn(tokens, 8, dtype=torch.float64, generator=gen)
        ids = torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, generator=gen).to(weights_dtype)
        hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
        hp, wp = h.clone().requires_grad_(), w.clone().requires_grad_()
        want = serial(hs, ids, ws)
        ep(hp, ids, wp)  # first call: the agreement exchange
        with tplayers.count_collectives() as log:
            got = ep(hp, ids, wp)
        kinds = [r.kind for r in log.records]
        # dispatch and combine; weights of another dtype than the hidden states travel in a second buffer
        assert kinds.count("all_to_all") == (2 if weights_dtype == torch.float64 else 3), kinds
        assert kinds.count("all_gather") == 1, kinds
        torch.testing.assert_close(got, want, **TIGHT)
        grad = torch.randn(want.shape, dtype=torch.float64, generator=gen)
        want.backward(grad)
        got.backward(grad)
        torch.testing.assert_close(hp.grad, hs.grad, **TIGHT)
        torch.testing.assert_close(wp.grad, ws.grad, **TIGHT)
        for name, p in ep.named_parameters():
            torch.testing.assert_close(p.grad, ep.shard_specs()[name].take(serial.get_parameter(name).grad), **TIGHT)
        for twin in (copy.deepcopy(ep), pickle.loads(pickle.dumps(ep))):  # the same experts, the same mesh
            torch.testing.assert_close(twin(h, ids, w), want, **TIGHT)
    return held


LAYER_CASES = {
    2: [(4, 7, 2, torch.float64), (3, 5, 2, torch.float32), (5, 1, 2, torch.float64), (4, 9, 1, torch.float64)],
    3: [(2, 4, 1, torch.float64), (5, 2, 2, torch.float64), (7, 11, 3, torch.float32), (4, 3, 4, torch.float64)],
}


@pytest.mark.parametrize("world", [2, 3])
def test_layer_matches_serial_experts(world):
    held = run_ranks(_layer_cases, world, args=(LAYER_CASES[world],), timeout=120)
    for i, (num, *_) in enumerate(LAYER_CASES[world]):
        assert [h[i] for h in held] == tplayers.shard_sizes(num, world)
    if world == 3:
        assert held[2][0] == 0  # two experts over three ranks: rank 2 holds none and still takes part


def _moe(rank, world, model_type, tmp):
    mesh = tplayers.default_mesh()
    serial = hf_registry.tiny_model(model_type).train()
    serial.config.router_aux_loss_coef = 0.1
    model = copy.deepcopy(serial)
    plan = tplayers.plan_from_transformers(model, mesh=mesh, expert_parallel=True)
    assert [type(v) for k, v in plan.items() if "experts" in k] == [tplayers.ExpertParallel]
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, tplayers.ExpertParallelExperts) and experts.gate_up_proj.shape[0] == 2
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
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in serial.parameters() if p.grad is not None]))
        torch.testing.assert_close(tplayers.grad_norm(model), norm, **TIGHT)  # experts' shards summed, once each
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **TIGHT)
    full = tplayers.gather_state_dict(model, all_ranks=True)  # the serial names and shapes
    assert set(full) == set(serial.state_dict())
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(full[key], value, **TIGHT, msg=lambda m: f"{key}: {m}")
    tplayers.save_checkpoint(model, os.path.join(tmp, "sharded"))
    tplayers.save_checkpoint(model, os.path.join(tmp, "full.safetensors"), consolidated=True)
    fresh = hf_registry.tiny_model(model_type)
    torch.nn.init.normal_(fresh.model.layers[0].mlp.experts.down_proj)  # other values: all must come from the file
    fresh = tplayers.parallelize_module(fresh, tplayers.plan_from_transformers(fresh, expert_parallel=True), mesh=mesh)
    tplayers.load_checkpoint(fresh, os.path.join(tmp, "sharded"))
    trained = dict(model.named_parameters())
    for name, p in fresh.named_parameters():  # bit-exact: this rank's experts back in place
        assert torch.equal(p, trained[name]), name
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(tmp, "gathered.pt"))
    return True


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_from_its_plan_with_expert_parallel(tmp_path, model_type):
    run_ranks(_moe, 2, args=(model_type, str(tmp_path)), timeout=180)
    from safetensors.torch import load_file

    serial = hf_registry.tiny_model(model_type)
    file = load_file(os.path.join(str(tmp_path), "full.safetensors"))
    gathered = torch.load(os.path.join(str(tmp_path), "gathered.pt"))
    assert set(file) == set(serial.state_dict()) == set(gathered)
    assert (
        file["model.layers.0.mlp.experts.gate_up_proj"].shape == serial.model.layers[0].mlp.experts.gate_up_proj.shape
    )
    for key in file:  # the consolidated file holds the gathered (trained) serial tensors, bit for bit
        assert torch.equal(file[key], gathered[key]), key


def _checkpointed(rank, world):
    mesh = tplayers.default_mesh()
    serial = hf_registry.tiny_model("mixtral").train()
    model = copy.deepcopy(serial)
    model = tplayers.parallelize_module(
        model, tplayers.plan_from_transformers(model, mesh=mesh, expert_parallel=True), mesh=mesh
    )
    ids = torch.randint(0, hf_registry.VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    outs = []
    for m in (serial, model):
        m.activation_checkpointing_enable()  # the experts' all-to-alls run again in the recomputed forward
        outs.append(m(ids, use_cache=False).logits)
    torch.testing.assert_close(outs[1], outs[0], **TIGHT)
    for logits in outs:
        F.cross_entropy(logits[:, :-1].reshape(-1, hf_registry.VOCAB), ids[:, 1:].reshape(-1)).backward()
    assert_local_slices(model, serial, grads=True, **TIGHT)
    return True


def test_expert_parallel_with_activation_checkpointing():
    assert run_ranks(_checkpointed, 2, timeout=120) == [True, True]


def _generate(rank, world):
    mesh = tplayers.default_mesh()
    serial = hf_registry.tiny_model("mixtral")
    model = copy.deepcopy(serial)
    plan = tplayers.plan_from_transformers(model, mesh=mesh, expert_parallel=True, vocab_parallel=True)
    model = tplayers.parallelize_module(model, plan, mesh=mesh)
    ids = torch.randint(1, hf_registry.VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(
        max_new_tokens=5, min_new_tokens=5, pad_token_id=0
    )  # (left padding: tests/distributed/test_hf_generate.py)
    torch.manual_seed(1)
    want = serial.generate(ids, do_sample=True, **kw)
    torch.manual_seed(1)
    got = model.generate(ids, do_sample=True, **kw)  # a new token count per step: each agreed once
    assert torch.equal(got, want), (got, want)
    return got.tolist()


def test_generate_with_expert_parallel_and_a_vocab_parallel_head():
    out = run_ranks(_generate, 2, timeout=120)
    assert out[0] == out[1]


def _reshard(rank, world, tmp, save):
    """Five experts saved at 2 ranks (3 + 2) load at 3 ranks (2 + 2 + 1) and at 1."""
    mesh = tplayers.default_mesh()
    serial = _experts(5)
    if save:
        tplayers.save_checkpoint(tplayers.ExpertParallelExperts(copy.deepcopy(serial), mesh=mesh), tmp)
        return True
    fresh = _experts(5, seed=1)
    ep = tplayers.ExpertParallelExperts(fresh, mesh=mesh)
    tplayers.load_checkpoint(ep, tmp)
    for name, p in ep.named_parameters():
        assert torch.equal(p, ep.shard_specs()[name].take(serial.get_parameter(name))), name
    return ep.expert_counts


def test_checkpoint_reshards_to_other_expert_counts(tmp_path):
    tmp = str(tmp_path / "experts")
    run_ranks(_reshard, 2, args=(tmp, True), timeout=60)
    assert run_ranks(_reshard, 3, args=(tmp, False), timeout=60)[0] == (2, 2, 1)
    assert run_ranks(_reshard, 1, args=(tmp, False), timeout=60)[0] == (5,)


def _refusals(rank, world):
    mesh = tplayers.default_mesh()
    messages = []
    with pytest.raises(ValueError) as info:  # not an experts module: refused before anything changes
        tplayers.parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"0": tplayers.ExpertParallel()})
    messages.append(str(info.value))
    moe = hf_registry.tiny_model("mixtral")
    for options in ({"replicate_experts": True}, {"sequence_parallel": True}):
        with pytest.raises(ValueError) as info:
            tplayers.plan_from_transformers(moe, mesh=mesh, expert_parallel=True, **options)
        messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        tplayers.plan_from_transformers(hf_registry.tiny_model("llama"), mesh=mesh, expert_parallel=True)
    messages.append(str(info.value))
    with pytest.raises(TypeError):
        tplayers.plan_from_transformers(moe, mesh=mesh, expert_parallel=1)
    ep = tplayers.ExpertParallelExperts(_experts(4), mesh=mesh)
    h, w = torch.randn(3, 8, dtype=torch.float64), torch.rand(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError) as info:  # ids out of range, the same on every rank
        ep(h, torch.tensor([[0, 1], [2, 4], [3, 0]]), w)
    messages.append(str(info.value))
    with pytest.raises(ValueError) as info:  # other shapes
        ep(h, torch.tensor([0, 1, 2]), w)
    messages.append(str(info.value))
    ids = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2]])
    ids[3, 1] += rank  # the ranks route differently: caught by the agreement of a new input shape
    with pytest.raises(ValueError) as info:
        ep(torch.randn(4, 8, dtype=torch.float64), ids, torch.rand(4, 2, dtype=torch.float64))
    messages.append(str(info.value))
    return messages


def test_refusals_on_every_rank():
    out = run_ranks(_refusals, 2, timeout=120)
    plain, replicated, sequence, dense, ids, shape, disagree = out[0]
    assert "ExpertParallel expects" in plain and "Linear" in plain
    assert "replicate_experts=True" in replicated and "sequence_parallel=True" in sequence
    assert "names no experts module" in dense
    assert "[0, 4)" in ids and "[0, 4]" in ids
    assert "top_k_index (T, k)" in shape
    assert "top_k_index values" in disagree
    assert out[1][:6] == out[0][:6]


def _docs_example(rank, world, doc, marker):
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", doc)).read()
    blocks = [b.split("```")[0] for b in text.split("```python\n")[1:]]
    [code] = [b for b in blocks if marker in b]
    exec(compile(code, f"<docs/{doc} expert parallelism>", "exec"), {})
    return True


@pytest.mark.parametrize(
    "doc, marker", [("huggingface.md", "expert_parallel=True"), ("tensor-parallel.md", "ExpertParallel()")]
)
def test_docs_examples_run(doc, marker):
    run_ranks(_docs_example, 2, args=(doc, marker), timeout=120)


def _dispatch_example(rank, world):
    from tplayers.comm import dispatch

    code = dispatch.__doc__.split("::\n")[1]
    exec(compile(textwrap.dedent(code), "<tplayers.comm.dispatch example>", "exec"), {})
    return True


def test_dispatch_docstring_example_runs():
    run_ranks(_dispatch_example, 2, timeout=60)


def _double_backward(rank, world):
    mesh = tplayers.default_mesh()
    serial = _experts(5)
    ep = tplayers.ExpertParallelExperts(copy.deepcopy(serial), mesh=mesh)
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(6, 8, dtype=torch.float64, generator=gen)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(6)])
    w = torch.rand(6, 2, dtype=torch.float64, generator=gen)
    for module in (serial, ep):  # a gradient penalty: the all-to-alls and the token slice differentiated twice
        x = h.clone().requires_grad_()
        (g,) = torch.autograd.grad(module(x, ids, w).pow(2).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
    for name, p in ep.named_parameters():
        torch.testing.assert_close(p.grad, ep.shard_specs()[name].take(serial.get_parameter(name).grad), **TIGHT)
    return True


def test_double_backward():
    assert run_ranks(_double_backward, 2, timeout=60) == [True, True]


def _implementation(rank, world, impl):
    mesh = tplayers.default_mesh()
    serial = _experts(5, inter=8).float()  # grouped_mm: rows of 16-byte multiples
    serial.config._experts_implementation = impl  # transformers' batched / grouped kernels (float32 on the CPU)
    ep = tplayers.ExpertParallelExperts(copy.deepcopy(serial), mesh=mesh)
    gen = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 8, generator=gen), torch.rand(9, 2, generator=gen)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(9)])
    outs = []
    for module in (serial, ep):
        x = h.clone().requires_grad_()
        y = module(x, ids, w)
        y.pow(2).sum().backward()
        outs.append((y, x.grad))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for name, p in ep.named_parameters():
        want = ep.shard_specs()[name].take(serial.get_parameter(name).grad)
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_other_experts_implementations(impl):
    assert run_ranks(_implementation, 2, args=(impl,), timeout=60) == [True, True]
