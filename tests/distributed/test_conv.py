"""DistributedConv2d against serial nn.Conv2d (fp64): random arguments, balanced and uneven partitions."""

import random

import pytest
import torch
from harness import run_ranks
from oracle import memory_layout as layout
from oracle import same_layout, same_on_all_ranks
from partition_rule import window_partition_ok
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.sharding import offsets_from_sizes, shard_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)


def _random_conv(rng):
    k = (rng.randint(1, 5), rng.randint(1, 5))
    stride = (rng.randint(1, 3), rng.randint(1, 3))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    groups = rng.choice([1, 2])
    forms = ["int", "tuple", "valid"] + (["same"] if stride == (1, 1) else [])
    form = rng.choice(forms)
    padding = {
        "int": rng.randint(0, 3),
        "tuple": (rng.randint(0, 3), rng.randint(0, 3)),
        "valid": "valid",
        "same": "same",
    }[form]
    mode = rng.choice(["zeros", "zeros", "circular", "circular", "reflect", "replicate"])
    c_in, c_out = groups * rng.randint(1, 2), groups * rng.randint(1, 3)
    return dict(
        in_channels=c_in,
        out_channels=c_out,
        kernel_size=k,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=rng.random() < 0.8,
        padding_mode=mode,
    )


def _pads(conv, i):
    """(lo, hi) padding of ``conv`` along spatial dim ``i``, as nn.Conv2d applies it."""
    k, dil = conv.kernel_size[i], conv.dilation[i]
    if conv.padding == "valid":
        return 0, 0
    if conv.padding == "same":
        total = dil * (k - 1)
        return total // 2, total - total // 2
    return conv.padding[i], conv.padding[i]


def _rule_ok(sizes, conv, d):
    """Whether the partition ``sizes`` of dim ``d`` is valid by the test's own rule
    (tests/partition_rule.py), never by asking the library's planner."""
    i = d - 2
    k, s, dil, (lo, hi) = conv.kernel_size[i], conv.stride[i], conv.dilation[i], _pads(conv, i)
    out_len = (sum(sizes) + lo + hi - dil * (k - 1) - 1) // s + 1  # nn.Conv2d's output length
    return window_partition_ok(sizes, out_len, k, s, dil, lo, conv.padding_mode)


def _partition(rng, length, parts, conv, d):
    """Balanced, or a random uneven partition: one the rule calls valid (retrying a few random
    ones), or now and then any (an invalid one must be refused, or else be exact)."""
    if rng.random() < 0.35:
        return shard_sizes(length, parts)
    for attempt in range(20):
        cuts = sorted(rng.randint(0, length) for _ in range(parts - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [length])]
        if _rule_ok(sizes, conv, d) or attempt == 0 and rng.random() < 0.15:
            return sizes
    return shard_sizes(length, parts)


def _parity(rank, world, mesh_shape, shard_dims, seed, count, overlap=False):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    rng = random.Random(seed)
    done = refused = 0
    while done < count:
        args = _random_conv(rng)
        torch.manual_seed(rng.randrange(1 << 30))
        serial = nn.Conv2d(**args).double()
        shape = [rng.randint(1, 2), args["in_channels"], rng.randint(6, 16), rng.randint(6, 16)]
        layouts = {d: _partition(rng, shape[d], mesh.size(i), serial, d) for i, d in enumerate(shard_dims)}
        valid = all(_rule_ok(layouts[d], serial, d) for d in shard_dims)  # e.g. a kernel wider than a shard
        try:
            serial(torch.zeros(shape, dtype=torch.float64))
        except RuntimeError:
            continue  # the serial layer rejects it too (e.g. reflect padding >= size)
        fmt = rng.choice([torch.channels_last, torch.contiguous_format])
        conv = tplayers.DistributedConv2d.from_module(
            serial, mesh=mesh, shard_dims=shard_dims, memory_format=fmt, overlap_halo=overlap
        )
        opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
        opt_p = torch.optim.SGD(conv.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(shape, dtype=torch.float64)
            if rng.random() < 0.3:
                x = x.to(memory_format=torch.channels_last)
            local = x
            for i, d in enumerate(shard_dims):
                sizes = layouts[d]
                local = local.narrow(d, offsets_from_sizes(sizes)[coords[i]], sizes[coords[i]])
            xs, xp = x.clone().requires_grad_(True), local.detach().clone().requires_grad_(True)
            ys = serial(xs)
            with tplayers.count_collectives() as log:
                try:
                    yp = conv(xp)
                except ValueError as err:
                    # the library may refuse only what the rule calls invalid (then on every rank)
                    assert not valid and step == 0, f"refused a valid partition: {args} {layouts}: {err}"
                    assert "halo" in str(err) or "too few" in str(err), err
                    refused += 1
                    break
                assert same_layout(yp, ys), (args, fmt, xp.stride(), yp.stride(), layout(ys))  # nn.Conv2d's
                yg = tplayers.gather(yp, shard_dims, mesh)
                torch.testing.assert_close(yg, ys, **TIGHT, msg=lambda m: f"{args} {layouts}: {m}")
                cot = torch.randn_like(ys)
                (ys * cot).sum().backward()
                (yg * cot).sum().backward()
            # weight and bias gradients: one all-reduce per mesh dim, whatever the number of ranks
            grad_msgs = [r for r in log.records if r.tag == "conv.param_grads"]
            assert log.count("all_reduce") == len(shard_dims), log.summary()
            assert len(grad_msgs) == len(shard_dims) and {r.kind for r in grad_msgs} == {"all_reduce"}, log.summary()
            nparam = sum(p.numel() for p in conv.parameters()) * 8
            assert all(r.nbytes == nparam for r in grad_msgs), (grad_msgs, nparam)
            same_on_all_ranks(conv.weight.grad)
            assert same_layout(xp.grad, xs.grad), (args, fmt, xp.shape, xp.stride(), xp.grad.stride(), xs.grad.stride())
            gx = tplayers.gather(xp.grad, shard_dims, mesh)
            torch.testing.assert_close(gx, xs.grad, **TIGHT, msg=lambda m: f"{args} {layouts}: {m}")
            torch.testing.assert_close(
                conv.weight.grad, serial.weight.grad, **TIGHT, msg=lambda m: f"{args} {layouts} step {step}: {m}"
            )
            if args["bias"]:
                torch.testing.assert_close(conv.bias.grad, serial.bias.grad, **TIGHT)
            opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
            torch.testing.assert_close(conv.weight, serial.weight, **TIGHT)
        else:
            done += 1  # a partition the rule calls invalid but the library accepts counts: it was exact
    return done, refused


@pytest.mark.parametrize(
    "world,mesh_shape,shard_dims,count,overlap",
    [
        (2, (2,), (2,), 24, False),
        (2, (2,), (3,), 10, False),
        (3, (3,), (2,), 24, False),
        (4, (2, 2), (2, 3), 16, False),
        (2, (2,), (2,), 16, True),  # overlap_halo=True: main-plus-strips wherever the plan allows, at any size
        (4, (2, 2), (2, 3), 10, True),
    ],
)
def test_conv_parity_grid(world, mesh_shape, shard_dims, count, overlap):
    results = run_ranks(
        _parity,
        world,
        args=(mesh_shape, shard_dims, 1000 + world + shard_dims[0] + overlap, count, overlap),
        timeout=180,
    )
    assert len(set(results)) == 1 and results[0][0] == count, results


def _errors(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(rank)  # different seeds: the constructor broadcasts, so parameters still agree
    conv = tplayers.DistributedConv2d(2, 3, 5, padding=2, mesh=mesh).double()
    same_on_all_ranks(conv.weight)
    same_on_all_ranks(conv.bias)
    # 1) a shard too small to supply its neighbour's halo of 2 rows
    rows = [9, 1, 9][rank]
    with pytest.raises(ValueError, match="halo of 2 rows"):
        conv(torch.randn(1, 2, rows, 6, dtype=torch.float64))
    # 2) a non-sharded dim that differs across ranks
    with pytest.raises(ValueError, match="differ across ranks"):
        conv(torch.randn(1, 2, 8, 6 + (rank == 1), dtype=torch.float64))
    # 3) a rank passing a 3-D tensor, 4) a rank with the wrong dtype
    with pytest.raises(ValueError, match="4-D"):
        conv(torch.randn(2, 8, 6, dtype=torch.float64) if rank == 2 else torch.randn(1, 2, 8, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        conv(torch.randn(1, 2, 8, 6, dtype=torch.float32 if rank == 0 else torch.float64))
    # nobody hangs: every rank still runs a valid layer call together
    y = conv(torch.randn(1, 2, 8, 6, dtype=torch.float64))
    assert y.shape == (1, 3, 8, 6)
    # 5) at a shape whose layout is cached, a dtype change raises before any halo traffic
    with pytest.raises(ValueError, match="dtype"):
        conv(torch.randn(1, 2, 8, 6, dtype=torch.float32))
    assert conv(torch.randn(1, 2, 8, 6, dtype=torch.float64)).shape == (1, 3, 8, 6)  # still in step
    # a rank that owns no output rows (stride 3 over 4 rows: 2 outputs, balanced [1, 1, 0]) still takes
    # part in backward
    torch.manual_seed(3)  # same data on every rank
    serial = nn.Conv2d(2, 2, 1, stride=3).double()
    sparse = tplayers.DistributedConv2d.from_module(serial, mesh=mesh)
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    sizes = [2, 1, 1]
    xp = x.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank]).clone().requires_grad_(True)
    yp = sparse(xp)
    assert yp.shape[2] == [1, 1, 0][rank]
    tplayers.gather(yp, 2, mesh).sum().backward()
    serial(x).sum().backward()
    torch.testing.assert_close(sparse.weight.grad, serial.weight.grad)
    return True


def test_errors_raise_on_every_rank_without_hanging():
    run_ranks(_errors, 3, timeout=60)


def _pair_grads(rank, world):
    """2 ranks: the parameter-gradient sum (the general all-reduce, with or without an input gradient)
    gives bitwise-identical sums on both ranks, equal to the serial gradients."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(7)  # same data on every rank
    for periodic, input_grad in ((False, True), (True, True), (False, False)):
        serial = nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular" if periodic else "zeros").double()
        conv = tplayers.DistributedConv2d.from_module(serial, mesh=mesh)
        x = torch.randn(2, 3, 11, 5, dtype=torch.float64)
        sizes = [4, 7]
        xp = x.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank]).clone().requires_grad_(input_grad)
        cot = torch.randn(2, 4, 11, 5, dtype=torch.float64)
        with tplayers.count_collectives() as log:
            yp = conv(xp)
            (yp * cot.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank])).sum().backward()
        grad_msgs = [(r.kind, r.nbytes) for r in log.records if r.tag == "conv.param_grads"]
        assert grad_msgs == [("all_reduce", (4 * 3 * 9 + 4) * 8)], grad_msgs  # the same bytes as a peer exchange
        (serial(x) * cot).sum().backward()
        for p_dist, p_serial in ((conv.weight, serial.weight), (conv.bias, serial.bias)):
            same_on_all_ranks(p_dist.grad)
            torch.testing.assert_close(p_dist.grad, p_serial.grad, **TIGHT)
        if input_grad:
            torch.testing.assert_close(
                tplayers.gather(xp.grad, 2, mesh),
                torch.autograd.grad((serial(x.requires_grad_(True)) * cot).sum(), x)[0],
                **TIGHT,
            )
    return True


def test_two_rank_param_grads_sum_bitwise_identical():
    run_ranks(_pair_grads, 2, timeout=60)
