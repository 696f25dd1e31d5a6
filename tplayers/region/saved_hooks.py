"""Which ``torch.utils.checkpoint`` (``use_reentrant=False``) forward, if any, the code now runs in.

A non-reentrant checkpoint runs its function under saved-tensor hooks of its own; the region guard
records the hooks in place when its call and each module call inside it begin, so an op on sharded
data that runs under a checkpoint's hooks newer than its innermost module call's is in the body of a
checkpointed plain function, outside any module: its recomputation in backward would run with no
guard (:mod:`tplayers.region.recompute` re-guards module calls), so the guard refuses it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["saved_pack", "is_checkpoint_pack", "BODY_ADVICE"]

#: the fix a refusal of an op in a checkpointed function's body names
BODY_ADVICE = (
    "torch.utils.checkpoint recomputes it in backward, where the guard re-enters module calls only "
    "(tplayers.region.recompute). Pass context_fn=tplayers.region_context_fn to the checkpoint (for "
    "transformers: gradient_checkpointing_kwargs={'use_reentrant': False, 'context_fn': "
    "tplayers.region_context_fn}), or checkpoint a module's call, checkpoint(module, x), as diffusers does."
)


def saved_pack() -> Optional[Any]:
    """The innermost saved-tensor pack hook in place now (``None``: none)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if hooks is None else hooks[0]


def is_checkpoint_pack(pack: Any) -> bool:
    """Whether ``pack`` is the pack hook of a non-reentrant ``torch.utils.checkpoint`` forward."""
    return (getattr(pack, "__qualname__", "") or "").startswith("_checkpoint_hook.")
