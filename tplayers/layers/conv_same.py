"""Convolutions with TensorFlow's "SAME" padding computed from the global length (timm's ``Conv2dSame``).

TensorFlow-ported models (timm's ``tf_efficientnet_*``, ``tf_mobilenetv3_*``, ...) use
``Conv2dSame``: an ``nn.Conv2d`` with ``padding=0`` whose ``forward`` pads each spatial dim of its
input by ``max((ceil(L / s) - 1) * s + (k - 1) * d + 1 - L, 0)`` rows (``L`` the input's length,
``s`` the stride, ``k`` the kernel, ``d`` the dilation), the smaller half before, then convolves.
On a shard, ``L`` would be the local length, and with a stride the padding depends on ``L mod s``:
each rank would pad by its own amount, not the serial one. The twins here compute the padding from
the *global* length of each dim when they plan a partition (the same on every rank) and are then
ordinary :class:`~tplayers.DistributedConv2d` convolutions with that (possibly asymmetric) zero
padding: exact, gradients included.

``DomainParallel`` swaps an ``nn.ConvNd`` subclass for them when running the subclass's own
``forward`` on probe inputs of every length residue modulo the stride gives, bit for bit, the
TF-"SAME" convolution (:func:`tplayers.parallelize.conv_subclasses.same_padding_twin`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d

__all__ = ["same_pads", "DistributedConv1dSame", "DistributedConv2dSame", "DistributedConv3dSame"]


def same_pads(length: int, kernel: int, stride: int, dilation: int) -> Tuple[int, int]:
    """TensorFlow "SAME" ``(lo, hi)`` zero padding of a dim of ``length`` rows (timm's ``pad_same``)."""
    total = max((-(-length // stride) - 1) * stride + (kernel - 1) * dilation + 1 - length, 0)
    return total // 2, total - total // 2


class _SamePadding:
    """Sets the layer's padding from the global lengths of the partition being planned."""

    def _build(self, shape, sizes, like):
        pads = []
        for i in range(self.spatial):
            d = 2 + i
            length = sum(sizes[d]) if d in sizes else int(shape[d])
            pads.append(same_pads(length, self.kernel_size[i], self.stride[i], self.dilation[i]))
        self._pads = tuple(pads)
        return super()._build(shape, sizes, like)

    def _config(self):
        return {**super()._config(), "padding": "tf-same"}

    @classmethod
    def from_module(cls, conv: nn.Module, *, mesh: Optional[DeviceMesh] = None, shard_dims: Sequence[int] = (2,)):
        """The twin of ``conv`` (an ``nn.ConvNd`` subclass computing "SAME" padding in its ``forward``,
        built with ``padding=0``), holding a copy of its parameters (the same names)."""
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            0,
            conv.dilation,
            conv.groups,
            conv.bias is not None,
            device="meta",
            dtype=conv.weight.dtype,
            mesh=mesh,
            shard_dims=shard_dims,
        )
        layer = layer.to_empty(device=conv.weight.device)
        layer._copy_shards_from(conv)
        return layer

    def extra_repr(self) -> str:
        return super().extra_repr().replace("padding=0", "padding='tf-same'")


class DistributedConv1dSame(_SamePadding, DistributedConv1d):
    """:class:`~tplayers.DistributedConv1d` with TensorFlow "SAME" padding from the global length."""


class DistributedConv2dSame(_SamePadding, DistributedConv2d):
    """:class:`~tplayers.DistributedConv2d` with TensorFlow "SAME" padding from the global length
    (timm's ``Conv2dSame``; see the module docstring).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers
        from tplayers.layers.conv_same import DistributedConv2dSame, same_pads
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        conv = DistributedConv2dSame(3, 4, 3, stride=2, mesh=mesh)
        x = torch.randn(1, 3, 11, 8)
        (a, b), (c, e) = same_pads(11, 3, 2, 1), same_pads(8, 3, 2, 1)
        want = F.conv2d(F.pad(x, (c, e, a, b)), conv.weight, conv.bias, stride=2)
        torch.testing.assert_close(tplayers.gather(conv(tplayers.shard(x, 2, mesh)), 2, mesh), want)
    """


class DistributedConv3dSame(_SamePadding, DistributedConv3d):
    """:class:`~tplayers.DistributedConv3d` with TensorFlow "SAME" padding from the global length."""
