"""Peak bytes of live tensor storages while a function runs (CPU or any device).

A ``TorchDispatchMode`` sees every tensor an op creates; storages are held by
weak reference, so freed ones drop out. The peak counts storages allocated
inside the block only: views, in-place and ``out=`` results of tensors that
already existed (inputs, caches) are not counted.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _PeakTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an out=/in-place result shares an input's storage: not a new allocation
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in inputs:
                    self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.live = {key: val for key, val in self.live.items() if not val[0].expired()}
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def peak_bytes(fn) -> int:
    """Peak bytes of tensors allocated (and still alive) during ``fn()``."""
    with _PeakTracker() as tracker:
        result = fn()
    del result
    return tracker.peak
