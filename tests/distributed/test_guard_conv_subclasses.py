"""Convolutions called by ``nn.Conv2d`` subclasses with their own ``forward`` (issue 31): timm's
``Conv2dSame`` (TensorFlow "SAME" padding computed from the input's length, then ``F.conv2d``; in
``tf_efficientnet_*``) and ``ScaledStdConv2d`` (the weight standardized by ``F.batch_norm``, then
``F.conv2d``; in NF-ResNets), and functional ``F.conv2d`` calls with a window along sharded dims.

timm needs torchvision, whose wheels in reach do not load on the CPU build of torch, so the two
classes are faithful copies written here (their ``__init__`` / ``forward`` as in timm 1.0). The
models are small tf_efficientnet-like and NF-ResNet-like networks with a classification head,
compared with the serial model in fp64 at 2 ranks, 3 ranks and on a 2x2 mesh with uneven partitions:
the output, the input gradient, every parameter gradient (the weight gains included), BatchNorm
buffers, after an SGD step, train then eval mode.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.layers.conv_same import DistributedConv2dSame

TIGHT = dict(rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------------ copies of timm 1.0's classes
def get_same_padding(x, kernel_size, stride, dilation):
    return max((math.ceil(x / stride) - 1) * stride + (kernel_size - 1) * dilation + 1 - x, 0)


def pad_same(x, kernel_size, stride, dilation=(1, 1), value=0):
    ih, iw = x.size()[-2:]  # local lengths inside a region
    pad_h = get_same_padding(ih, kernel_size[0], stride[0], dilation[0])
    pad_w = get_same_padding(iw, kernel_size[1], stride[1], dilation[1])
    return F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=value)


class Conv2dSame(nn.Conv2d):
    """TensorFlow-like 'SAME' convolution (timm.layers.conv2d_same.Conv2dSame)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True):
        super().__init__(in_channels, out_channels, kernel_size, stride, 0, dilation, groups, bias)

    def forward(self, x):
        x = pad_same(x, self.weight.shape[-2:], self.stride, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class ScaledStdConv2d(nn.Conv2d):
    """Conv2d with scaled weight standardization (timm.layers.std_conv.ScaledStdConv2d)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=None, dilation=1, groups=1,
                 bias=True, gamma=1.0, eps=1e-6, gain_init=1.0):  # fmt: skip
        if padding is None:
            padding = ((stride - 1) + dilation * (kernel_size - 1)) // 2
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias)  # fmt: skip
        self.scale = gamma * self.weight[0].numel() ** -0.5
        self.eps = eps
        self.gain = nn.Parameter(torch.full((self.out_channels, 1, 1, 1), gain_init))

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class FixedPadConv(nn.Conv2d):
    """A subclass padding a fixed (0, 1, 0, 1) before a stride-2 convolution (diffusers' Downsample2D
    does it outside): not "SAME" padding, so not swapped; its F.pad and F.conv2d are routed."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (0, 1, 0, 1)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


# ------------------------------------------------------------------ models
class TFEfficientNetish(nn.Module):
    """tf_efficientnet-style: Conv2dSame stem (stride 2), a depthwise Conv2dSame (stride 2, k 5), a
    squeeze-excitation gate, a dilated Conv2dSame, a fixed-pad subclass, a 1x1 head, a global pool and a
    classifier (a replicated output)."""

    def __init__(self):
        super().__init__()
        self.stem = Conv2dSame(2, 8, 3, stride=2, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = Conv2dSame(8, 8, 5, stride=2, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.se_reduce, self.se_expand = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)
        self.dilated = Conv2dSame(8, 8, 3, dilation=2)
        self.fixed = FixedPadConv(8, 6, 3, stride=2)
        self.head = nn.Conv2d(6, 12, 1)
        self.classifier = nn.Linear(12, 5)

    def forward(self, x):
        h = F.silu(self.bn1(self.stem(x)))
        h = F.silu(self.bn2(self.dw(h)))
        s = h.mean((2, 3), keepdim=True)
        h = h * torch.sigmoid(self.se_expand(F.silu(self.se_reduce(s))))
        h = self.fixed(h + self.dilated(h))
        return self.classifier(F.adaptive_avg_pool2d(F.silu(self.head(h)), 1).flatten(1))


class NFResNetish(nn.Module):
    """NF-ResNet-style: ScaledStdConv2d stem (stride 2), a pre-activation bottleneck of ScaledStdConv2d
    (1x1, grouped 3x3, 1x1) with alpha / beta scaling and a skip, a pooled head."""

    def __init__(self):
        super().__init__()
        self.stem = ScaledStdConv2d(2, 8, 3, stride=2)
        self.conv1 = ScaledStdConv2d(8, 4, 1)
        self.conv2 = ScaledStdConv2d(4, 4, 3, groups=2)
        self.conv3 = ScaledStdConv2d(4, 8, 1, gain_init=0.5)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        h = self.stem(x)
        out = self.conv1(F.gelu(h) * 1.7)
        out = self.conv3(F.gelu(self.conv2(F.gelu(out) * 1.7)) * 1.7)
        h = h + 0.2 * out
        return self.fc(F.gelu(h).mean((2, 3)))


MODELS = {"tf_efficientnet": TFEfficientNetish, "nf_resnet": NFResNetish}


def _parity(rank, world, kind, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(3)
    serial = MODELS[kind]().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    if kind == "tf_efficientnet":  # Conv2dSame recognised by behaviour; the fixed-pad subclass left to the guard
        assert isinstance(parallel.stem, DistributedConv2dSame) and isinstance(parallel.dw, DistributedConv2dSame)
        assert type(parallel.fixed) is FixedPadConv
    else:
        assert type(parallel.stem) is ScaledStdConv2d
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for mode in ["train", "train", "eval"]:
        serial.train(mode == "train"), parallel.train(mode == "train")
        shape = [2, 2] + [sum(layouts[i]) if i < len(dims) else 11 for i in range(2)]
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, ys, **TIGHT)
        target = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
        backward_step_match(
            F.mse_loss(ys, target), F.mse_loss(yl, target), xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT
        )
    return True


# 19 rows: 10 + 9 (the stride-2 "SAME" pads differ between the local and the global lengths)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_conv_subclasses_are_exact(kind):
    run_ranks(_parity, 2, args=(kind, (2,), [[10, 9]]), timeout=180)
    run_ranks(_parity, 3, args=(kind, (3,), [[7, 6, 6]]), timeout=180)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_conv_subclasses_are_exact_on_a_2x2_mesh(kind):
    run_ranks(_parity, 4, args=(kind, (2, 2), [[10, 9], [8, 7]]), timeout=240)


def test_same_padding_recognised_by_behaviour_not_name():
    from tplayers.parallelize.conv_subclasses import same_padding_twin

    assert same_padding_twin(Conv2dSame(2, 3, 3, stride=2).double()) is DistributedConv2dSame
    assert same_padding_twin(Conv2dSame(2, 3, (3, 5), stride=(1, 3), dilation=(2, 1))) is DistributedConv2dSame
    assert same_padding_twin(FixedPadConv(2, 3, 3, stride=2)) is None
    assert same_padding_twin(ScaledStdConv2d(2, 3, 3)) is None
    assert same_padding_twin(nn.Conv2d(2, 3, 3)) is None

    class Conv1dSame(nn.Conv1d):  # the 1-D form of the same forward
        def forward(self, x):
            total = get_same_padding(x.shape[-1], self.kernel_size[0], self.stride[0], self.dilation[0])
            x = F.pad(x, (total // 2, total - total // 2))
            return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    from tplayers.layers.conv_same import DistributedConv1dSame

    assert same_padding_twin(Conv1dSame(2, 3, 4, stride=3)) is DistributedConv1dSame
    assert same_padding_twin(Conv1dSame(2, 3, 4, stride=3, padding=1)) is None  # built with padding: not "SAME"


# ------------------------------------------------------------------ refused
class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.w = nn.Parameter(torch.randn(3, 3, 3, 3, dtype=torch.float64))
        self.fn = fn

    def forward(self, x):
        return self.fn(self, self.conv(x))


def _refused(rank, world, fn, what):
    model = tplayers.parallelize_module(Op(fn).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 3, [5, 4][rank], 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=what) as err:
        model(x)
    assert "domain region" in str(err.value)
    return True


def test_functional_transposed_conv_with_a_window_along_a_sharded_dim_raises():
    fn = lambda m, h: F.conv_transpose2d(h, m.w, padding=1)  # noqa: E731
    run_ranks(_refused, 2, args=(fn, "conv_transpose2d with a window along sharded dim 2"), timeout=60)


def test_functional_conv_over_flattened_pixels_raises():
    fn = lambda m, h: F.conv1d(h.flatten(2), m.w[:, :, 0], padding=1)  # noqa: E731
    run_ranks(_refused, 2, args=(fn, "conv1d on a dim that merges a sharded dim with others"), timeout=60)


class LocalPad(nn.Module):
    """timm's ``pad_same`` outside a ``Conv2dSame`` (a plain module): the amounts come from the lengths it reads,
    which carry their serial values (tplayers.region.lengths), so the pad is the serial one."""

    def __init__(self, pad_of=None):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.down = nn.Conv2d(2, 2, 3, stride=2)
        self.pad_of = pad_of

    def forward(self, x):
        h = self.conv(x)
        if self.pad_of is not None:  # amounts from plain local ints (int() drops the serial value)
            ih, iw = (int(v) for v in h.shape[-2:])
            ph, pw = self.pad_of(ih), self.pad_of(iw)
            return self.down(F.pad(h, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)))
        return self.down(pad_same(h, (3, 3), (2, 2)))


def _local_pad(rank, world):
    torch.manual_seed(0)
    serial = LocalPad().double()
    model = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    full = torch.randn(1, 2, 19, 6, dtype=torch.float64)
    local = full[:, :, :10] if rank == 0 else full[:, :, 10:]
    want = serial(full)
    got = model(local)
    torch.testing.assert_close(tplayers.gather(got, 2), want, rtol=1e-12, atol=1e-12)
    plain = tplayers.parallelize_module(
        LocalPad(lambda n: get_same_padding(n, 3, 2, 1)).double(), {"": tplayers.DomainParallel(shard_dims=(2,))}
    )
    with pytest.raises(
        ValueError, match=r"F.pad \(constant\) along the dim sharded over mesh dim 0 by amounts that differ"
    ):
        plain(local)  # pads (0, 1) on rank 0, (1, 1) on rank 1: refused
    return True


def test_same_padding_from_lengths_read_is_exact_and_from_plain_local_ints_raises_on_every_rank():
    run_ranks(_local_pad, 2, timeout=60)


class Conv1dSame(nn.Conv1d):
    """A 1-D "SAME" convolution (the 1-D form of timm's forward)."""

    def forward(self, x):
        total = get_same_padding(x.shape[-1], self.kernel_size[0], self.stride[0], self.dilation[0])
        x = F.pad(x, (total // 2, total - total // 2))
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _one_d(rank, world):
    from tplayers.layers.conv_same import DistributedConv1dSame

    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = nn.Sequential(Conv1dSame(2, 4, 4, stride=3), nn.Tanh(), Conv1dSame(4, 2, 5, stride=2, dilation=2)).double()
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    assert all(isinstance(parallel[i], DistributedConv1dSame) for i in (0, 2))
    x = torch.randn(2, 2, 23, dtype=torch.float64)
    layouts = [[13, 10]]
    xs, xl = x.clone().requires_grad_(True), local_slice(x, (2,), layouts, [rank]).clone().requires_grad_(True)
    ys, yl = serial(xs), parallel(xl)
    torch.testing.assert_close(tplayers.gather(yl, 2, mesh), ys, **TIGHT)
    ys.square().sum().backward()
    tplayers.domain_sum(yl.square(), mesh).backward()
    torch.testing.assert_close(xl.grad, local_slice(xs.grad, (2,), layouts, [rank]), **TIGHT)
    for (n, p), q in zip(parallel.named_parameters(), serial.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=lambda m: f"{n}: {m}")
    return True


def test_one_d_same_padding_subclass_is_exact():
    # 23 samples: "SAME" pads 2 at stride 3 / k 4 globally, 3 from either local length (the twin pads by 2)
    run_ranks(_one_d, 2, timeout=60)
