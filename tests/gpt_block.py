"""A GPT-2 block in plain nn code (the serial oracle of the sequence-parallel tests).

c_attn's output rows are laid out head by head ([q_h | k_h | v_h] for each head h), Megatron's
layout, so a column-parallel split at whole heads (heads divisible by the world size) gives each
rank whole heads of q, k and v.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import tplayers


class Attention(nn.Module):
    def __init__(self, d, heads, p, dtype):
        super().__init__()
        self.head_dim = d // heads
        self.c_attn = nn.Linear(d, 3 * d, dtype=dtype)
        self.c_proj = nn.Linear(d, d, dtype=dtype)
        self.attn_dropout = nn.Dropout(p)
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):  # (B, S, d), or (B, S_local, d) under sequence parallelism
        qkv = self.c_attn(x)  # (B, S, 3 * d_here): the whole sequence either way
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # (B, S, heads_here, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (B, heads_here, S, hd)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, heads_here, S, S)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.attn_dropout(att.masked_fill(~causal, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)  # (B, S, heads_here * hd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d, p, dtype):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d, dtype=dtype), nn.Linear(4 * d, d, dtype=dtype)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d, heads, p=0.0, dtype=torch.float32, rms=False):
        super().__init__()
        norm = (lambda: nn.RMSNorm(d, dtype=dtype)) if rms else (lambda: nn.LayerNorm(d, dtype=dtype))
        self.ln_1, self.attn = norm(), Attention(d, heads, p, dtype)
        self.ln_2, self.mlp = norm(), MLP(d, p, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def sp_plan(heads):
    """Megatron tensor + sequence parallelism for :class:`Block` (keys relative to the block)."""
    return {
        r"ln_\d": tplayers.SequenceParallel(),
        r"attn\.c_attn|mlp\.c_fc": tplayers.ColumnParallel(sequence_parallel=True),
        r"(attn|mlp)\.c_proj": tplayers.RowParallel(sequence_parallel=True),
        r"attn\.attn_dropout": tplayers.ShardedDropout(dim=1, full_size=heads),
        r"attn\.resid_dropout|mlp\.dropout": tplayers.SequenceParallel(),
    }
