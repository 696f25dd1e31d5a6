"""ColumnParallelLinear with fused sections / whole heads / GQA replicas, RowParallelLinear(head_dim), vs serial."""

import copy
import random

import pytest
import torch
from harness import run_ranks
from oracle import assert_local_slices
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _random_config(rng, world):
    """Sections of whole heads: GPT-2-like equal blocks, GQA (query heads a multiple of kv heads), or plain."""
    kind = rng.choice(["equal", "gqa", "plain"])
    hd = rng.randint(1, 3)
    if kind == "equal":
        heads = rng.randint(1, 5)
        return (heads * hd,) * 3, hd
    if kind == "gqa":
        while True:
            kv = rng.randint(1, 3)
            q = kv * rng.randint(1, 4)
            if q % world == 0 and (kv % world == 0 or world % kv == 0):  # a valid GQA split at this world
                return (q * hd, kv * hd, kv * hd), hd
    return tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3))), None


def _fused_cases(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    log_counts = []
    for _ in range(10):
        sections, hd = _random_config(rng, world)
        d_in, bias = rng.randint(1, 6), rng.random() < 0.7
        gather = rng.random() < 0.4
        torch.manual_seed(rng.randrange(1 << 30))
        dense = nn.Linear(d_in, sum(sections), bias=bias).double()
        col = tplayers.ColumnParallelLinear.from_module(
            copy.deepcopy(dense), mesh=mesh, sections=sections, head_dim=hd, gather_output=gather
        )
        ranges = col.weight_ranges
        assert col.local_sections == tuple(b - a for a, b in ranges)
        opt_s = torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9)
        opt_p = torch.optim.SGD(col.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            x = torch.randn(2, 3, d_in, dtype=torch.float64)
            xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            ys = dense(xs)
            with tplayers.count_collectives() as fwd:
                yp = col(xp)
            if gather:
                torch.testing.assert_close(yp, ys, **TIGHT)
                cot = torch.randn_like(ys)
                cot_p = cot
            else:  # the local output: this rank's slice of each block, in block order
                torch.testing.assert_close(yp, torch.cat([ys[..., a:b] for a, b in ranges], -1), **TIGHT)
                cot = torch.randn_like(ys)
                # replicated rows get their cotangent on their first holder only, so the serial
                # gradient is the sum over the ranks of their local contributions
                owner = _first_holder(col, world)
                cot_p = torch.cat([cot[..., a:b] * (owner[a:b] == rank) for a, b in ranges], -1)
            with tplayers.count_collectives() as bwd:
                (yp * cot_p).sum().backward()
            (ys * cot).sum().backward()
            torch.testing.assert_close(xp.grad, xs.grad, **TIGHT)
            assert_local_slices(col, dense, grads=True, **TIGHT)
            opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
            assert_local_slices(col, dense, grads=False, **TIGHT)
            log_counts.append((col.collectives(), fwd.summary(), bwd.summary()))
    return log_counts


def _first_holder(col, world):
    """For each serial output feature, the lowest rank holding it."""
    owner = torch.full((col.out_features,), world)
    for r in reversed(range(world)):
        for a, b in col._layout.ranges(r):
            owner[a:b] = r
    return owner


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fused_sections_heads_gqa_random(world):
    for counts in run_ranks(_fused_cases, world, args=(200 + world,), timeout=120):
        for (want_fwd, want_bwd), fwd, bwd in counts:  # collectives() matches what was issued
            assert sorted(k for k, (n, _) in fwd.items() for _ in range(n)) == sorted(want_fwd)
            assert sorted(k for k, (n, _) in bwd.items() for _ in range(n)) == sorted(want_bwd)


def _gqa_replicas(rank, world):
    """8 query heads, 2 kv heads at 4 ranks: kv head r*2//4, its gradient summed over the 2 replicas."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    dense = nn.Linear(5, 12).double()
    col = tplayers.ColumnParallelLinear.from_module(copy.deepcopy(dense), mesh=mesh, sections=(8, 2, 2), head_dim=1)
    kv = rank * 2 // world
    assert col.weight_ranges == ((2 * rank, 2 * rank + 2), (8 + kv, 9 + kv), (10 + kv, 11 + kv))
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    # Each kv output is used once in the serial model: here by its first replica (even ranks),
    # standing for "by this rank's query heads". Rank 1 and 3 hold the same kv rows but add
    # nothing, so their kv gradients are zero until summed with their group's.
    mask = torch.ones(4, dtype=torch.float64)
    mask[2:] = float(rank % 2 == 0)
    with tplayers.count_collectives() as bwd:
        (col(x) * mask).sum().backward()
    dense(x).sum().backward()
    assert_local_slices(col, dense, grads=True, **TIGHT)
    return bwd.summary()


def test_gqa_kv_gradients_summed_over_replicas():
    for bwd in run_ranks(_gqa_replicas, 4, timeout=30):
        # input gradient + replica gradient sum (the kv blocks' rows: 4 rows x (5 + 1 bias) fp64)
        assert bwd == {"all_reduce": (2, 3 * 5 * 8 + 4 * 6 * 8)}


def _row_heads(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(1)
    dense = nn.Linear(9, 4).double()  # 3 heads of 3
    row = tplayers.RowParallelLinear.from_module(copy.deepcopy(dense), mesh=mesh, head_dim=3)
    heads = tplayers.shard_sizes(3, world)
    start = 3 * sum(heads[:rank])
    assert row.weight.shape == (4, 3 * heads[rank])
    x = torch.randn(2, 9, dtype=torch.float64)
    xp = x[:, start : start + 3 * heads[rank]].clone().requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    torch.testing.assert_close(row(xp), dense(xs), **TIGHT)
    row(xp).sum().backward()
    dense(xs).sum().backward()
    torch.testing.assert_close(xp.grad, xs.grad[:, start : start + 3 * heads[rank]], **TIGHT)
    assert_local_slices(row, dense, grads=True, **TIGHT)
    return row.partition_sizes


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_whole_heads(world):
    for sizes in run_ranks(_row_heads, world, timeout=30):
        assert sizes == [3 * h for h in tplayers.shard_sizes(3, world)]


def _errors(rank, world):
    mesh = tplayers.default_mesh()
    cases = [
        (dict(sections=(4, 4)), "sum to 8, expected out_features=12"),
        (dict(sections=(6, 0, 6)), "positive ints"),
        (dict(sections="qkv"), "sequence of block sizes"),
        (dict(sections=(6, 6), head_dim=4), "sections[0]=6 is not a whole number of heads of head_dim=4"),
        (dict(head_dim=5), "out_features=12 is not a whole number of heads of head_dim=5"),
        (dict(head_dim=0), "head_dim must be a positive int"),
        (dict(sections=(8, 2, 2), head_dim=1), "grouped-query attention"),  # 3 ranks cannot split 8 q / 2 kv heads
    ]
    for kw, needle in cases:
        with pytest.raises(ValueError) as err:
            tplayers.ColumnParallelLinear(5, 12, mesh=mesh, **kw)
        assert needle in str(err.value), (needle, str(err.value))
    with pytest.raises(ValueError, match="head_dim needs input_is_parallel=True"):
        tplayers.RowParallelLinear(12, 5, mesh=mesh, head_dim=3, input_is_parallel=False)
    with pytest.raises(ValueError, match="in_features=12 is not a whole number of heads of head_dim=5"):
        tplayers.RowParallelLinear(12, 5, mesh=mesh, head_dim=5)
    return True


def test_section_errors_on_every_rank():
    run_ranks(_errors, 3, timeout=30)


def _sequence_parallel_gqa(rank, world):
    """sections + head_dim with sequence_parallel=True: GQA replica gradients summed on that path too."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    dense = nn.Linear(5, 12).double()
    col = tplayers.ColumnParallelLinear.from_module(
        copy.deepcopy(dense), mesh=mesh, sections=(8, 2, 2), head_dim=1, sequence_parallel=True
    )
    x = torch.randn(2, 7, 5, dtype=torch.float64)  # 7 tokens on 4 ranks: uneven
    spec = tplayers.ShardSpec.balanced(x.shape, 1, world, rank)
    xl = spec.take(x).clone().requires_grad_(True)
    y = col(xl)  # (2, 7, local widths)
    torch.testing.assert_close(y, torch.cat([dense(x)[..., a:b] for a, b in col.weight_ranges], -1), **TIGHT)
    mask = torch.ones(y.shape[-1], dtype=torch.float64)
    mask[2:] = float(rank % 2 == 0)  # each kv output used once: by its first replica
    with tplayers.count_collectives() as bwd:
        (y * mask).sum().backward()
    xs = x.clone().requires_grad_(True)
    dense(xs).sum().backward()
    assert_local_slices(col, dense, grads=True, **TIGHT)
    torch.testing.assert_close(xl.grad, spec.take(xs.grad), **TIGHT)
    return bwd.summary(), col.collectives()[1]


def test_sequence_parallel_with_gqa_sections():
    for bwd, described in run_ranks(_sequence_parallel_gqa, 4, timeout=60):
        assert {k: n for k, (n, _) in bwd.items()} == {"reduce_scatter": 1, "all_reduce": 1}
        assert described == ["reduce_scatter", "all_reduce"]
