"""``F.multi_head_attention_forward`` with the sequence dim sharded over the ranks of a mesh.

The projections are per token (local); the attention itself is
:func:`tplayers.functional.scaled_dot_product_attention`, so the result is this rank's rows of the
serial call on the gathered tokens. Parameters are used as given: their gradients are this rank's
partial sums (the contribution of its tokens); :class:`tplayers.DistributedMultiheadAttention`
sums them over the ranks, and a domain region does the same for a stock ``nn.MultiheadAttention``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from tplayers.attention.sdpa import scaled_dot_product_attention
from tplayers.attention.weights import attention_with_weights

__all__ = ["multi_head_attention_forward"]


def _float_mask(mask: Optional[torch.Tensor], name: str, dtype) -> Optional[torch.Tensor]:
    """MHA's convention: a bool mask is True where attention is NOT allowed -> additive -inf."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise ValueError(f"multi_head_attention_forward: {name} must be bool or floating, got {mask.dtype}")
    return mask.to(dtype)


def _unsupported(bias_k, bias_v, add_zero_attn, static_k, static_v) -> None:
    for name, bad, why in (
        (
            "bias_k/bias_v (add_bias_kv=True)",
            bias_k is not None or bias_v is not None,
            "the extra key/value token has no owner among the sharded tokens",
        ),
        ("add_zero_attn=True", bool(add_zero_attn), "the zero key has no owner among the sharded tokens"),
        ("static_k/static_v", static_k is not None or static_v is not None, "precomputed keys are not sharded here"),
    ):
        if bad:
            raise ValueError(f"multi_head_attention_forward over sharded tokens: {name} is unsupported ({why})")


def multi_head_attention_forward(
    query,
    key,
    value,
    embed_dim_to_check,
    num_heads,
    in_proj_weight,
    in_proj_bias,
    bias_k,
    bias_v,
    add_zero_attn,
    dropout_p,
    out_proj_weight,
    out_proj_bias,
    training=True,
    key_padding_mask=None,
    need_weights=True,
    attn_mask=None,
    use_separate_proj_weight=False,
    q_proj_weight=None,
    k_proj_weight=None,
    v_proj_weight=None,
    static_k=None,
    static_v=None,
    average_attn_weights=True,
    is_causal=False,
    *,
    mesh: Optional[DeviceMesh] = None,
    kv_sharded: bool = True,
    q_positions=None,
    kv_positions=None,
    algorithm: str = "auto",
):
    """``torch.nn.functional.multi_head_attention_forward`` (sequence-first ``(L, N, E)``, or
    unbatched ``(L, E)``) with the sequence dim sharded over ``mesh``: ``query`` holds this rank's
    ``Lq_local`` tokens, ``key``/``value`` its ``Lk_local`` tokens (``kv_sharded``) or all ``Lk``
    (replicated, e.g. a text embedding: no K/V traffic). ``key_padding_mask`` is ``(N, Lk_global)``;
    ``attn_mask`` is ``(Lq_local, Lk_global)`` or ``(N * num_heads, Lq_local, Lk_global)`` (bool True
    = not allowed, as in torch). ``is_causal`` is torch's hint: with no ``key_padding_mask`` the mask
    is dropped and causality is taken over the global positions (``q_positions``/``kv_positions``,
    see :func:`scaled_dot_product_attention`). Returns ``(attn_output, weights)``.

    ``need_weights=True`` returns this rank's rows of the weights, ``(N, Lq_local, Lk_global)``
    (averaged) or ``(N, heads, Lq_local, Lk_global)``: rows of the full score matrix, so that path
    gathers K/V (all-gather forward, reduce-scatter backward) and runs torch's own ``need_weights``
    computation on this rank's rows (exact, weights differentiable; memory of the weights). With
    ``need_weights=False`` (the fast path) nothing score-sized is formed and ``weights`` is None.
    Unsupported (``ValueError`` naming the option): ``bias_k``/``bias_v``, ``add_zero_attn``,
    ``static_k``/``static_v``. Parameter gradients are this rank's partial sums.

    Args:
        query ... is_causal: as torch's, with the sharded shapes above.
        mesh, kv_sharded, q_positions, kv_positions, algorithm: as
            :func:`scaled_dot_product_attention`.

    Returns:
        ``(attn_output, weights)``: this rank's ``(Lq_local, N, E)`` rows, and its rows of the
        weights or ``None``.

    Raises:
        ValueError: an unsupported option (above), or arguments invalid on any rank.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``: 6 of 12 tokens per rank at 2)::

        import torch, tplayers
        from tplayers.functional import multi_head_attention_forward
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        mha = torch.nn.MultiheadAttention(16, 4)
        x = torch.randn(12, 2, 16)                             # (L, N, E), the same on every rank
        xl = tplayers.shard(x, 0, mesh)                        # (L_local, N, E)
        out, _ = multi_head_attention_forward(
            xl, xl, xl, 16, 4, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
            mha.out_proj.weight, mha.out_proj.bias, need_weights=False, mesh=mesh)
        torch.testing.assert_close(tplayers.gather(out, 0, mesh), mha(x, x, x, need_weights=False)[0])
    """
    _unsupported(bias_k, bias_v, add_zero_attn, static_k, static_v)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"multi_head_attention_forward: {name} must be a tensor, got {type(t).__name__}")
    batched = query.dim() == 3
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"multi_head_attention_forward: query/key/value must all be (L, N, E) or all (L, E), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    if embed_dim != embed_dim_to_check:
        raise ValueError(f"multi_head_attention_forward: expected embed dim {embed_dim_to_check}, got {embed_dim}")
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise ValueError(
            f"multi_head_attention_forward: embed_dim {embed_dim} is not divisible by num_heads {num_heads}"
        )
    if is_causal and attn_mask is None:
        raise ValueError("multi_head_attention_forward: is_causal is a hint and needs attn_mask (as in torch)")
    kpm = _float_mask(key_padding_mask, "key_padding_mask", query.dtype)
    causal = False
    if is_causal and kpm is None and not need_weights:
        attn_mask = None  # causal over global positions
        causal = True
    mask = _float_mask(attn_mask, "attn_mask", query.dtype)

    # in-projection: per token, local
    if not use_separate_proj_weight:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = q_proj_weight, k_proj_weight, v_proj_weight
    b_q, b_k, b_v = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    q = F.linear(query, w_q, b_q)  # (Lq_local, N, E)
    k = F.linear(key, w_k, b_k)  # (Lk_local, N, E)
    v = F.linear(value, w_v, b_v)
    src_len = k.size(0)
    q = q.view(tgt_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)  # (N, H, Lq_local, hd)
    k = k.view(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    v = v.view(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)

    if mask is not None:
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)  # (1, Lq_local, Lk_global)
        elif mask.dim() != 3 or mask.size(0) != bsz * num_heads:
            raise ValueError(
                f"multi_head_attention_forward: attn_mask must be (Lq_local, Lk_global) or "
                f"(N*num_heads={bsz * num_heads}, Lq_local, Lk_global), got {tuple(attn_mask.shape)}"
            )
    if kpm is not None:
        if kpm.dim() != 2 or kpm.size(0) != bsz:
            raise ValueError(
                f"multi_head_attention_forward: key_padding_mask must be (N={bsz}, Lk_global), got "
                f"{tuple(key_padding_mask.shape)}"
            )
        kpm = kpm.view(bsz, 1, 1, kpm.size(-1)).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, -1)
        mask = kpm if mask is None else mask + kpm
    dropout_p = dropout_p if training else 0.0
    if need_weights:  # the weights' rows are wanted
        out, weights = attention_with_weights(
            q,
            k,
            v,
            mask,
            dropout_p,
            average_attn_weights,
            mesh=mesh,
            kv_sharded=kv_sharded,
            q_positions=q_positions,
            kv_positions=kv_positions,
        )
    else:
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.size(0) == 1 else mask.view(bsz, num_heads, -1, mask.size(-1))
        out, weights = (
            scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                mesh=mesh,
                kv_sharded=kv_sharded,
                q_positions=q_positions,
                kv_positions=kv_positions,
                algorithm=algorithm,
            ),
            None,
        )
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)  # (Lq_local * N, E)
    out = F.linear(out, out_proj_weight, out_proj_bias).view(tgt_len, bsz, out_proj_weight.size(0))
    if not batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights
