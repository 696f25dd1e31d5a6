"""An attention's head bookkeeping after its projections are split by heads (docs/huggingface.md).

transformers' attention modules read head counts in ``forward`` (``num_key_value_groups`` to repeat
key/value heads, GPT-2's ``split_size`` to cut its fused ``c_attn`` output, ``num_heads``); once a
plan splits the projections by whole heads those must be this rank's. :func:`localize_heads` sets
them; :func:`~tplayers.parallelize_module` runs it on every module after any plan's swap (hand
plans included), and ``plan_from_transformers``' attention style does the same.
"""

from __future__ import annotations

from torch import nn

from tplayers.layers.linear import ColumnParallelLinear
from tplayers.parallelize.hf_sequence import SequenceGathered

__all__ = ["localize_heads", "Q", "KV", "FUSED"]

Q = ("q_proj", "query", "q_attn")
KV = ("k_proj", "v_proj", "key", "value")
FUSED = ("c_attn", "qkv_proj", "Wqkv")  # [q | k | v] blocks, one after the other


def localize_heads(attn: nn.Module) -> None:
    """Set a transformers attention's head counts to this rank's, from its head-sharded q (or fused
    qkv) projection: ``num_key_value_groups``, GPT-2's ``split_size``, ``num_heads`` (each only where
    the module has it, with the type transformers gives it). A module without a head-sharded query
    projection is left alone; running it twice changes nothing."""
    kids = dict(attn.named_children())
    if isinstance(attn, SequenceGathered):
        attn = attn.module  # its head counts live on the wrapped attention
    q = next((kids[n] for n in Q + FUSED if isinstance(kids.get(n), ColumnParallelLinear)), None)
    if q is None or q.head_dim is None:
        return
    hd, local = q.head_dim, q.local_sections
    if q.sections is not None and len(local) == 3:  # fused [q | k | v]
        q_heads, kv_heads = local[0] // hd, local[1] // hd
    else:
        k = next((kids[n] for n in KV if isinstance(kids.get(n), ColumnParallelLinear)), None)
        q_heads = local[0] // hd
        kv_heads = k.local_sections[0] // hd if k is not None else q_heads
    if isinstance(getattr(attn, "num_key_value_groups", None), int) and kv_heads:
        attn.num_key_value_groups = max(1, q_heads // kv_heads)
    if isinstance(getattr(attn, "split_size", None), (int, list)) and q.sections is not None and len(local) == 3:
        attn.split_size = list(local)  # GPT-2: c_attn(x).split(split_size) -> this rank's q, k, v (even if empty)
    if isinstance(getattr(attn, "num_heads", None), int):
        attn.num_heads = q_heads
