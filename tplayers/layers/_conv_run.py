"""How :class:`~tplayers.layers.conv.DistributedConv1d` / ``2d`` / ``3d`` run one call: the memory format
``nn.ConvNd`` would give its output (:func:`serial_format`), the entry that picks the strategy
(:func:`halo_conv`: halo-padded, or main-plus-strips, :mod:`tplayers.layers._conv_fn`), and the padding of
the fused dim's boundary and of unsharded dims the convolution cannot pad itself (:func:`_prepare`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tplayers.domain.window import edge_pad, pad_arg, pad_dim
from tplayers.layers._conv_fn import ConvSpec, HaloConvFunction, _ConvCompute
from tplayers.layers._conv_strips import EdgeConvCompute, EdgeConvSave

__all__ = ["serial_format", "halo_conv"]

_CL = {2: torch.channels_last, 3: torch.channels_last_3d}


def _is_cl(t: torch.Tensor) -> bool:
    """Whether PyTorch suggests channels-last for ``t``: its strides read as ``suggest_memory_format``
    reads them (C, then the spatial dims last to first, then N, non-decreasing; ambiguous cases
    such as a trivial C default to contiguous), except that an empty shard (0 local rows) is read by
    its strides alone, as the non-empty tensor it was cut from (the serial layer sees that one)."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1,) + tuple(range(t.dim() - 1, 1, -1)) + (0,):
        if strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * max(sizes[d], 1)
    return True


def serial_format(x: torch.Tensor, weight: torch.Tensor, spatial: int, padding_mode: str) -> torch.memory_format:
    """The layout ``nn.ConvNd`` gives its output for ``x`` and ``weight``: channels-last (2-D / 3-D)
    when either is channels-last, else contiguous. As there: circular padding hands the
    convolution a contiguous padded input (only the weight counts), and the CPU's 3-D kernel for
    other dtypes than float32 / bfloat16 / float16 (no oneDNN) returns contiguous in any case."""
    if spatial == 1 or not ((padding_mode != "circular" and _is_cl(x)) or _is_cl(weight)):
        return torch.contiguous_format
    if spatial == 3 and x.device.type == "cpu" and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return torch.contiguous_format
    return _CL[spatial]


def halo_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spec: ConvSpec, reduce: bool = True
) -> torch.Tensor:
    """The distributed convolution of ``x`` (this rank's rows) by ``spec``'s strategy (:mod:`tplayers.layers._conv_fn`).

    Halo-padded (``spec.strips`` None, or while compiling): :class:`HaloConvFunction` (exchange, save,
    the whole backward) then :class:`_ConvCompute` (the local convolution, nothing saved).
    Main-plus-strips: :class:`EdgeConvSave` (saves the input and the weight, the whole backward) then
    :class:`EdgeConvCompute` (the exchange in flight behind the main convolution, then the strips; it
    hands the received halo rows, the weight gradient's strips, to :class:`EdgeConvSave`'s context).
    Two Functions so that activation checkpointing (``use_reentrant=False``) can stop its
    recomputation before the convolution: it stops once every saved tensor is back, and a custom
    Function registers its saved tensors only when its forward returns, so saving and computing in
    one Function would recompute the region's last convolution for nothing.
    ``reduce=False``: the weight and bias gradients are returned as this rank's partial sums (a
    region's gradient buckets sum them, :mod:`tplayers.comm.buckets`).
    """
    if spec.strips is not None and not torch.compiler.is_compiling():
        x = x.contiguous(memory_format=spec.memory_format)  # the layout the plan convolves in
        halos: dict = {}  # filled by EdgeConvCompute: the received halo rows, for the weight gradient
        token = EdgeConvSave.apply(x, weight, bias, spec, halos, reduce)
        return EdgeConvCompute.apply(
            token, x.detach(), weight.detach(), None if bias is None else bias.detach(), spec, halos
        )
    token, xp = HaloConvFunction.apply(x, weight, bias, spec, reduce)
    return _ConvCompute.apply(token, xp, weight, bias, spec)


def _prepare(xp: torch.Tensor, *, dim: int, plan, mode: str, extra) -> torch.Tensor:
    """The fused dim's boundary padding and trim, then padding of unsharded dims the convolution
    cannot do itself (``extra``: (dim, lo, hi); asymmetric "same" zeros, circular / reflect / replicate)."""
    x = edge_pad(xp, dim, plan, mode)
    for d, lo, hi in extra:
        x = F.pad(x, pad_arg(x.dim(), d, lo, hi)) if mode == "zeros" else pad_dim(x, d, lo, hi, mode)
    return x
