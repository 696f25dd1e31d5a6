"""A vocab-parallel ``lm_head`` refuses cached decoding (``generate()``) instead of aborting it.

With ``plan_from_transformers(..., vocab_parallel=True)`` the head returns this rank's slice of the
vocabulary. ``generate()`` would pick each rank's next token from its own slice: the ranks diverge,
and gloo aborts in a later collective ("Received data size doesn't match expected size"). The head's
style (:class:`VocabParallelHead`) puts a forward pre-hook on the model that raises ``ValueError`` on
every rank when a forward carries a cache (``past_key_values``) or ``logits_to_keep`` (what
``generate()`` passes) while the head keeps local logits. For generation gather them:
``model.lm_head.gather_output = True`` (exact: the serial logits on every rank), and back to
``False`` for the vocab-parallel loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from tplayers.parallelize.styles import ColumnParallel

__all__ = ["VocabParallelHead"]


class _RefuseLocalLogitsDecoding:
    """The model's forward pre-hook (a picklable object holding the head's module name)."""

    def __init__(self, head_name: str) -> None:
        self.head_name = head_name

    def __call__(self, model, args, kwargs):
        head = model.get_submodule(self.head_name)
        if getattr(head, "gather_output", True):
            return None
        cached = kwargs.get("past_key_values") is not None
        keep = kwargs.get("logits_to_keep")
        if cached or (keep is not None and not (isinstance(keep, int) and keep == 0)):
            raise ValueError(
                f"{type(model).__name__}: decoding (generate(), or a forward with past_key_values / "
                f"logits_to_keep) with a vocab-parallel {self.head_name!r}: each rank would choose its next token "
                f"from its own slice of the vocabulary. Set model.{self.head_name}.gather_output = True for "
                f"generation (the serial logits on every rank), and back to False for the vocab-parallel loss"
            )
        return None


@dataclass(frozen=True)
class VocabParallelHead(ColumnParallel):
    """``ColumnParallel()`` on a transformers ``lm_head`` kept vocab-parallel (local logits), with the
    decoding refusal above on the model."""

    def finalize(self, model, mesh):
        for name, module in model.named_modules():
            if getattr(module, "_tplayers_vocab_head", False):
                continue
            if type(module).__name__.endswith("ForCausalLM") or hasattr(module, "generate"):
                head = getattr(module, "get_output_embeddings", lambda: None)()
                names = {id(m): n for n, m in module.named_modules()}
                if head is not None and id(head) in names and not getattr(head, "gather_output", True):
                    module.register_forward_pre_hook(_RefuseLocalLogitsDecoding(names[id(head)]), with_kwargs=True)
                    module._tplayers_vocab_head = True
        return model
