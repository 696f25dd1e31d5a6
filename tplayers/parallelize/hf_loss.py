"""A causal language model's loss from vocab-parallel logits (a transformers ``lm_head`` kept local)."""

from __future__ import annotations

import torch

from tplayers.losses import vocab_parallel_cross_entropy

__all__ = ["causal_lm_loss"]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, mesh=None, *, ignore_index: int = -100) -> torch.Tensor:
    """A causal language model's loss from this rank's vocabulary slice of the logits.

    ``logits`` ``(B, S, vocab_local)`` (a ``lm_head`` swapped with ``vocab_parallel=True``),
    ``labels`` ``(B, S)`` the input ids: position ``t`` predicts ``labels[:, t + 1]``, as
    transformers' ``ForCausalLMLoss`` shifts them; the mean over positions not equal to
    ``ignore_index``. Equals ``F.cross_entropy`` on the gathered, shifted logits (value and
    gradient) without gathering them (:func:`~tplayers.vocab_parallel_cross_entropy`).

    Args:
        logits: ``(B, S, vocab_local)``, this rank's vocabulary slice.
        labels: ``(B, S)`` int64 ids, replicated; ``ignore_index``: labels to skip.
        mesh: the 1-D mesh the vocabulary is split over (``None``: :func:`tplayers.default_mesh`).

    Returns:
        The mean loss, a 0-d tensor, the same on every rank.

    Raises:
        ValueError: other shapes (and :func:`~tplayers.vocab_parallel_cross_entropy`'s errors).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        dense = torch.nn.Linear(8, 50)
        head = tplayers.ColumnParallelLinear.from_module(dense, mesh=mesh)   # a vocab-parallel lm_head
        h, ids = torch.randn(2, 7, 8), torch.randint(0, 50, (2, 7))
        loss = tplayers.causal_lm_loss(head(h), ids, mesh)
        torch.testing.assert_close(loss, F.cross_entropy(dense(h)[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1)))
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"causal_lm_loss: expected logits (B, S, vocab_local) and labels (B, S), got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    return vocab_parallel_cross_entropy(logits[:, :-1], labels[:, 1:], mesh, ignore_index=ignore_index)
