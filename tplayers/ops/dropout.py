"""Dropout on a slice of a tensor that draws exactly that slice of the serial mask.

``F.dropout`` on the full ``(..., n, ...)`` tensor draws its mask from the default generator
in one call whose result depends on the full shape; no skip-ahead reproduces a slice of it
on every backend. So :func:`dropout_slice` draws the full mask with the very call the serial
``F.dropout`` makes (same shape, dtype and device, hence the same values) and keeps the slice:

- CPU: ``empty(full).bernoulli_(1 - p)`` then ``div_(1 - p)``, output ``x * noise``
  (``at::_dropout``'s path on the CPU);
- CUDA (and other fused-kernel devices): ``native_dropout`` on an empty full tensor gives the
  fused kernel's mask; the output is ``native_dropout_backward(x, mask, 1 / (1 - p))``, the
  same ``x * mask * scale`` as the fused kernel, bitwise. Not run here: no GPU was available.

Cost: every rank draws the full mask (the serial layer's RNG work and one full-size
temporary) instead of ``1 / world`` of it; the generator then advances exactly as the serial
model's, so every later random op matches too. ``p == 0``, ``p == 1``, eval mode and an empty
full tensor draw nothing, as in ``F.dropout``.

>>> import torch
>>> _ = torch.manual_seed(0); full = torch.nn.functional.dropout(torch.ones(2, 6), 0.5)
>>> _ = torch.manual_seed(0); part = dropout_slice(torch.ones(2, 2), 0.5, True, (2, 6), 1, 4)
>>> torch.equal(part, full[:, 4:6])
True
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["dropout_slice"]


def dropout_slice(
    x: torch.Tensor, p: float, training: bool, full_shape: Sequence[int], dim: int, start: int
) -> torch.Tensor:
    """``F.dropout(full, p, training)`` restricted to ``x = full.narrow(dim, start, x.size(dim))``,
    drawing the same random numbers as the serial call on the full tensor (see module doc)."""
    full_shape = tuple(int(s) for s in full_shape)
    dim = dim % len(full_shape)
    numel = 1
    for s in full_shape:
        numel *= s
    if not training or p == 0 or numel == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    length = x.size(dim)
    if x.device.type == "cpu":
        noise = torch.empty(full_shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        noise.div_(1 - p)
        return x * noise.narrow(dim, start, length)
    _, mask = torch.native_dropout(torch.empty(full_shape, dtype=x.dtype, device=x.device), p, True)
    return torch.ops.aten.native_dropout_backward(x, mask.narrow(dim, start, length), 1.0 / (1.0 - p))
