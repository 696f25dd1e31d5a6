"""Vocab-parallel and embedding-dim-parallel embeddings, and vocab_parallel_cross_entropy, vs serial (fp64)."""

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _embeddings(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(8):
        vocab, dim = rng.randint(1, 9), rng.randint(1, 6)  # vocab < world at times: empty shards
        pad = rng.choice([None, rng.randrange(vocab)])
        torch.manual_seed(rng.randrange(1 << 30))
        dense = nn.Embedding(vocab, dim, padding_idx=pad).double()
        style = tplayers.RowParallel() if case % 2 == 0 else tplayers.ColumnParallel(gather_output=True)
        serial = nn.Sequential(dense, nn.Linear(dim, 3).double())
        par = tplayers.parallelize_module(copy.deepcopy(serial), {"0": style}, mesh=mesh)
        want = tplayers.VocabParallelEmbedding if case % 2 == 0 else tplayers.ColumnParallelEmbedding
        assert type(par[0]) is want
        opt_s, opt_p = torch.optim.SGD(serial.parameters(), lr=0.5), torch.optim.SGD(par.parameters(), lr=0.5)
        for _ in range(2):
            ids = torch.randint(0, vocab, (2, 5))
            with tplayers.count_collectives() as fwd:
                yp = par(ids)
            ys = serial(ids)
            torch.testing.assert_close(yp, ys, **TIGHT)
            with tplayers.count_collectives() as bwd:
                yp.square().sum().backward()
            ys.square().sum().backward()
            spec = par[0].shard_specs()["weight"]
            torch.testing.assert_close(par[0].weight.grad, spec.take(serial[0].weight.grad), **TIGHT)
            torch.testing.assert_close(par[1].weight.grad, serial[1].weight.grad, **TIGHT)
            opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
            torch.testing.assert_close(par[0].weight, spec.take(serial[0].weight), **TIGHT)
            if world > 1:
                kind = "all_reduce" if case % 2 == 0 else "all_gather"
                assert fwd.count() == fwd.count(kind) == 1, fwd.summary()
                assert bwd.count() == 0, bwd.summary()
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_embedding_parity_random(world):
    run_ranks(_embeddings, world, args=(world,), timeout=60)


def _embedding_errors(rank, world):
    mesh = tplayers.default_mesh()
    emb = tplayers.VocabParallelEmbedding(10, 4, mesh=mesh)
    col = tplayers.ColumnParallelEmbedding(10, 4, mesh=mesh)
    msgs = []
    with tplayers.count_collectives() as log:
        for layer in (emb, col):
            for bad in (torch.tensor([3, 10]), torch.tensor([-1]), torch.tensor([1.0]), [1, 2]):
                with pytest.raises((ValueError, TypeError)) as err:
                    layer(bad)
                msgs.append(str(err.value))
    assert log.count() == 0
    with pytest.raises(ValueError, match="max_norm"):
        tplayers.VocabParallelEmbedding.from_module(nn.Embedding(5, 2, max_norm=1.0), mesh=mesh)
    with pytest.raises(TypeError, match="nn.Embedding"):
        tplayers.VocabParallelEmbedding.from_module(nn.Linear(5, 2), mesh=mesh)
    with pytest.raises(ValueError, match="applies to nn.Linear"):
        tplayers.parallelize_module(
            nn.Sequential(nn.Embedding(5, 2)), {"0": tplayers.RowParallel(head_dim=1)}, mesh=mesh
        )
    with pytest.raises(ValueError, match="applies to nn.Linear"):
        tplayers.parallelize_module(
            nn.Sequential(nn.Embedding(5, 2)), {"0": tplayers.ColumnParallel(sections=(1, 1))}, mesh=mesh
        )
    return msgs


def test_embedding_errors_on_every_rank_before_any_collective():
    for msgs in run_ranks(_embedding_errors, 2, timeout=30):
        assert "token id 10 is out of range [0, 10)" in msgs[0] and "token id -1" in msgs[1]
        assert "int64 or int32" in msgs[2] and "torch.Tensor" in msgs[3]


def _cross_entropy(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    counts = []
    for _ in range(10):
        vocab = rng.randint(1, 13)  # uneven; fewer classes than ranks at times
        lead = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 2)))
        smoothing = rng.choice([0.0, 0.1, 0.37, 1.0])
        torch.manual_seed(rng.randrange(1 << 30))
        full = torch.randn(*lead, vocab, dtype=torch.float64) * 3
        target = torch.randint(0, vocab, lead)
        target.view(-1)[:: rng.randint(2, 4)] = -100  # some ignored
        spec = tplayers.ShardSpec.balanced(full.shape, full.dim() - 1, world, rank)
        for reduction in ("mean", "sum", "none"):
            ref_in = full.clone().requires_grad_(True)
            ref = F.cross_entropy(
                ref_in.reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing, reduction=reduction
            )
            ref = ref.view(lead) if reduction == "none" else ref
            local = spec.take(full).clone().requires_grad_(True)
            with tplayers.count_collectives() as fwd:
                got = tplayers.vocab_parallel_cross_entropy(
                    local, target, mesh, label_smoothing=smoothing, reduction=reduction
                )
            torch.testing.assert_close(got, ref, equal_nan=True, **TIGHT)  # nan when every token is ignored
            cot = torch.rand_like(ref) + 0.5
            with tplayers.count_collectives() as bwd:
                (got * cot).sum().backward()
            (ref * cot).sum().backward()
            torch.testing.assert_close(local.grad, spec.take(ref_in.grad), equal_nan=True, **TIGHT)
            counts.append((fwd.summary(), bwd.count()))
    # ignore_index other than -100, and every token ignored (mean is nan, like F.cross_entropy)
    full = torch.randn(6, 5, dtype=torch.float64)
    spec = tplayers.ShardSpec.balanced(full.shape, 1, world, rank)
    target = torch.tensor([0, 3, 3, 4, 1, 3])
    got = tplayers.vocab_parallel_cross_entropy(spec.take(full), target, mesh, ignore_index=3)
    torch.testing.assert_close(got, F.cross_entropy(full, target, ignore_index=3), **TIGHT)
    got = tplayers.vocab_parallel_cross_entropy(spec.take(full), torch.full((6,), 7), mesh, ignore_index=7)
    assert math.isnan(got.item()) and math.isnan(F.cross_entropy(full, torch.full((6,), 7), ignore_index=7).item())
    return counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vocab_parallel_cross_entropy_random(world):
    for counts in run_ranks(_cross_entropy, world, args=(40 + world,), timeout=90):
        for fwd, bwd in counts:
            # two all-reduces forward: (tokens + world) maxima/sizes, (3, tokens) sums; none backward
            assert fwd == ({} if world == 1 else {"all_reduce": (2, fwd["all_reduce"][1])}), fwd
            assert bwd == 0


def test_vocab_parallel_cross_entropy_bytes():
    def fn(rank, world):
        mesh = tplayers.default_mesh()
        local = torch.randn(4, 5, 3 if rank == 0 else 2, dtype=torch.float64)
        with tplayers.count_collectives() as log:
            tplayers.vocab_parallel_cross_entropy(local, torch.zeros(4, 5, dtype=torch.long), mesh)
        return log.bytes("all_reduce")

    tokens = 20
    assert run_ranks(fn, 2, timeout=30) == [((tokens + 2) + 3 * tokens) * 8] * 2


def _ce_errors(rank, world):
    mesh = tplayers.default_mesh()
    local = torch.randn(3, 4)
    msgs = []
    with tplayers.count_collectives() as log:
        for kw in (
            dict(target=torch.zeros(4, dtype=torch.long)),
            dict(target=torch.zeros(3)),
            dict(target=torch.zeros(3, dtype=torch.long), reduction="avg"),
            dict(target=torch.zeros(3, dtype=torch.long), label_smoothing=1.5),
        ):
            target = kw.pop("target")
            with pytest.raises((ValueError, TypeError)) as err:
                tplayers.vocab_parallel_cross_entropy(local, target, mesh, **kw)
            msgs.append(str(err.value))
    assert log.count() == 0, "argument errors are raised before any collective"
    with pytest.raises(ValueError, match=r"target 8 is out of range \[0, 8\)"):  # every rank, same collective
        tplayers.vocab_parallel_cross_entropy(local, torch.tensor([0, 8, 1]), mesh)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # still in step
    assert t.item() == world
    return msgs


def test_vocab_parallel_cross_entropy_errors_on_every_rank():
    for msgs in run_ranks(_ce_errors, 2, timeout=30):
        assert "target shape must be local_logits.shape[:-1] = (3,), got (4,)" in msgs[0]
        assert "int64" in msgs[1] and "reduction" in msgs[2] and "label_smoothing" in msgs[3]
