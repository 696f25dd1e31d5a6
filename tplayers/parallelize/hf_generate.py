"""A vocab-parallel ``lm_head`` gathers its logits where decoding reads them: ``generate()`` is exact.

With ``plan_from_transformers(..., vocab_parallel=True)`` the head returns this rank's slice of the
vocabulary (the vocab-parallel loss never gathers it). ``generate()`` reads ``outputs.logits[:, -1]``
and picks the next token from it (argmax, sampling, beam scores, every logits processor): on a slice
each rank would pick its own token. The head's style (:class:`VocabParallelHead`) therefore puts a
forward pre-hook and an always-called forward hook on the model: a forward that decodes (it carries a
cache, ``past_key_values``, or a ``logits_to_keep`` other than 0, which ``generate()`` passes on every
step for every transformers causal LM) runs with the head's ``gather_output`` set to ``True`` and restored after.
The head's all-gather (its own visible collective, uneven vocabulary slices included) then gives every
rank the serial logits of the positions kept (one position per step: ``B x vocab`` values), so greedy
and, under one seed on every rank, sampled tokens equal the serial model's, with the KV cache and
left padding as transformers handles them. A plain forward (``model(ids)``) keeps the local logits.

A sequence-parallel head (``sequence_parallel=True``) still refuses decoding: ``ValueError`` on every
rank (the model sees this rank's tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

from tplayers.parallelize.styles import ColumnParallel

__all__ = ["VocabParallelHead", "decodes"]


def decodes(kwargs) -> bool:
    """Whether a transformers forward's keywords are a decoding step's: a cache, or a ``logits_to_keep``
    other than ``0`` (which keeps every position, as a plain forward does)."""
    keep = kwargs.get("logits_to_keep")
    keeps_some = keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep == 0)
    return kwargs.get("past_key_values") is not None or keeps_some


class _GatherWhenDecoding:
    """The model's forward pre-hook and forward hook (picklable: the head's module name and a stack of
    the ``gather_output`` values to restore)."""

    def __init__(self, head_name: str) -> None:
        self.head_name = head_name
        self.saved = []

    def before(self, model, args, kwargs):
        head = model.get_submodule(self.head_name)
        self.saved.append(None)
        if getattr(head, "gather_output", True) or not decodes(kwargs):
            return None
        if getattr(head, "sequence_parallel", False):
            raise ValueError(
                f"{type(model).__name__}: decoding (generate(), or a forward with past_key_values / logits_to_keep) "
                f"with a sequence-parallel {self.head_name!r} is not supported (the model sees this rank's tokens "
                f"only); build the decoding model without sequence_parallel=True"
            )
        self.saved[-1] = head.gather_output
        head.gather_output = True  # this forward's logits: the serial ones on every rank
        return None

    def after(self, model, args, kwargs, output):
        previous = self.saved.pop() if self.saved else None
        if previous is not None:
            model.get_submodule(self.head_name).gather_output = previous
        return None


@dataclass(frozen=True)
class VocabParallelHead(ColumnParallel):
    """``ColumnParallel()`` on a transformers ``lm_head`` kept vocab-parallel (local logits), whose model
    gathers the logits of decoding forwards (above).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers, transformers
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2)
        serial = transformers.LlamaForCausalLM(config).eval()
        model = copy.deepcopy(serial)
        model = tplayers.parallelize_module(model, tplayers.plan_from_transformers(model, vocab_parallel=True))
        ids = torch.randint(1, 50, (2, 4))
        assert model(ids).logits.shape[-1] == tplayers.shard_sizes(50, tplayers.default_mesh().size())[
            tplayers.default_mesh().get_local_rank()]                        # a plain forward: local logits
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kw), serial.generate(ids, **kw))   # the serial tokens
    """

    def finalize(self, model, mesh):
        for name, module in model.named_modules():
            if getattr(module, "_tplayers_vocab_head", False):
                continue
            if type(module).__name__.endswith("ForCausalLM") or hasattr(module, "generate"):
                head = getattr(module, "get_output_embeddings", lambda: None)()
                names = {id(m): n for n, m in module.named_modules()}
                if head is not None and id(head) in names and not getattr(head, "gather_output", True):
                    hooks = _GatherWhenDecoding(names[id(head)])
                    module.register_forward_pre_hook(hooks.before, with_kwargs=True)
                    module.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)
                    module._tplayers_vocab_head = True
        return model
