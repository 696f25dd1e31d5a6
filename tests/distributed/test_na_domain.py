"""Domain-parallel NeighborhoodAttention against the single-device module (fp64, gloo ranks)."""

import copy
import random

import pytest
import torch
from harness import run_ranks
from oracle import assert_params_match
from partition_rule import na_partition_ok

import tplayers
from tplayers.ops.na_layout import axis_halos

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _random_partition(rng, length, parts):
    cuts = sorted(rng.randint(0, length) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [length])]


def _draw_case(rng, mesh_shape, shard_dims):
    """A random layer config and a partition (feasible or not) of a random image."""
    kernel = (rng.randint(1, 5), rng.randint(1, 5))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    causal = (rng.random() < 0.25, rng.random() < 0.25)
    size = [rng.randint(k * d, k * d + 7) for k, d in zip(kernel, dilation)]
    parts = {d: mesh_shape[i] for i, d in enumerate(shard_dims)}
    sizes = {d: _random_partition(rng, size[d - 1], parts[d]) for d in shard_dims}
    return kernel, dilation, causal, size, sizes


def _local(full, sizes, coords, shard_dims):
    for i, d in enumerate(shard_dims):
        start = sum(sizes[d][: coords[i]])
        full = full.narrow(d, start, sizes[d][coords[i]])
    return full


def _parity(rank, world, mesh_shape, shard_dims, seed, cases, want_infeasible):
    mesh = tplayers.init_mesh(mesh_shape, ("h", "w")[: len(mesh_shape)], device_type="cpu")
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    rng = random.Random(seed)
    done = infeasible = 0
    while done < cases or infeasible < want_infeasible:
        kernel, dilation, causal, size, sizes = _draw_case(rng, mesh_shape, shard_dims)
        # feasible by the test's own rule (tests/partition_rule.py), not by asking the planner
        ok = all(na_partition_ok(sizes[d], kernel[d - 1], 1, dilation[d - 1], causal[d - 1]) for d in shard_dims)
        if not ok and infeasible >= want_infeasible or ok and done >= cases:
            continue
        heads, head_dim = rng.randint(1, 2), rng.randint(1, 3)
        torch.manual_seed(rng.randrange(1 << 30))  # same on every rank
        serial = tplayers.NeighborhoodAttention(
            heads * head_dim,
            heads,
            kernel,
            dilation,
            causal,
            qkv_bias=rng.random() < 0.7,
            rel_pos_bias=rng.random() < 0.7,
            dtype=torch.float64,
        )
        parallel = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=shard_dims)
        make = lambda: torch.randn(2, *size, heads * head_dim, dtype=torch.float64)  # noqa: E731
        where = f"kernel {kernel} dilation {dilation} causal {causal} size {size} parts {sizes}"
        if not ok:
            infeasible += 1
            try:
                parallel(_local(make(), sizes, coords, shard_dims))
            except ValueError as err:
                assert "halo" in str(err), err
                continue
            # accepted although the rule finds no halo that fits: then it must be exact
        opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
        opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1)
        for _ in range(2):  # forward/backward, one SGD step, then a second input
            x = make()
            xs = x.clone().requires_grad_()
            xp = _local(x, sizes, coords, shard_dims).clone().requires_grad_()
            ys = serial(xs)
            try:
                yp = parallel(xp)
            except ValueError as err:
                raise AssertionError(f"refused a partition the rule calls feasible ({where}): {err}") from err
            torch.testing.assert_close(yp, _local(ys, sizes, coords, shard_dims), **TIGHT)
            cot = torch.randn(ys.shape, dtype=torch.float64)
            (ys * cot).sum().backward()
            (yp * _local(cot, sizes, coords, shard_dims)).sum().backward()
            torch.testing.assert_close(xp.grad, _local(xs.grad, sizes, coords, shard_dims), **TIGHT)
            assert_params_match(parallel, serial, grads=True, **TIGHT)
            opt_s.step(), opt_p.step()
            opt_s.zero_grad(), opt_p.zero_grad()
        done += ok
    return done


@pytest.mark.parametrize("world,shard_dims", [(2, (1,)), (2, (2,)), (3, (1,)), (3, (2,))])
def test_parity_1d_mesh_uneven(world, shard_dims):
    # with 2 shards the neighbour is the whole rest of the axis: every partition is feasible
    run_ranks(_parity, world, args=((world,), shard_dims, 10 * world + shard_dims[0], 5, world - 2), timeout=120)


def test_parity_2x2_mesh():
    run_ranks(_parity, 4, args=((2, 2), (1, 2), 77, 3, 0), timeout=120)  # 2 shards per dim: always feasible


def _edge_shards(rank, world):
    """Hand-picked: edge shards smaller than kernel * dilation, and the widths they get."""
    mesh = tplayers.init_mesh(device_type="cpu")
    # H = 13, kernel 5, dilation 2 (kernel * dilation = 10); edge shards of 2 rows
    sizes = [2, 9, 2]
    plans = axis_halos(sizes, kernel=5, dilation=2, causal=False)
    # last shard (rows 11, 12): windows {3,5,7,9,11} and {4,6,...,12}: 8 halo rows, not k//2*d = 4
    assert plans[2][1] == (8, 0) and plans[0][1] == (0, 8)
    torch.manual_seed(0)
    serial = tplayers.NeighborhoodAttention(4, 2, 5, 2, rel_pos_bias=True, dtype=torch.float64)
    parallel = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=(1,))
    x = torch.randn(1, 13, 10, 4, dtype=torch.float64)
    local = x.narrow(1, sum(sizes[:rank]), sizes[rank])
    with tplayers.count_collectives() as log:
        y = parallel(local)
    torch.testing.assert_close(y, serial(x).narrow(1, sum(sizes[:rank]), sizes[rank]), **TIGHT)
    recv, send = plans[rank][1], plans[rank][2]
    row_bytes = 10 * 2 * 4 * 8  # W * (K, V) * C * fp64: only K and V travel
    assert log.bytes("recv") == (recv[0] + recv[1]) * row_bytes
    assert log.count("all_reduce") == 0  # forward: halos (and the one-off layout all-gather) only
    with tplayers.count_collectives() as log:
        y.sum().backward()
    n_params = sum(p.numel() for p in parallel.parameters())
    assert log.count("all_reduce") == 1 and log.bytes("all_reduce") == n_params * 8  # one fused reduce
    assert log.bytes("recv") == (send[0] + send[1]) * row_bytes  # the halo adjoint comes back
    return True


def test_edge_shards_smaller_than_kernel_times_dilation():
    run_ranks(_edge_shards, 3, timeout=60)


def _bad_layouts(rank, world):
    mesh = tplayers.init_mesh(device_type="cpu")
    layer = tplayers.NeighborhoodAttention(4, 1, 7, rel_pos_bias=True, mesh=mesh, shard_dims=(2,))
    for local_w, match in (([5, 1, 5][rank], "halo"), (2, "global size along W")):
        with pytest.raises(ValueError, match=match):
            layer(torch.randn(1, 8, local_w, 4))
        layer.reset_layout()
    bad = torch.randn(1, 8, 9, 4) if rank != 1 else torch.randn(1, 8, 9, 5)
    with pytest.raises(ValueError, match="every rank" if rank != 1 else r"\(B, H, W, 4\)"):
        layer(bad)
    # A non-tensor on one rank still joins the layout exchange: every rank raises.
    with pytest.raises(ValueError, match="every rank" if rank != 0 else "input must be"):
        layer("not a tensor" if rank == 0 else torch.randn(1, 8, 9, 4))
    # At a shape whose layout is cached, a dtype change raises before any halo traffic.
    assert layer(torch.randn(1, 8, 9, 4)).shape == (1, 8, 9, 4)
    with pytest.raises(ValueError, match="dtype"):
        layer(torch.randn(1, 8, 9, 4, dtype=torch.float64))
    assert layer(torch.randn(1, 8, 9, 4)).shape == (1, 8, 9, 4)  # still in step
    return True


def test_errors_on_every_rank_before_halo_traffic():
    run_ranks(_bad_layouts, 3, timeout=60)


class _Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = tplayers.NeighborhoodAttention(dim, heads, (3, 4), (2, 1), rel_pos_bias=True)
        self.mlp = torch.nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def _plan_parity(rank, world, shard_dims, mesh_shape):
    mesh = tplayers.init_mesh(mesh_shape, ("h", "w")[: len(mesh_shape)], device_type="cpu")
    torch.manual_seed(3)
    serial = torch.nn.Sequential(_Block(8, 2), _Block(8, 2)).double()
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=shard_dims)}, mesh=mesh
    )
    assert all(
        m.shard_dims == tuple(d - 1 for d in shard_dims)
        for m in model.modules()
        if isinstance(m, tplayers.NeighborhoodAttention)
    )
    x = torch.randn(2, 11, 9, 8, dtype=torch.float64)
    na_dims = tuple(d - 1 for d in shard_dims)  # NCHW names -> (B, H, W, C) dims
    local = tplayers.shard(x, na_dims if len(na_dims) > 1 else na_dims[0], mesh).clone().requires_grad_()
    xs = x.clone().requires_grad_()
    ys, yp = serial(xs), model(local)
    ref = tplayers.shard(ys.detach(), na_dims if len(na_dims) > 1 else na_dims[0], mesh)
    torch.testing.assert_close(yp, ref, **TIGHT)
    ys.pow(2).sum().backward()
    yp.pow(2).sum().backward()
    torch.testing.assert_close(
        local.grad, tplayers.shard(xs.grad, na_dims if len(na_dims) > 1 else na_dims[0], mesh), **TIGHT
    )
    assert_params_match(model, serial, grads=True, **TIGHT)
    return True


@pytest.mark.parametrize("world,shard_dims,mesh_shape", [(2, (2,), (2,)), (3, (3,), (3,)), (4, (2, 3), (2, 2))])
def test_domain_parallel_plan_swaps_neighborhood_attention(world, shard_dims, mesh_shape):
    run_ranks(_plan_parity, world, args=(shard_dims, mesh_shape), timeout=120)


def _run_example(rank, world):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "na_transformer.py")
    spec = importlib.util.spec_from_file_location("na_transformer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main()  # asserts parity against the single-device model, then trains
    return True


def test_example_runs_with_parity_on_2_ranks():
    run_ranks(_run_example, 2, timeout=120)


def _bf16(rank, world):
    """The layer in bf16 (no autocast: a module moved with ``.to(torch.bfloat16)``): the attention
    computed in fp32 on every shard; output, input and parameter gradients bf16 and within bf16
    rounding of the single-device bf16 module's (the linear layers round per shard)."""
    torch.manual_seed(0)
    serial = tplayers.NeighborhoodAttention(8, 2, (3, 5), (1, 2), (True, False), rel_pos_bias=True)
    serial = serial.to(torch.bfloat16)
    mesh = tplayers.default_mesh()
    parallel = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=(1,))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4 * world + 1, 11, 8, generator=gen).to(torch.bfloat16)
    cot = torch.randn(2, 4 * world + 1, 11, 8, generator=gen).to(torch.bfloat16)
    xs, xp = x.clone().requires_grad_(), tplayers.shard(x, 1, mesh).requires_grad_()
    ys, yp = serial(xs), parallel(xp)
    assert ys.dtype == yp.dtype == torch.bfloat16
    (ys.float() * cot.float()).sum().backward()
    (yp.float() * tplayers.shard(cot, 1, mesh).float()).sum().backward()
    assert xp.grad.dtype == torch.bfloat16
    worst = []
    for name, a, b in (("out", yp, tplayers.shard(ys, 1, mesh)), ("dx", xp.grad, tplayers.shard(xs.grad, 1, mesh))):
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        worst.append((name, err))
        assert err < 2**-6, (name, err)
    for name, p in parallel.named_parameters():
        assert p.grad.dtype == torch.bfloat16, name
    assert_params_match(parallel, serial, grads=True, rtol=2**-6, atol=0.02)  # bf16 partial sums reduced
    return worst


def test_bf16_layer_on_2_ranks():
    worst = run_ranks(_bf16, 2, timeout=60)
    print(f"bf16 NeighborhoodAttention on 2 ranks: worst |error| / max {worst}")


def _causal_first_shard(rank, world):
    """Causal rows, a first shard of fewer rows than the kernel (its windows hold a key row at two
    slots: the C kernel once computed them wrong), forward and every gradient against one device."""
    mesh = tplayers.init_mesh(device_type="cpu")
    for sizes, kernel, dilation in (([2, 6], 3, 1), ([3, 6], (4, 3), (2, 1))):
        torch.manual_seed(0)
        serial = tplayers.NeighborhoodAttention(
            4, 2, kernel, dilation, (True, False), rel_pos_bias=True, dtype=torch.float64
        )
        parallel = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=(1,))
        x = torch.randn(2, sum(sizes), 7, 4, dtype=torch.float64)
        xs, xp = x.clone().requires_grad_(), x.narrow(1, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
        ys, yp = serial(xs), parallel(xp)
        torch.testing.assert_close(yp, ys.narrow(1, sum(sizes[:rank]), sizes[rank]), **TIGHT)
        cot = torch.randn(ys.shape, dtype=torch.float64)
        (ys * cot).sum().backward()
        (yp * cot.narrow(1, sum(sizes[:rank]), sizes[rank])).sum().backward()
        torch.testing.assert_close(xp.grad, xs.grad.narrow(1, sum(sizes[:rank]), sizes[rank]), **TIGHT)
        assert_params_match(parallel, serial, grads=True, **TIGHT)
    return True


def test_causal_first_shard_smaller_than_the_kernel():
    run_ranks(_causal_first_shard, 2, timeout=60)
