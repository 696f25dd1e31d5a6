"""A Hugging Face transformers ``LlamaForCausalLM`` parallelized from its own tensor-parallel plan.

    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py          # or 4 ranks
    torchrun --standalone --nproc-per-node 4 examples/hf_llama.py --sequence-parallel

transformers is optional: without it this prints one line and exits 0. A tiny random
Llama (grouped-query attention: 4 query heads, 2 key/value heads; no download) is
parallelized in one call, ``tplayers.plan_from_transformers(model, vocab_parallel=True)``,
which reads ``model.tp_plan`` (the config's ``base_model_tp_plan``) and adds whole heads and
kv-head replication from the config, so it runs at 4 ranks where transformers' own tensor
parallelism needs the kv heads divisible by the ranks. First a parity check against the
serial model in fp64 (loss and every parameter after one SGD step, through
``gather_state_dict``), then a few fp32 steps with the vocab-parallel loss, then a
consolidated checkpoint that ``LlamaForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import shutil
import sys
import tempfile

if importlib.util.find_spec("transformers") is None:
    if os.environ.get("RANK", "0") == "0":  # one line per run, not one per rank
        print("hf_llama.py: transformers is not installed (pip install transformers); skipped")
    sys.exit(0)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a random model: nothing to download
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import tplayers  # noqa: E402

transformers.utils.logging.disable_progress_bar()


def build(args) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)  # every rank builds the same serial model
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def forward(model, ids, sequence_parallel):
    if sequence_parallel:  # the layers see this rank's tokens: positions of the whole sequence
        return model(ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0)).logits
    return model(ids).logits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=61)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    mesh = tplayers.init_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(*msg):
        if rank == 0:
            print(*msg, flush=True)

    serial = build(args).double()
    plan = tplayers.plan_from_transformers(
        serial, mesh=mesh, vocab_parallel=True, sequence_parallel=args.sequence_parallel
    )
    say(f"model.tp_plan: {serial.tp_plan}")
    tplayers.explain(serial, plan, mesh=mesh, print_table=rank == 0)
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    attn = model.model.layers[0].self_attn
    say(
        f"rank 0 holds kv heads {[(a // 8, b // 8) for a, b in attn.k_proj.weight_ranges]} of 2 "
        f"(query heads per kv head here: {getattr(attn, 'module', attn).num_key_value_groups})"
    )

    # parity: one SGD step on both, in fp64
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=gen)
    logits = serial(ids).logits
    loss_s = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
    loss_p = tplayers.causal_lm_loss(forward(model, ids, args.sequence_parallel), ids, mesh)
    loss_s.backward(), loss_p.backward()
    torch.optim.SGD(serial.parameters(), lr=0.1).step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    full, ref = tplayers.gather_state_dict(model, all_ranks=True), serial.state_dict()
    param_diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
    loss_diff = abs(loss_s.item() - loss_p.item())
    say(
        f"parity (fp64, one SGD step) on {world} ranks: |loss diff| {loss_diff:.1e} | max |param diff| {param_diff:.1e}"
    )
    if loss_diff > 1e-10 or param_diff > 1e-10:
        raise SystemExit("parity check FAILED")

    model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built after parallelize_module
    for step in range(1, args.steps + 1):
        start = torch.randint(0, args.vocab, (4, 1), generator=gen)
        ids = (start + torch.arange(args.seq)) % args.vocab  # a learnable pattern: counting
        loss = tplayers.causal_lm_loss(forward(model, ids, args.sequence_parallel), ids, mesh)
        loss.backward()
        norm = tplayers.clip_grad_norm_(model, 1.0)  # the serial model's global norm, on every rank
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps:
            say(f"step {step:4d} | loss {loss.item():.4f} | grad norm {norm.item():.3f}")

    # a consolidated file in the serial layout: transformers loads it as it is
    name = torch.zeros(256, dtype=torch.uint8)  # rank 0's temporary directory, sent as bytes (no pickle)
    if rank == 0:
        made = tempfile.mkdtemp().encode()
        name[: len(made)] = torch.tensor(list(made), dtype=torch.uint8)
    dist.broadcast(name, src=0)
    out = [bytes(name[name != 0].tolist()).decode()]
    path = os.path.join(out[0], "model.safetensors")
    tplayers.save_checkpoint(model, path, consolidated=True)
    full = tplayers.gather_state_dict(model)  # collective: every rank calls it (rank 0 gets the dict)
    if rank == 0:
        serial.config.save_pretrained(out[0])
        loaded = transformers.LlamaForCausalLM.from_pretrained(out[0], dtype=torch.float32)
        same = all(torch.equal(loaded.state_dict()[k], v) for k, v in full.items())
        say(f"from_pretrained of the consolidated checkpoint: every tensor equal = {same}")
        shutil.rmtree(out[0])
    say("done")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
