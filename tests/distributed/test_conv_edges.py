"""The DistributedConvNd twins' main-plus-strips strategy (``tplayers.layers._conv_fn``, ``ConvSpec.strips``).

1. exact in fp64 against the serial nn.Conv1d/2d/3d (outputs, input gradients, weight and bias
   gradients, two SGD steps, both layouts) over random "same"-like configurations (kernel, stride,
   dilation, groups) and uneven partitions on 2 and 3 ranks and a 2x2 mesh, with the path taken
   (checked on the layer's cached spec) in most of them;
2. every rank takes the same path: :func:`uniform_geometry` decides from every shard's plan;
3. the same messages as the halo-padded path, and activation checkpointing recomputes nothing;
4. the size threshold: a small slab takes the halo-padded path, a slab of ``EDGE_MIN_ELEMENTS`` the edges;
5. a convolution that needs no halo (a one-pixel kernel, patches aligned with the shards) takes the path on
   any slab and saves the local input itself, no padded copy (a copy duplicated the input wherever another
   op also kept it: a U-Net's 1x1 shortcut beside its norm); patches that straddle a shard do not.
"""

import random

import pytest
import torch
from harness import run_ranks
from oracle import edge_convs
from partition_rule import window_partition_ok
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

import tplayers
import tplayers.layers.conv as conv_module
from tplayers.layers.conv import EDGE_MIN_ELEMENTS
from tplayers.sharding import offsets_from_sizes
from tplayers.window_plan import EdgeGeometry, conv_out_len, conv_window, edge_geometry, plan_windows, uniform_geometry

TIGHT = dict(rtol=1e-10, atol=1e-10)
_NN = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_TWIN = {1: tplayers.DistributedConv1d, 2: tplayers.DistributedConv2d, 3: tplayers.DistributedConv3d}


def _case(rng):
    nd = rng.choice([1, 2, 2, 3])
    k, dil = rng.choice([1, 3, 3, 5]), rng.choice([1, 1, 2])
    stride = rng.choice([1, 1, 1, 2])
    pad = rng.choice([dil * (k - 1) // 2] * 3 + [1, 2])
    groups = rng.choice([1, 2])
    return nd, dict(
        in_channels=2 * groups,
        out_channels=groups * rng.randint(1, 3),
        kernel_size=k,
        stride=stride,
        padding=pad,
        dilation=dil,
        groups=groups,
        bias=rng.random() < 0.8,
    )


def _slices(x, shard_dims, layouts, coords):
    for i, d in enumerate(shard_dims):
        x = x.narrow(d, offsets_from_sizes(layouts[d])[coords[i]], layouts[d][coords[i]])
    return x


def _parity(rank, world, mesh_shape, shard_dims, seed, count):
    conv_module.EDGE_MIN_ELEMENTS = 0  # this rank's process only: every slab may take the path
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    rng = random.Random(seed)
    done = taken = 0
    while done < count:
        nd, args = _case(rng)
        if max(shard_dims) >= 2 + nd:
            continue
        torch.manual_seed(rng.randrange(1 << 30))
        serial = _NN[nd](**args).double()
        shape = [2, args["in_channels"]] + [rng.randint(3 * mesh.size(0), 13) for _ in range(nd)]
        layouts = {}
        for i, d in enumerate(shard_dims):
            parts = mesh.size(i)
            cuts = sorted(rng.sample(range(2, shape[d] - 1), parts - 1))
            layouts[d] = [b - a for a, b in zip([0] + cuts, cuts + [shape[d]])]
        try:
            serial(torch.zeros(shape, dtype=torch.float64))
        except RuntimeError:
            continue
        k, s, dil, pad = args["kernel_size"], args["stride"], args["dilation"], args["padding"]
        # valid by the test's own rule (tests/partition_rule.py), not by the library's planner
        valid = all(
            window_partition_ok(layouts[d], (shape[d] + 2 * pad - dil * (k - 1) - 1) // s + 1, k, s, dil, pad, "zeros")
            for d in shard_dims
        )
        layer = _TWIN[nd].from_module(serial, mesh=mesh, shard_dims=shard_dims)
        opt_s, opt_p = torch.optim.SGD(serial.parameters(), lr=0.1), torch.optim.SGD(layer.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(shape, dtype=torch.float64)
            if nd == 2 and rng.random() < 0.4:
                x = x.contiguous(memory_format=torch.channels_last)
            xs = x.clone().requires_grad_(True)
            xp = _slices(x, shard_dims, layouts, coords).detach().clone().requires_grad_(True)
            try:
                yp = layer(xp)
            except ValueError as err:  # a shard too small for its neighbour's halo: only where the rule says so
                assert not valid and step == 0, f"refused a valid partition: {args} {layouts}: {err}"
                break
            ys = serial(xs)
            yg = tplayers.gather(yp, shard_dims, mesh)
            torch.testing.assert_close(yg, ys, **TIGHT, msg=lambda m: f"{args} {layouts}: {m}")
            cot = torch.randn_like(ys)
            (ys * cot).sum().backward()
            (yg * cot).sum().backward()
            torch.testing.assert_close(
                tplayers.gather(xp.grad, shard_dims, mesh), xs.grad, **TIGHT, msg=lambda m: f"{args} {layouts}: {m}"
            )
            torch.testing.assert_close(layer.weight.grad, serial.weight.grad, **TIGHT)
            if args["bias"]:
                torch.testing.assert_close(layer.bias.grad, serial.bias.grad, **TIGHT)
            opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
            torch.testing.assert_close(layer.weight, serial.weight, **TIGHT)
        else:
            done += 1
            taken += bool(edge_convs(layer))
    assert taken >= count // 3, (taken, count)  # the random cases really exercise the path
    return taken


@pytest.mark.parametrize(
    "world,mesh_shape,shard_dims,count", [(2, (2,), (2,), 24), (3, (3,), (2,), 16), (4, (2, 2), (2, 3), 8)]
)
def test_edges_parity(world, mesh_shape, shard_dims, count):
    run_ranks(_parity, world, args=(mesh_shape, shard_dims, 7000 + world, count), timeout=180)


def test_uniform_geometry_is_all_or_none():
    rng = random.Random(5)
    seen = 0
    for _ in range(400):
        k, s, dil = rng.choice([1, 3, 5]), rng.choice([1, 2]), rng.choice([1, 2])
        pad, parts = rng.choice([dil * (k - 1) // 2, 1, 2]), rng.choice([2, 3, 4])
        length = rng.randint(3 * parts, 20)
        cuts = sorted(rng.sample(range(1, length), parts - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [length])]
        out_len = conv_out_len(length, k, s, dil, (pad, pad))
        try:
            plans = plan_windows(sizes, out_len, conv_window(k, s, dil, pad), mode="zeros", what="t")
        except ValueError:
            continue
        geos = [uniform_geometry(plans, sizes, c, pad, dil * (k - 1) + 1, s, True) for c in range(parts)]
        assert all(g is None for g in geos) or all(g is not None for g in geos), (sizes, k, s, dil, pad)
        seen += geos[0] is not None
        assert uniform_geometry(plans, sizes, 0, pad, dil * (k - 1) + 1, s, False) is None  # not zero-padded
    assert seen > 50
    assert edge_geometry(8, 1, 3, 1, 8, True, True) == EdgeGeometry(1, (3,), (7, 3, 2))
    assert edge_geometry(8, 2, 1, 3, 4, True, False) is None  # a stride past the window: the strip misses its halo


def _messages_and_checkpoint(rank, world):
    """The same messages as the halo-padded path; under activation checkpointing the same gradients."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(2, 3, 10, 6, dtype=torch.float64)
    sizes = [6, 4]
    xp = x.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank])
    logs, grads = [], []
    for threshold, ckpt in ((EDGE_MIN_ELEMENTS, False), (0, False), (0, True)):
        conv_module.EDGE_MIN_ELEMENTS = threshold
        layer = tplayers.DistributedConv2d.from_module(serial, mesh=mesh)
        inp = xp.clone().requires_grad_(True)
        with tplayers.count_collectives() as log:
            y = checkpoint(layer, inp, use_reentrant=False) if ckpt else layer(inp)
            y.square().sum().backward()
        assert bool(edge_convs(layer)) == (threshold == 0)
        logs.append(sorted((r.kind, r.nbytes, r.tag) for r in log.records))
        grads.append((inp.grad, layer.weight.grad, layer.bias.grad))
    assert logs[0] == logs[1], (logs[0], logs[1])  # one exchange each way, the same bytes
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, **TIGHT)
    return True


def test_same_messages_and_checkpointing():
    run_ranks(_messages_and_checkpoint, 2, timeout=60)


def _threshold(rank, world):
    mesh = tplayers.default_mesh()
    layer = tplayers.DistributedConv2d(2, 2, 3, padding=1, mesh=mesh)
    layer(torch.randn(1, 2, 8, 8))
    assert not bool(edge_convs(layer))
    rows = EDGE_MIN_ELEMENTS // (2 * 256) + 1  # per rank (balanced), 2 channels x 256 columns
    layer(torch.randn(1, 2, rows, 256))
    assert bool(edge_convs(layer))
    return True


def test_threshold():
    run_ranks(_threshold, 2, timeout=60)


def _no_halo(rank, world):
    mesh = tplayers.default_mesh()
    cases = [  # (conv arguments, rows per rank, takes the path)
        (dict(kernel_size=1), [5, 3], True),
        (dict(kernel_size=2, stride=2), [6, 4], True),
        (dict(kernel_size=2, stride=2), [5, 5], False),  # rank 1's first patch needs rank 0's last row
    ]
    for args, sizes, path in cases:
        torch.manual_seed(0)
        serial = nn.Conv2d(3, 4, **args).double()
        layer = tplayers.DistributedConv2d.from_module(serial, mesh=mesh)
        x = torch.randn(2, 3, sum(sizes), 6, dtype=torch.float64)
        xp = x.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank]).clone().requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = layer(xp)
        assert bool(edge_convs(layer, halo_only=False)) == path, (args, sizes)
        copies = [t for t in saved if t.numel() >= xp.numel() and t.data_ptr() != xp.data_ptr()]
        assert (not copies) == path, (args, sizes, [tuple(t.shape) for t in copies])  # the padded path copies
        xs = x.clone().requires_grad_(True)
        ys = serial(xs)
        yg = tplayers.gather(y, (2,), mesh)
        torch.testing.assert_close(yg, ys, **TIGHT)
        cot = torch.randn(ys.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(xp.grad, (2,), mesh), xs.grad, **TIGHT)
        torch.testing.assert_close(layer.weight.grad, serial.weight.grad, **TIGHT)
        torch.testing.assert_close(layer.bias.grad, serial.bias.grad, **TIGHT)
    return True


def test_no_halo_takes_the_path_without_a_copy():
    run_ranks(_no_halo, 2, timeout=60)


def test_module_doctests():
    import doctest

    import tplayers.window_plan as window_plan  # the plan module's examples and the strips' geometry

    result = doctest.testmod(window_plan)
    assert result.attempted >= 5 and result.failed == 0, result
