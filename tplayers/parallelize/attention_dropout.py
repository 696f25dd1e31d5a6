"""Attention dropout on split heads: the serial mask's slice (eager), else refused in training.

transformers applies attention dropout inside its attention functions, on the probabilities
``(B, heads, S, S)``: ``F.dropout`` in the eager path (``eager_attention_forward``, or GPT-2's
``attn_dropout`` module in its upcast path), SDPA's ``dropout_p`` otherwise, with ``p`` read from the
attention module (``attention_dropout``: Llama, Qwen, Mistral, Gemma, ...; ``attn_dropout``, an
``nn.Dropout``: GPT-2). Once the heads are split, each rank's ``F.dropout`` would draw a mask for
*its* heads from the same generator state, not the serial mask's slice: silently wrong. No plan entry
reaches those calls, so :func:`guard_attention_dropout` hooks every module whose heads a plan split
(a parent of a head-sharded :class:`~tplayers.ColumnParallelLinear`). In training with ``p > 0``:

- **transformers eager attention** (the module's ``config._attn_implementation == "eager"`` and its
  Python module defines ``eager_attention_forward``): the module's forward runs under
  :class:`HeadSliceDropout`, a ``TorchFunctionMode`` in which ``F.dropout`` on a ``(B, local heads,
  ...)`` tensor draws the serial ``(B, heads, ...)`` mask with the serial call and keeps this rank's
  heads (:func:`~tplayers.ops.dropout.dropout_slice`): exact, and the generator advances as the
  serial model's. Other dropouts there (GPT-2's ``resid_dropout`` on replicated data) run as they
  are; any other random op (``bernoulli``, ``rand``, SDPA with ``dropout_p > 0``, ...) raises
  ``ValueError`` naming it, on every rank (deny by default).
- **otherwise** (SDPA, flash, a hand-written attention): ``ValueError`` on every rank naming the module
  and the config field, at the same point of the same forward. One exception is exact and not
  refused: an eager attention whose ``attn_dropout`` module was swapped for
  :class:`~tplayers.ParallelDropout` over the heads (``ShardedDropout(dim=1, full_size=heads)``).

Evaluation (``model.eval()``) and ``p = 0`` run as before.
"""

from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tplayers.layers.dropout import ParallelDropout
from tplayers.layers.linear import ColumnParallelLinear
from tplayers.ops.dropout import dropout_slice

__all__ = ["guard_attention_dropout", "attention_dropout_refusal", "HeadSliceDropout"]

#: attributes of an attention module holding its attention-probability dropout (a float or nn.Dropout)
_ATTRIBUTES = ("attention_dropout", "attn_dropout", "attn_pdrop", "dropout")
#: the config fields transformers reads them from
_CONFIG_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_QUERY_NAMES = ("q_proj", "q", "query", "wq", "q_attn", "c_attn", "qkv_proj", "Wqkv", "query_key_value")
#: random ops refused under HeadSliceDropout (their draws on split heads are not the serial ones)
_RANDOM = frozenset(
    "bernoulli bernoulli_ rand rand_like randn randn_like randint randint_like randperm normal normal_ "
    "uniform_ random_ exponential_ geometric_ log_normal_ cauchy_ multinomial dropout dropout_ native_dropout "
    "dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout feature_dropout".split()
)


def _query(module: nn.Module) -> Optional[ColumnParallelLinear]:
    """The head-split query (or fused q/k/v) projection of ``module``, or ``None`` (its heads are whole)."""
    other = None
    for name, child in module.named_children():
        if isinstance(child, ColumnParallelLinear) and child.tp_size > 1 and not child.gather_output:
            if name in _QUERY_NAMES:
                return child  # a query name first
            if child.head_dim is not None and other is None:
                other = child
    return other


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


def _where(module: nn.Module, attr: str, p: float) -> str:
    field = _config_field(module, p)
    return f"{field} (module attribute {attr})" if field else f"module attribute {attr}={p}"


def _impl(module: nn.Module) -> Optional[str]:
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def _transformers_eager(module: nn.Module) -> bool:
    """A transformers attention running its eager path (probabilities ``(B, heads, q, k)``)."""
    home = sys.modules.get(type(module).__module__)
    return _impl(module) == "eager" and callable(getattr(home, "eager_attention_forward", None))


def _head_layout(module: nn.Module) -> Optional[Tuple[int, int, int]]:
    """``(query heads, this rank's first query head, this rank's query heads)``, or ``None``."""
    q = _query(module)
    if q is None or q.head_dim is None:
        return None
    hd = q.head_dim
    total = (q.sections[0] if q.sections is not None else q.out_features) // hd
    start, stop = q.weight_ranges[0]
    return total, start // hd, (stop - start) // hd


def attention_dropout_refusal(name: str, module: nn.Module) -> Optional[str]:
    """The refusal message for ``module`` as it would run now, or ``None`` when it may run (as it is,
    or under :class:`HeadSliceDropout` where :func:`_transformers_eager` holds)."""
    if not module.training or _query(module) is None:
        return None
    found = _dropout_of(module)
    if found is None:
        return None
    attr, p, exact = found
    if exact and _impl(module) in (None, "eager"):
        return None
    if _transformers_eager(module) and _head_layout(module) is not None:
        return None
    if _impl(module) == "eager":  # eager, but not transformers' convention or not split by whole heads
        fix = (
            "tplayers makes eager attention dropout exact only for a transformers attention (its module defines "
            "eager_attention_forward) whose query projection the plan splits by whole heads (head_dim)"
        )
    else:
        fix = "use attn_implementation='eager' (whose dropout tplayers makes exact)"
    return (
        f"attention dropout in training on split heads: {type(module).__name__} {name!r} has "
        f"{_where(module, attr, p)} and attention implementation {_impl(module)!r}; its attention function "
        f"draws the dropout mask for this rank's heads only, which is not the serial mask's slice, so the model "
        f"would be silently wrong. {fix[0].upper() + fix[1:]}; or set the attention dropout to 0 before "
        f"building the model (e.g. config.attention_dropout=0.0 / attn_pdrop=0.0), or run it in eval mode"
    )


class HeadSliceDropout(TorchFunctionMode):
    """While active: ``F.dropout(x, p, training=True)`` on ``x`` ``(B, local_heads, q, k)`` (contiguous)
    returns ``x`` times this rank's heads ``[start, start + local_heads)`` of the mask the serial call
    draws on ``(B, heads, q, k)``; other ``F.dropout`` calls run unchanged; any other random op, and
    ``F.scaled_dot_product_attention`` with ``dropout_p > 0``, raises ``ValueError`` naming ``where``.

    Example (one process: a rank holding heads 2 and 3 of 5)::

        import torch, torch.nn.functional as F
        from tplayers.parallelize.attention_dropout import HeadSliceDropout
        x = torch.rand(2, 2, 3, 3)                          # (B, local heads, q, k) probabilities
        torch.manual_seed(0)
        serial = F.dropout(torch.ones(2, 5, 3, 3), 0.1)     # the serial mask (scaled), all heads
        torch.manual_seed(0)
        with HeadSliceDropout(heads=5, start=2, local=2, where="example"):
            y = F.dropout(x, 0.1)
        torch.testing.assert_close(y, x * serial[:, 2:4])
    """

    def __init__(self, heads: int, start: int, local: int, where: str) -> None:
        super().__init__()
        self.heads, self.start, self.local, self.where = heads, start, local, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x = args[0]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
            if training and p > 0 and x.dim() == 4 and x.shape[1] == self.local:  # this rank's heads
                if not x.is_contiguous() or inplace:  # the serial draw follows the memory order: not sliceable
                    self._refuse(
                        f"F.dropout(inplace={inplace}) on a non-contiguous or in-place (B, heads, q, k) tensor"
                    )
                full = (x.shape[0], self.heads) + tuple(x.shape[2:])
                return dropout_slice(x, p, True, full, 1, self.start)
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            p = args[5] if len(args) > 5 else kwargs.get("dropout_p", 0.0)
            if p > 0:
                self._refuse(f"F.scaled_dot_product_attention(dropout_p={p})")
        elif getattr(func, "__name__", "") in _RANDOM:
            self._refuse(getattr(func, "__qualname__", repr(func)))
        return func(*args, **kwargs)

    def _refuse(self, op: str) -> None:
        raise ValueError(
            f"attention dropout in training on split heads: {self.where} calls {op}, whose random draws on this "
            f"rank's heads are not the serial ones (only F.dropout on (batch, heads, ...) is made exact)"
        )


class _Hooks:
    """The pre-hook (refusal, or entering :class:`HeadSliceDropout`) and the always-called forward hook
    (leaving it) of one attention module (picklable)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.modes = []

    def before(self, module: nn.Module, args) -> None:
        message = attention_dropout_refusal(self.name, module)
        if message is not None:
            raise ValueError(message)
        mode = None
        found = _dropout_of(module) if module.training else None
        if found is not None and not found[2] and _transformers_eager(module):
            heads, start, local = _head_layout(module)
            mode = HeadSliceDropout(heads, start, local, f"{type(module).__name__} {self.name!r}")
            mode.__enter__()
        self.modes.append(mode)

    def after(self, module: nn.Module, args, output) -> None:
        mode = self.modes.pop() if self.modes else None
        if mode is not None:
            mode.__exit__(None, None, None)


def guard_attention_dropout(model: nn.Module) -> None:
    """Put the hooks (once) on every module of ``model`` whose heads are split."""
    for name, module in model.named_modules():
        if _query(module) is None or getattr(module, "_tplayers_dropout_hooks", None) is not None:
            continue
        hooks = _Hooks(name)
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after, always_call=True)
        module._tplayers_dropout_hooks = hooks
