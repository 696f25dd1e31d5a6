"""torch.compile(fullgraph=True) of parallel models: zero graph breaks, results equal eager.

Communication is traced as the registered custom ops of ``tplayers.comm.collectives``;
``fullgraph=True`` raises on any graph break, and ``torch._dynamo.explain`` counts them.
"""

import copy
import os
import time

import pytest
import torch
import torch._dynamo as dynamo
from harness import run_ranks
from torch import nn

import tplayers
from tplayers.comm import count_collectives


class Block(nn.Module):
    """A transformer-style TP block: Column -> GELU -> Row, plus a gathered Column head and a Row
    taking a full input (split locally), so every fused Function and collective is traced."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(10, 23)
        self.down = nn.Linear(23, 10)
        self.head = nn.Linear(10, 7)
        self.tail = nn.Linear(7, 5)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return self.tail(self.head(h))


PLAN = {
    "up": tplayers.ColumnParallel(),
    "down": tplayers.RowParallel(),
    "head": tplayers.ColumnParallel(gather_output=True),
    "tail": tplayers.RowParallel(input_is_parallel=False),
}


def _step(model, x, g):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(g)
    return y.detach(), x.grad, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def _tp_block(rank, world, backend):
    torch.manual_seed(0)
    serial = Block().double()
    eager = tplayers.parallelize_module(copy.deepcopy(serial), PLAN)
    model = copy.deepcopy(eager)
    explained = dynamo.explain(model)(torch.randn(3, 4, 10, dtype=torch.float64))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    times = []
    for step in range(2):  # the second step runs on updated weights and another input
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(3, 4, 10, dtype=torch.float64, generator=gen)
        g = torch.randn(3, 4, 5, dtype=torch.float64, generator=gen)
        t0 = time.perf_counter()
        with count_collectives() as log_c:
            got = _step(compiled, x, g)
        times.append(time.perf_counter() - t0)
        with count_collectives() as log_e:
            ref = _step(eager, x, g)
        assert log_c.summary() == log_e.summary()  # the same collectives, counted at run time
        # fp64 round-off only: AOT decomposes F.linear/gelu (another summation order), inductor fuses
        tol = dict(rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(got[0], ref[0], **tol)
        torch.testing.assert_close(got[1], ref[1], **tol)
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], **tol, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got[0], _step(serial, x, g)[0], rtol=1e-12, atol=1e-12)
        opt_s.step()
        opt_e.step()
        opt_c.step()
    return times[0]


@pytest.mark.parametrize("world", [2, 3])
def test_compile_tp_block_aot_eager(world):
    t = run_ranks(_tp_block, world, args=("aot_eager",), timeout=240)
    print(f"TP block, aot_eager, {world} ranks: first step (compile) {max(t):.1f} s")


@pytest.mark.skipif(
    not os.environ.get("TPLAYERS_INDUCTOR"),
    reason="inductor compiles C++ for ~90 s on this CPU; TPLAYERS_INDUCTOR=1 runs it",
)
def test_compile_tp_block_inductor():
    t = run_ranks(_tp_block, 2, args=("inductor",), timeout=400)
    print(f"TP block, inductor, 2 ranks: first step (compile) {max(t):.1f} s")


class CNN(nn.Module):
    """A domain-parallel classifier: convolutions (strided, circular, reflect), max pooling, a global
    average pool and a replicated head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, padding_mode="circular"),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 6, 3, padding=1, padding_mode="reflect"),
            nn.Tanh(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _domain_cnn(rank, world, backend, warm):
    torch.manual_seed(0)
    serial = CNN().double()
    mesh = tplayers.default_mesh()
    plan = {"features": tplayers.DomainParallel(shard_dims=(2,))}
    eager = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    model = copy.deepcopy(eager)
    x0 = torch.randn(2, 3, 8 * world + 4, 10, dtype=torch.float64)
    local0 = tplayers.shard(x0, 2, mesh)
    if not warm:
        # a region never run eagerly is refused at trace time on every rank (the model around the
        # container region is a region too, and its forward is the model's own code)
        with pytest.raises(ValueError, match="run one eager call of the model first"):
            torch.compile(copy.deepcopy(model), backend=backend)(local0)
        dynamo.reset()
    model(local0)  # the eager call the region guard checks the model's ops in
    if not warm:  # cold layouts: the cache is primed while tracing
        tplayers.reset_layouts(model)
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(x0.shape, dtype=torch.float64, generator=gen)
        g = torch.randn(2, 4, dtype=torch.float64, generator=gen)
        local = tplayers.shard(x, 2, mesh)
        t0 = time.perf_counter()
        with count_collectives() as log_c:
            got = _step(compiled, local, g)
        times.append(time.perf_counter() - t0)
        with count_collectives() as log_e:
            ref = _step(eager, local, g)
        if step == 1:  # both layouts cached (step 0 may include one layout exchange, eager or tracing)
            # the same collectives, counted at run time, but for the eager region's entry agreement
            # (the region guard does not run under torch.compile tracing)
            log_e.records = [r for r in log_e.records if not r.tag.startswith("domain.region")]
            # eager, the region's buckets sum the convolutions' parameter gradients in one all-reduce;
            # compiled (no region guard), each convolution sums its own: the same bytes
            grads = ("region.param_grads", "conv.param_grads")
            bucket = [r for r in log_e.records if r.tag in grads]
            per_layer = [r for r in log_c.records if r.tag in grads]
            assert [r.tag for r in bucket] == ["region.param_grads"]
            assert {r.tag for r in per_layer} == {"conv.param_grads"} and len(per_layer) == 3
            assert sum(r.nbytes for r in bucket) == sum(r.nbytes for r in per_layer)
            log_e.records = [r for r in log_e.records if r.tag not in grads]
            log_c.records = [r for r in log_c.records if r.tag not in grads]
            assert log_c.summary() == log_e.summary()
        tol = dict(rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(got[0], ref[0], **tol)
        torch.testing.assert_close(got[1], ref[1], **tol)
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], **tol, msg=lambda m: f"{name}: {m}")
        if step == 0:  # the model itself vs serial is the domain tests' business; here: compile vs eager
            torch.testing.assert_close(got[0], _step(serial, x, g)[0], rtol=1e-12, atol=1e-12)
        for opt in (opt_e, opt_c):
            opt.step()
    explained = dynamo.explain(model)(local0)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    return times[0]


@pytest.mark.parametrize("world,warm", [(2, False), (3, True)])
def test_compile_domain_cnn_aot_eager(world, warm):
    t = run_ranks(_domain_cnn, world, args=("aot_eager", warm), timeout=240)
    print(
        f"DomainParallel CNN, aot_eager, {world} ranks ({'warm' if warm else 'cold'} layout): "
        f"first step (compile) {max(t):.1f} s"
    )


@pytest.mark.skipif(
    not os.environ.get("TPLAYERS_INDUCTOR"),
    reason="inductor compiles C++ for minutes on this CPU; TPLAYERS_INDUCTOR=1 runs it",
)
def test_compile_domain_cnn_inductor():
    t = run_ranks(_domain_cnn, 2, args=("inductor", False), timeout=500)
    print(f"DomainParallel CNN, inductor, 2 ranks: first step (compile) {max(t):.1f} s")


def _domain_2d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1, padding_mode="circular")
    ).double()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("h", "w"))
    plan = {"": tplayers.DomainParallel(shard_dims=(2, 3))}
    eager = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 2, 9, 8, dtype=torch.float64)
    local = tplayers.shard(tplayers.shard(x, 2, mesh["h"]), 3, mesh["w"])  # uneven along H
    g = torch.randn(eager(local).shape, dtype=torch.float64)
    got, ref = _step(compiled, local, g), _step(eager, local, g)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])
    return True


def test_compile_domain_2d_mesh():
    """H and W sharded over a 2 x 2 mesh: the first dim's exchange (corners ride on the second)
    compiles too, bitwise equal to eager."""
    run_ranks(_domain_2d, 4, timeout=240)
