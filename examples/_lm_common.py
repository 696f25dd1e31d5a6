"""Shared by the GPT-2 and Llama examples: synthetic data, the parity step and the training loop."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tplayers


def synthetic_batch(gen: torch.Generator, batch: int, seq: int, vocab: int, ignore_index: int = -100):
    """Tokens following (previous * 5 + 3) mod vocab from a random start; the first target of each
    sequence is ``ignore_index`` (a padding position), so the loss exercises ``ignore_index``."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    tokens = [start]
    for _ in range(seq):
        tokens.append((tokens[-1] * 5 + 3) % vocab)
    seqs = torch.cat(tokens, 1)  # (batch, seq + 1)
    inp, target = seqs[:, :-1], seqs[:, 1:].clone()
    target[:, 0] = ignore_index
    return inp, target


def serial_loss(logits, target, smoothing):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), label_smoothing=smoothing)


def parallel_loss(local_logits, target, mesh, smoothing):
    return tplayers.vocab_parallel_cross_entropy(local_logits, target, mesh, label_smoothing=smoothing)


def parity_step(serial, plan, mesh, inp, target, smoothing, say, lr=1e-3):
    """Parallelize a copy of ``serial``, take one AdamW step on both, print and return the differences.

    Returns ``(model, max |loss diff|, max |param diff|)``; the parameters are compared in the serial
    layout through ``tplayers.gather_state_dict`` (fused blocks, GQA replicas and the tie included).
    """
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    opt_s = torch.optim.AdamW(serial.parameters(), lr=lr)
    opt_p = torch.optim.AdamW(model.parameters(), lr=lr)  # after parallelize_module
    loss_s = serial_loss(serial(inp), target, smoothing)
    loss_p = parallel_loss(model(inp), target, mesh, smoothing)
    loss_s.backward(), loss_p.backward()
    opt_s.step(), opt_p.step()
    full = tplayers.gather_state_dict(model, all_ranks=True)
    ref = serial.state_dict()
    assert list(full) == list(ref), "gather_state_dict keys differ from the serial model's"
    param_diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
    loss_diff = abs(loss_s.item() - loss_p.item())
    n_serial, n_par = len(list(serial.parameters())), len(list(model.parameters()))
    say(
        f"parity (fp64, one AdamW step): loss serial {loss_s.item():.10f} parallel {loss_p.item():.10f} "
        f"| |loss diff| {loss_diff:.1e} | max |param diff| (gather_state_dict vs serial) {param_diff:.1e} "
        f"| parameters {n_par} (serial {n_serial})"
    )
    if loss_diff > 1e-10 or param_diff > 1e-10 or n_par != n_serial:
        raise SystemExit("parity check FAILED")
    return model


def train(model, mesh, gen, args, say):
    """A few fp32 AdamW steps with the vocab-parallel loss; prints loss and tokens/s."""
    model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    world = dist.get_world_size()
    tokens, t0 = 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        inp, target = synthetic_batch(gen, args.batch, args.seq, args.vocab)
        loss = parallel_loss(model(inp), target, mesh, args.smoothing)
        loss.backward()
        norm = tplayers.clip_grad_norm_(model, 1.0)  # the global norm, the same on every rank
        opt.step()
        opt.zero_grad()
        tokens += inp.numel()
        if step % 5 == 0 or step == args.steps:
            rate = tokens / (time.perf_counter() - t0)
            say(
                f"step {step:4d} | loss {loss.item():.4f} | grad norm {norm.item():.3f} | {rate:,.0f} tokens/s on {world} ranks"
            )
