"""The DistributedConvNd twins with ``overlap_halo=True``: the halo exchange overlapped with compute
wherever possible (the main-plus-strips strategy wherever every shard's plan allows it, at any slab
size; halo-padded elsewhere).

1. exact in fp64 against the serial nn.Conv1d/2d/3d over random configurations (kernel, stride,
   dilation, padding and padding modes, groups), contiguous and channels_last inputs, and uneven
   partitions on 2 and 3 ranks, with both strategies taken (checked on the layer's cached spec);
2. the overlap really happens: on rank 0 a convolution runs after the halo messages are posted and
   before they are waited, forward and backward. Proved by a deadlock, not by timing: rank 1 enters
   its forward (and its backward) only once rank 0 has run a convolution with a halo exchange
   posted; a rank 0 that waited for its halos before convolving would wait forever (the harness
   timeout fails the test);
3. ``torch.compile(fullgraph=True)`` (which traces the halo-padded strategy) equals eager (main-plus-strips
   where it applies) with the same collectives.
"""

import random

import torch
import torch.distributed as dist
from harness import run_ranks
from oracle import edge_convs
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tplayers
from tplayers.sharding import offsets_from_sizes, shard_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)
_NN = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_TWIN = {1: tplayers.DistributedConv1d, 2: tplayers.DistributedConv2d, 3: tplayers.DistributedConv3d}
_CL = {2: torch.channels_last, 3: torch.channels_last_3d}


def _random_case(rng, world):
    nd = rng.choice([1, 2, 2, 3])
    k = rng.randint(1, 5)
    stride, dilation = rng.randint(1, 2), rng.randint(1, 2)
    groups = rng.choice([1, 2])
    mode = rng.choice(["zeros", "zeros", "circular", "reflect", "replicate"])
    padding = "same" if stride == 1 and rng.random() < 0.3 else rng.randint(0, (dilation * (k - 1)) // 2 + 1)
    if rng.random() < 0.35:  # zero-padded "same"-like: the main-plus-strips strategy's plans
        k, stride, mode = rng.choice([3, 5]), 1, "zeros"
        padding = dilation * (k - 1) // 2
    length = rng.randint(6 * world, 10 * world)
    cuts = sorted(rng.sample(range(3, length - 2), world - 1))  # every shard >= a few rows
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [length])]
    if min(sizes) < dilation * (k - 1) + 1:
        sizes = shard_sizes(length, world)
    conv = dict(
        in_channels=groups * rng.randint(1, 2),
        out_channels=groups * rng.randint(1, 2),
        kernel_size=k,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=rng.random() < 0.8,
        padding_mode=mode,
    )
    return nd, conv, sizes


def _exact(rank, world, seed, count):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    done = strips = 0
    while done < count:
        nd, args, sizes = _random_case(rng, world)
        torch.manual_seed(rng.randrange(1 << 30))
        serial = _NN[nd](**args).double()
        shape = [2, args["in_channels"], sum(sizes)] + [rng.randint(3, 6) for _ in range(nd - 1)]
        try:
            serial(torch.zeros(shape, dtype=torch.float64))
            twin = _TWIN[nd].from_module(serial, mesh=mesh, overlap_halo=True)
            x = torch.randn(shape, dtype=torch.float64)
            if nd > 1 and rng.random() < 0.4:
                x = x.contiguous(memory_format=_CL[nd])
            local = x.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank]).clone(memory_format=torch.preserve_format)
            y = twin(local.requires_grad_(True))
        except (RuntimeError, ValueError):
            continue  # a configuration the serial layer or the layout rejects (same on every rank)
        xs = x.clone(memory_format=torch.preserve_format).requires_grad_(True)
        ys = serial(xs)
        yg = tplayers.gather(y, 2, mesh)
        torch.testing.assert_close(yg, ys, **TIGHT, msg=lambda m: f"{nd}d {args} {sizes}: {m}")
        cot = torch.randn_like(ys)
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(
            tplayers.gather(local.grad, 2, mesh), xs.grad, **TIGHT, msg=lambda m: f"{nd}d {args} {sizes}: {m}"
        )
        torch.testing.assert_close(twin.weight.grad, serial.weight.grad, **TIGHT)
        if args["bias"]:
            torch.testing.assert_close(twin.bias.grad, serial.bias.grad, **TIGHT)
        strips += bool(edge_convs(twin))  # the same on every rank (decided from every shard's plan)
        done += 1
    assert 0 < strips < count, strips  # both strategies taken: main-plus-strips and the halo-padded fallback
    return strips


def test_overlapped_conv_exact_random_1d_2d_3d():
    assert len(set(run_ranks(_exact, 2, args=(11, 30), timeout=120))) == 1  # every rank took the same paths


def test_overlapped_conv_exact_random_3_ranks():
    assert len(set(run_ranks(_exact, 3, args=(12, 20), timeout=120))) == 1


class _Gate(TorchDispatchMode):
    """Rank 0: when a convolution (forward or backward) runs while a halo exchange posted since the
    last token is in flight, send rank 1 a token over a side group (rank 1 waits for it)."""

    def __init__(self, log, side):
        super().__init__()
        self.log, self.side, self.seen, self.tokens, self.events = log, side, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            posted = sum(1 for r in self.log.records if r.tag.startswith("halo") and r.kind == "send")
            self.events.append((func.__name__, posted))
            if posted > self.seen:
                self.seen = posted
                self.tokens += 1
                dist.send(torch.ones(1), dst=1, group=self.side)
        return func(*args, **(kwargs or {}))


def _order(rank, world):
    mesh = tplayers.default_mesh()
    side = dist.new_group([0, 1], backend="gloo")
    torch.manual_seed(0)
    serial = nn.Conv2d(3, 4, 3, padding=1).double()
    conv = tplayers.DistributedConv2d.from_module(serial, mesh=mesh, overlap_halo=True)
    x = torch.randn(2, 3, 24, 5, dtype=torch.float64)
    local = tplayers.shard(x, 2, mesh).clone().requires_grad_(True)
    conv(local)  # the layout exchange (once per shape), outside the gated step
    assert edge_convs(conv)  # a small slab: main-plus-strips only because of overlap_halo=True
    dist.barrier()
    token = torch.zeros(1)
    if rank == 1:
        dist.recv(token, src=0, group=side)  # rank 0 convolved with its halo in flight
        y = conv(local)
        dist.recv(token, src=0, group=side)  # again, in rank 0's backward
        y.sum().backward()
        events = None
    else:
        with tplayers.count_collectives() as log, _Gate(log, side) as gate:
            y = conv(local)
            y.sum().backward()
        assert gate.tokens == 2, gate.events
        events = gate.events
    xs = x.clone().requires_grad_(True)
    serial(xs).sum().backward()
    torch.testing.assert_close(tplayers.gather(y, 2, mesh), serial(x), **TIGHT)
    torch.testing.assert_close(tplayers.gather(local.grad, 2, mesh), xs.grad, **TIGHT)
    torch.testing.assert_close(conv.weight.grad, serial.weight.grad, **TIGHT)
    return events


def test_interior_computed_while_halo_in_flight():
    events = run_ranks(_order, 2, timeout=30)[0]
    # forward: the main convolution is the first one and runs with the halo posted; backward: the
    # strips' input gradients first, then the main convolution's backward with the adjoint halo in flight
    assert events[0] == ("convolution.default", 1), events


def _compiled(rank, world):
    """torch.compile(fullgraph=True) of an overlap_halo=True conv stack (compiled: the halo-padded strategy)
    equals eager (main-plus-strips for its zero-padded layer), with the same collectives."""
    import copy

    import torch._dynamo as dynamo

    torch.manual_seed(0)
    mesh = tplayers.default_mesh()
    layers = [
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Conv2d(4, 4, 3, stride=2, padding=1, padding_mode="circular"),
        nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect"),
    ]
    eager = nn.Sequential(
        *[tplayers.DistributedConv2d.from_module(m.double(), mesh=mesh, overlap_halo=True) for m in layers]
    )
    model = copy.deepcopy(eager)
    x = tplayers.shard(torch.randn(2, 3, 8 * world + 2, 6, dtype=torch.float64), 2, mesh)
    model(x), eager(x)  # layouts cached
    assert edge_convs(eager) == 1  # the zero-padded "same" layer; the circular and reflect ones: halo-padded
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for m in (compiled, eager):
        xi = x.clone().requires_grad_(True)
        with tplayers.count_collectives() as log:
            y = m(xi)
            (y * y).sum().backward()
        results.append((y.detach(), xi.grad, [p.grad for p in m.parameters()], log.summary()))
    (yc, gc, pc, lc), (ye, ge, pe, le) = results
    assert lc == le, (lc, le)
    torch.testing.assert_close(yc, ye, rtol=1e-13, atol=1e-13)  # the strategies sum in different orders
    torch.testing.assert_close(gc, ge, rtol=1e-13, atol=1e-13)
    for a, b in zip(pc, pe):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    return True


def test_overlapped_conv_compiles_fullgraph_equal_to_eager():
    run_ranks(_compiled, 3, timeout=240)
