"""Shared helpers of the attention tests: split global tokens over ranks and compare with the
serial ``F.scaled_dot_product_attention`` on the gathered tokens (fp64)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from tplayers.functional import scaled_dot_product_attention

TIGHT = dict(rtol=1e-10, atol=1e-10)


def uneven_sizes(rng: random.Random, total: int, world: int):
    """A random partition of ``total`` into ``world`` parts (zeros allowed)."""
    cuts = sorted(rng.randint(0, total) for _ in range(world - 1))
    bounds = [0] + cuts + [total]
    return [bounds[i + 1] - bounds[i] for i in range(world)]


def token_order(rng: random.Random, total: int, sizes, strided: bool):
    """The global indices each rank holds: contiguous blocks, or a random permutation split."""
    perm = list(range(total))
    if strided:
        rng.shuffle(perm)
    out, start = [], 0
    for s in sizes:
        out.append(
            torch.tensor(sorted(perm[start : start + s]) if strided else perm[start : start + s], dtype=torch.int64)
        )
        start += s
    return out


def check_against_serial(
    rank,
    q,
    k,
    v,
    qpos,
    kpos,
    *,
    attn_mask=None,
    mask_rows=None,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    dropout_p=0.0,
    seed=0,
    mesh=None,
    kv_sharded=True,
    pass_positions=True,
    algorithm="auto",
    tol=TIGHT,
):
    """Run the distributed attention on this rank's rows and compare output and q/k/v gradients
    with the serial call's rows. ``qpos``/``kpos``: every rank's global token indices."""
    mine_q, mine_k = qpos[rank], kpos[rank]
    ql = q.index_select(-2, mine_q).detach().requires_grad_()
    if kv_sharded:
        kl = k.index_select(-2, mine_k).detach().requires_grad_()
        vl = v.index_select(-2, mine_k).detach().requires_grad_()
    else:
        kl, vl = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    local_mask = (
        None if attn_mask is None else (attn_mask if attn_mask.size(-2) == 1 else attn_mask.index_select(-2, mine_q))
    )
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(seed)
    ref = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    torch.manual_seed(seed)
    out = scaled_dot_product_attention(
        ql,
        kl,
        vl,
        attn_mask=local_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        mesh=mesh,
        kv_sharded=kv_sharded,
        q_positions=mine_q if pass_positions else None,
        kv_positions=mine_k if (pass_positions and kv_sharded) else None,
        algorithm=algorithm,
    )
    torch.testing.assert_close(out, ref.index_select(-2, mine_q), **tol)
    grad = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(seed + 1))
    ref.backward(grad)
    out.backward(grad.index_select(-2, mine_q))
    torch.testing.assert_close(ql.grad, qs.grad.index_select(-2, mine_q), **tol)
    if kv_sharded:
        torch.testing.assert_close(kl.grad, ks.grad.index_select(-2, mine_k), **tol)
        torch.testing.assert_close(vl.grad, vs.grad.index_select(-2, mine_k), **tol)
        return None
    return kl.grad, vl.grad, ks.grad, vs.grad
