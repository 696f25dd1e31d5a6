"""Sharded tensors seen again as untagged aliases during a nested recomputation.

Under nested activation checkpoints (transformers' ``SwinStage`` and ``SwinLayer`` are both
``GradientCheckpointingLayer``\\ s), the inner checkpoint's inputs are tensors its parent saved.
Recomputing the parent re-creates them under the recomputation guard, tagged as sharded; but torch
stores them through its recomputation hook as ``x.detach()``, a new tensor object without the tag,
and hands that copy to the inner checkpoint's recomputation. Left untagged, the inner block's ops
would read the local slice as if it were the whole (serial) tensor.

A detached copy shares the tagged tensor's storage, offset, shape, strides and dtype, so it holds
the same slice with the same layout. While a call is recomputed, every tensor the guard tags is
remembered by that signature with a weak reference to its storage, its call's token and its layout
(:class:`Aliases`, one per region). An untagged tensor met later in that call's recomputation whose
signature is remembered *and whose storage is still that storage* (alive: no other tensor can have
reused its memory) is tagged with the remembered layout (:func:`recover`, at each op of a
recomputation guard); a module recomputed with such a copy as its only sharded argument finds its
call's token there (:func:`tplayers.region.recompute.enter_recompute`). The record keeps no tensor
memory alive; records of freed storages are dropped as it grows.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Aliases", "recover", "signature"]


def signature(t: torch.Tensor) -> Tuple:
    """What a detached copy shares with its tensor: storage address, offset, shape, strides, dtype (read
    with torch-function modes off: the guard must not see its own bookkeeping as the model's ops)."""
    with torch._C.DisableTorchFunction():
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    """``t``'s storage, ``None`` where it has no memory to identify it (meta, empty)."""
    with torch._C.DisableTorchFunction():
        if t.is_meta:
            return None
        storage = t.untyped_storage()
    return storage if storage.data_ptr() != 0 else None


class Aliases:
    """The tokens and layouts of the tensors a region's recomputations tagged, by :func:`signature`."""

    def __init__(self) -> None:
        self._seen: Dict[Tuple, Tuple[StorageWeakRef, Any, Any]] = {}
        self._limit = 256

    def __len__(self) -> int:
        return len(self._seen)

    def __reduce__(self):  # copies and pickles of a model start with an empty record (weak references do not travel)
        return (Aliases, ())

    def remember(self, t: torch.Tensor, token: Any, layout: Any) -> None:
        storage = _storage(t)
        if storage is None:  # no memory: no identity to match
            return
        self._seen[signature(t)] = (StorageWeakRef(storage), token, layout)
        if len(self._seen) > self._limit:  # drop the records of freed storages
            self._seen = {k: v for k, v in self._seen.items() if not v[0].expired()}
            self._limit = max(256, 2 * len(self._seen))

    def _hit(self, t: torch.Tensor) -> Optional[Tuple]:
        if _storage(t) is None:
            return None
        hit = self._seen.get(signature(t))
        return None if hit is None or hit[0].expired() else hit

    def token_of(self, t: Any) -> Optional[Any]:
        """The call token of the tagged tensor ``t`` is an alias of (``None``: none remembered, or freed)."""
        hit = self._hit(t) if isinstance(t, torch.Tensor) else None
        return None if hit is None else hit[1]

    def layout_of(self, t: torch.Tensor, token: Any) -> Optional[Any]:
        """The layout of the tensor of call ``token`` that ``t`` is an alias of (``None``: none)."""
        hit = self._hit(t)
        return None if hit is None or hit[1] is not token else hit[2]


def recover(guard: Any, args, kwargs) -> None:
    """Tag the untagged tensor arguments of an op (top level, or in a list / tuple) that are aliases of
    tensors ``guard``'s call tagged during its recomputation (``guard.aliases``)."""
    aliases = guard.aliases
    for a in list(args) + list(kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and guard.layout(t) is None:
                layout = aliases.layout_of(t, guard.token)
                if layout is not None:
                    guard.mark(t, layout)
