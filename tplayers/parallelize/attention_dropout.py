"""Attention dropout on split heads: refused in training (docs/design.md, plans).

transformers applies attention dropout inside its attention functions, on the probabilities
``(B, heads, S, S)``: SDPA's ``dropout_p`` or ``F.dropout`` in the eager path, with ``p`` read from
the attention module (``attention_dropout``: Llama, Qwen, Mistral, Gemma, ...; ``attn_dropout``, an
``nn.Dropout``: GPT-2). Once the heads are split, every rank draws a mask for *its* heads from the
same generator state, which is not the serial mask's slice: the result is silently wrong. No plan
entry reaches those calls, so :func:`guard_attention_dropout` puts a forward pre-hook on every
module whose heads a plan split (a parent of a head-sharded :class:`~tplayers.ColumnParallelLinear`)
that raises ``ValueError`` when the module runs in training with ``p > 0``, naming the module and
the config field. Every rank holds the same module, flag and ``p``, so every rank raises, at the
same point of the same forward. Evaluation (``model.eval()``) and ``p = 0`` run as before.

One exception is exact and not refused: an eager attention whose ``attn_dropout`` module was
swapped for :class:`~tplayers.ParallelDropout` over the heads (``ShardedDropout(dim=1,
full_size=heads)`` in the plan), which draws the serial mask's slice; with SDPA (which reads only
``attn_dropout.p``) it is refused too.
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from tplayers.layers.dropout import ParallelDropout
from tplayers.layers.linear import ColumnParallelLinear

__all__ = ["guard_attention_dropout", "attention_dropout_refusal"]

#: attributes of an attention module holding its attention-probability dropout (a float or nn.Dropout)
_ATTRIBUTES = ("attention_dropout", "attn_dropout", "attn_pdrop", "dropout")
#: the config fields transformers reads them from
_CONFIG_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_QUERY_NAMES = ("q_proj", "q", "query", "wq", "q_attn", "c_attn", "qkv_proj", "Wqkv", "query_key_value")


def _splits_heads(module: nn.Module) -> bool:
    for name, child in module.named_children():
        if isinstance(child, ColumnParallelLinear) and child.tp_size > 1 and not child.gather_output:
            if child.head_dim is not None or name in _QUERY_NAMES:
                return True
    return False


def _dropout_of(module: nn.Module) -> Optional[Tuple[str, float, bool]]:
    """``(attribute, p, exact)`` of the first attention-dropout attribute with ``p > 0`` (an
    ``nn.Dropout`` named ``dropout`` is left out: inside an attention it may drop the output)."""
    for attr in _ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, (nn.Dropout, ParallelDropout)) and attr != "dropout":
            p, exact = float(value.p), isinstance(value, ParallelDropout)
        elif isinstance(value, float):
            p, exact = value, False
        else:
            continue
        if p > 0:
            return attr, p, exact
    return None


def _config_field(module: nn.Module, p: float) -> str:
    config = getattr(module, "config", None)
    for field in _CONFIG_FIELDS:
        if config is not None and getattr(config, field, None) == p:
            return f"config.{field}={p}"
    return ""


def attention_dropout_refusal(name: str, module: nn.Module) -> Optional[str]:
    """The refusal message for ``module`` as it would run now, or ``None`` when it may run."""
    if not module.training or not _splits_heads(module):
        return None
    found = _dropout_of(module)
    if found is None:
        return None
    attr, p, exact = found
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None) if config is not None else None
    if exact and impl in (None, "eager"):
        return None
    field = _config_field(module, p)
    where = f"{field} (module attribute {attr})" if field else f"module attribute {attr}={p}"
    return (
        f"attention dropout in training on split heads: {type(module).__name__} {name!r} has {where}; "
        f"its attention function draws the dropout mask for this rank's heads only, which is not the "
        f"serial mask's slice, so the model would be silently wrong. Set the attention dropout to 0 "
        f"before building the model (e.g. config.attention_dropout=0.0 / attn_pdrop=0.0), or run it "
        f"in eval mode"
    )


def _hook(module: nn.Module, args) -> None:
    message = attention_dropout_refusal(module.__dict__.get("_tplayers_name", ""), module)
    if message is not None:
        raise ValueError(message)


def guard_attention_dropout(model: nn.Module) -> None:
    """Put the refusal hook (once) on every module of ``model`` whose heads are split."""
    for name, module in model.named_modules():
        if not _splits_heads(module) or _hook in module._forward_pre_hooks.values():
            continue
        module._tplayers_name = name
        module.register_forward_pre_hook(_hook)
