"""``nn.ConvNd`` subclasses inside a ``DomainParallel`` region: which are swapped, which the guard runs.

Twins are matched by exact type (:data:`~tplayers.parallelize.domain_styles.DOMAIN_TWINS`), so a
subclass is not swapped for the plain twin, which would drop what its ``forward`` adds. Two kinds:

* a subclass computing TensorFlow "SAME" padding from its input's length (timm's ``Conv2dSame``:
  ``F.pad`` by the amount ``pad_same`` computes, then ``F.conv2d`` with ``padding=0``): on a shard
  that length is local, and with a stride the amount depends on it, so the guard could not make the
  pad exact. It is swapped for :class:`~tplayers.layers.conv_same.DistributedConv2dSame` (1-D / 3-D
  likewise), which pads by the amount of the *global* length. Recognised by behaviour, not name:
  built with ``padding=0`` and zeros padding mode, and its own ``forward`` on probe inputs of every
  length residue modulo the stride (each dim) equals, bit for bit, the "SAME" convolution of its
  weight and bias (:func:`same_padding_twin`);
* any other subclass (timm's ``ScaledStdConv2d`` standardizing its weight, a subclass that only adds
  attributes) stays as it is: the region guard routes its ``F.conv*d`` call, with whatever weight it
  computed, through the window core (:mod:`tplayers.region.rules_conv`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import tplayers.layers.conv_same as S

__all__ = ["same_padding_twin"]

_SAME = (
    (nn.Conv1d, S.DistributedConv1dSame),
    (nn.Conv2d, S.DistributedConv2dSame),
    (nn.Conv3d, S.DistributedConv3dSame),
)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _reference(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    pad = []
    for i in reversed(range(x.dim() - 2)):  # F.pad lists the last dim first
        pad.extend(S.same_pads(x.shape[2 + i], module.kernel_size[i], module.stride[i], module.dilation[i]))
    return _CONV[x.dim() - 2](
        F.pad(x, pad), module.weight, module.bias, module.stride, 0, module.dilation, module.groups
    )


def same_padding_twin(module: nn.Module) -> Optional[type]:
    """The "SAME"-padding twin class for ``module`` when it is an ``nn.ConvNd`` subclass with its own
    ``forward`` that pads its input to TensorFlow "SAME" by the input's length (confirmed by running
    it, see the module docstring); else ``None``."""
    for base, twin in _SAME:
        if not isinstance(module, base) or type(module) is base or type(module).forward is base.forward:
            continue
        if isinstance(module.padding, str) or any(module.padding) or module.padding_mode != "zeros":
            return None
        w = module.weight
        if not isinstance(w, torch.Tensor) or w.device.type == "meta" or not w.is_floating_point():
            return None
        n = w.dim() - 2
        span = [module.dilation[i] * (module.kernel_size[i] - 1) + 1 for i in range(n)]
        gen = torch.Generator(device=w.device).manual_seed(0)
        with torch.no_grad():
            for r in range(max(module.stride)):
                lengths = [span[i] + module.stride[i] + r % module.stride[i] for i in range(n)]
                x = torch.randn([1, module.in_channels] + lengths, generator=gen, dtype=w.dtype, device=w.device)
                try:
                    got = module.forward(x)  # not module(x): the user's hooks never see the probes
                except Exception:  # noqa: BLE001 - not a convolution of this shape: not recognised
                    return None
                want = _reference(module, x)
                if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
                    return None
        return twin
    return None
