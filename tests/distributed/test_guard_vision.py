"""The region guard on vision ops that are exact on each rank's slice (issue 31): channel dropout,
pixel shuffle / unshuffle, fresh constants of a sharded tensor's local shape.

Every model runs under ``{"": DomainParallel(shard_dims=...)}`` and is compared with the serial model
in fp64 at 2 and 3 ranks (uneven partitions) and on a 2x2 mesh: outputs, the input gradient, every
parameter gradient, after an SGD step, train then eval mode. Dropout masks: the same seed before the
serial and the parallel call (every rank seeded alike, as tplayers.ParallelDropout needs).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-9, atol=1e-11)


class Shuffler(nn.Module):
    """An ESRGAN-style upsampler with FPN-style channel dropout: conv, Dropout2d, pixel_shuffle, conv,
    pixel_unshuffle, feature_alpha_dropout, and fresh constants of the local shape (``*_like``)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 8, 3, padding=1)
        self.drop = nn.Dropout2d(0.4)
        self.shuffle = nn.PixelShuffle(2)
        self.conv2 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 2, 3, padding=1)
        self.gain = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, x):
        h = self.drop(torch.tanh(self.conv1(x)))
        h = self.conv2(self.shuffle(h))  # (N, 2, 2H, 2W) -> (N, 4, 2H, 2W)
        h = h + torch.ones_like(h) * self.gain + torch.full_like(h, 0.5) - torch.zeros_like(h)
        h = F.pixel_unshuffle(h, 2)  # (N, 16, H, W)
        h = F.feature_alpha_dropout(h, 0.3, self.training)
        return self.conv3(F.dropout2d(h, 0.25, self.training))


class Volume(nn.Module):
    """3-D: Dropout3d and Dropout1d on a flattened volume."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.drop = nn.Dropout3d(0.5)
        self.conv2 = nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x):
        h = self.drop(torch.relu(self.conv1(x)))
        h = F.dropout1d(h.flatten(2), 0.3, self.training).view_as(h)
        return self.conv2(h)


def _parity(rank, world, kind, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(3)
    serial = {"shuffler": Shuffler, "volume": Volume, "constants": Constants}[kind]().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    spatial = 3 if kind == "volume" else 2
    for step, mode in enumerate(["train", "train", "eval"]):
        serial.train(mode == "train"), parallel.train(mode == "train")
        shape = [2, 2] + [sum(layouts[i]) if i < len(dims) else 5 for i in range(spatial)]
        x = torch.randn(shape, dtype=torch.float64)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        torch.manual_seed(100 + step)
        ys = serial(xs)
        torch.manual_seed(100 + step)
        yl = parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        after = torch.rand(())  # the generator advanced exactly as the serial model's
        torch.manual_seed(100 + step)
        serial(xs.detach())
        assert torch.equal(after, torch.rand(()))
        target = torch.randn_like(ys)
        backward_step_match(
            F.mse_loss(ys, target),
            tplayers.domain_mean(F.mse_loss(yl, local(target), reduction="none"), mesh),
            xs,
            xl,
            local,
            serial,
            parallel,
            opt_s,
            opt_p,
            **TIGHT,
        )
    return True


def test_pixel_shuffle_channel_dropout_and_like_constants_are_exact():
    run_ranks(_parity, 2, args=("shuffler", (2,), [[5, 4]]), timeout=120)
    run_ranks(_parity, 3, args=("shuffler", (3,), [[4, 3, 2]]), timeout=120)
    run_ranks(_parity, 4, args=("shuffler", (2, 2), [[5, 4], [4, 3]]), timeout=120)


def test_dropout3d_and_dropout1d_on_a_volume_are_exact():
    run_ranks(_parity, 2, args=("volume", (2,), [[4, 3]]), timeout=120)
    run_ranks(_parity, 3, args=("volume", (3,), [[3, 2, 2]]), timeout=120)
    run_ranks(_parity, 4, args=("volume", (2, 2), [[3, 2], [2, 3]]), timeout=120)


# ------------------------------------------------------------------ refused
class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.conv(x))


def _refused(rank, world, fn, dims, rows, what):
    model = tplayers.parallelize_module(Op(fn).double(), {"": tplayers.DomainParallel(shard_dims=dims)})
    x = torch.randn(2, 4, rows[rank], 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=what) as err:
        model(x)
    assert "domain region" in str(err.value)
    return True


def test_pixel_unshuffle_of_an_odd_slice_raises_on_every_rank():
    # rank 0 holds 5 rows (odd), rank 1 holds 4: both raise the same error
    what = "pixel_unshuffle with factor 2 along sharded dim 2, where this rank holds 5 rows"
    run_ranks(_refused, 2, args=(lambda h: F.pixel_unshuffle(h, 2), (2,), [5, 4], what), timeout=60)


def test_channel_dropout_along_a_sharded_channel_dim_raises():
    what = "dropout2d with p=0.5 in training, sharded along dim 1"
    run_ranks(_refused, 2, args=(lambda h: F.dropout2d(h.transpose(1, 2), 0.5), (2,), [5, 4], what), timeout=60)


# ------------------------------------------------------------------ reflect / replicate padding
class Pads(nn.Module):
    """A CycleGAN-style generator's padding: ReflectionPad2d before unpadded convolutions, ReplicationPad2d,
    F.pad in reflect mode, CircularPad2d and circular F.pad, asymmetric pads; a global pool and a head
    (a replicated output)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.reflect = nn.ReflectionPad2d((1, 2, 2, 1))
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.replicate = nn.ReplicationPad2d(1)
        self.conv3 = nn.Conv2d(4, 3, 3)
        self.circular = nn.CircularPad2d((2, 1, 1, 2))
        self.conv4 = nn.Conv2d(3, 3, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.conv1(x))
        h = torch.tanh(self.conv2(self.reflect(h)))
        h = self.conv3(self.replicate(h))
        h = F.pad(h, (1, 1, 1, 1), mode="reflect") * 1.5
        h = F.pad(h, (0, 2, 1, 0), mode="replicate")
        h = self.conv4(self.circular(h))  # periodic: the first rank's rows come from the last rank
        h = F.pad(h, (0, 0, 0, 1), mode="circular") + 0.5
        return self.head(h.square().mean(dim=(2, 3)))


def _pads(rank, world, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(5)
    serial = Pads().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    for mode in ["train", "eval"]:
        serial.train(mode == "train"), parallel.train(mode == "train")
        x = torch.randn([2, 2] + [sum(layouts[i]) if i < len(dims) else 6 for i in range(2)], dtype=torch.float64)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, ys, **TIGHT)
        target = torch.randn_like(ys)
        backward_step_match(
            F.mse_loss(ys, target), F.mse_loss(yl, target), xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT
        )
    return True


def test_reflect_and_replicate_padding_along_sharded_dims_are_exact():
    run_ranks(_pads, 2, args=((2,), [[5, 4]]), timeout=120)
    run_ranks(_pads, 3, args=((3,), [[4, 3, 3]]), timeout=120)
    run_ranks(_pads, 4, args=((2, 2), [[5, 4], [4, 3]]), timeout=120)


def test_reflect_padding_wider_than_the_edge_rank_raises_on_every_rank():
    # rank 0 holds 2 rows and reflect padding 2 reads 3; rank 1 (5 rows) raises the same error
    what = r"F.pad \(mode 'reflect', pad \(0, 0, 2, 0\)\) along sharded dim 2: this rank is at the domain's edge"
    run_ranks(_refused, 2, args=(lambda h: F.pad(h, (0, 0, 2, 0), mode="reflect"), (2,), [2, 5], what), timeout=60)


def test_circular_padding_wider_than_the_edge_rank_raises_on_every_rank():
    # the last rank holds 2 rows and the first rank's 3 wrapped rows come from it: both ranks raise
    what = r"F.pad \(mode 'circular', pad \(0, 0, 3, 0\)\) along sharded dim 2: this rank is at the domain's edge"
    run_ranks(_refused, 2, args=(lambda h: F.pad(h, (0, 0, 3, 0), mode="circular"), (2,), [5, 2], what), timeout=60)


class Bare(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _empty_slice(rank, world):
    model = tplayers.parallelize_module(Bare(nn.Dropout2d(0.5)), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 3, [6, 0][rank], 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dropout2d with p=0.5 in training on an empty slice"):
        model(x)
    model.eval()  # no mask drawn: exact on the empty slice too
    assert torch.equal(model(x), x)
    return True


def test_channel_dropout_on_an_empty_slice_raises_on_every_rank():
    run_ranks(_empty_slice, 2, timeout=60)


# ------------------------------------------------------------------ fresh constants of the local shape
class Constants(nn.Module):
    """Fresh constants of a sharded tensor's local shape, combined with it: ``torch.zeros(y.shape) + y``,
    ``torch.full``, ``torch.ones``, ``y.new_zeros`` / ``new_ones`` / ``new_full``, an in-place add into one."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        h = torch.zeros(y.shape, dtype=y.dtype) + y
        h = h * torch.full(y.shape, 1.5, dtype=y.dtype) - torch.ones(y.size(), dtype=y.dtype)
        acc = y.new_zeros(y.shape)
        acc += torch.tanh(h)  # in place into a fresh constant: now sharded like h
        acc = acc + y.new_ones(y.shape) * y.new_full(y.shape, 0.25)
        return self.conv2(acc.square()) + acc.mean(dim=(2, 3), keepdim=True)[:, :2]


def test_fresh_constants_of_the_local_shape_are_exact():
    run_ranks(_parity, 2, args=("constants", (2,), [[5, 4]]), timeout=120)
    run_ranks(_parity, 3, args=("constants", (3,), [[4, 3, 2]]), timeout=120)
    run_ranks(_parity, 4, args=("constants", (2, 2), [[5, 4], [4, 3]]), timeout=120)


class Written(nn.Module):
    """A constant of the serial shape written along a sharded dim before use: the serial row 0 is written on
    the rank that holds it (tplayers.region.rules_slices), so it is exact."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        c = torch.zeros(y.shape, dtype=y.dtype)
        c[:, :, 0] = 1.0  # the serial first row: on rank 0 only
        return y + c


def _written(rank, world):
    torch.manual_seed(0)
    serial = Written().double()
    model = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    full = torch.randn(2, 4, 9, 5, dtype=torch.float64)
    torch.testing.assert_close(model(tplayers.shard(full, 2)), tplayers.shard(serial(full), 2), rtol=1e-12, atol=1e-12)
    # inference tensors keep no version counter, so no constant is followed there: refused as before
    torch.manual_seed(0)
    constants = tplayers.parallelize_module(Constants().double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = tplayers.shard(torch.randn(2, 2, 9, 5, dtype=torch.float64), 2)
    with torch.no_grad():
        constants(x)  # no_grad: followed
    with torch.inference_mode(), pytest.raises(ValueError, match="a replicated operand of shape"):
        constants(x)
    return True


def test_a_written_constant_is_exact_and_one_made_in_inference_mode_is_refused_as_before():
    run_ranks(_written, 2, timeout=60)


def test_a_constant_whose_literal_size_fits_one_rank_only_raises_on_every_rank():
    # torch.zeros(2, 4, 5, 6) fits rank 0's 5 rows (and would not broadcast in the serial model): rank 1's
    # shape error is agreed, so both ranks raise
    what = r"rank\(s\) \[1\] raised"
    fn = lambda h: torch.zeros(2, 4, 5, 6, dtype=h.dtype) + h  # noqa: E731
    run_ranks(_refused, 2, args=(fn, (2,), [5, 4], what), timeout=60)


def _compiled_pad(rank, world):
    import torch._dynamo as dynamo

    dynamo.reset()
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReflectionPad2d(1), nn.Conv2d(2, 2, 3)).double()
    par = tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = tplayers.shard(torch.randn(1, 2, 9, 6, dtype=torch.float64), 2)
    par(x)  # eager: the guard pads the edge ranks only
    with pytest.raises(ValueError, match="route ops through the region guard"):
        torch.compile(par, backend="aot_eager")(x)
    return True


def test_compile_of_a_region_with_a_mirrored_pad_is_refused_at_trace_time():
    run_ranks(_compiled_pad, 2, timeout=240)


class PadInPlace(nn.Module):
    """An in-place op on a pad's result (a middle rank pads nothing): the input stays untouched."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        p = F.pad(h, (0, 0, 1, 1), mode="replicate")
        p.mul_(2.0)
        return p.mean(dim=(2, 3)) + h.mean(dim=(2, 3))


def _pad_in_place(rank, world):
    torch.manual_seed(0)
    serial = PadInPlace().double()
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 2, 9, 5, dtype=torch.float64)
    torch.testing.assert_close(parallel(local_slice(x, (2,), [[3, 3, 3]], [rank])), serial(x), **TIGHT)
    return True


def test_an_in_place_op_on_a_pad_result_leaves_its_input_alone():
    run_ranks(_pad_in_place, 3, timeout=60)
