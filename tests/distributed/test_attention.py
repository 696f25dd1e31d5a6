"""tplayers.functional.scaled_dot_product_attention against the serial F.scaled_dot_product_attention
on the gathered tokens: fp64, random sizes, uneven (and empty) partitions, ring and all-gather."""

import random

import pytest
import torch
import torch.distributed as dist
from attention_cases import check_against_serial, token_order, uneven_sizes
from harness import run_ranks

import tplayers


def _random_cases(rank, world, seed, algorithm):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(6):
        b, h, e, ev = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 5)
        lq, lk = rng.randint(world, 13), rng.randint(world, 13)
        qsizes, ksizes = uneven_sizes(rng, lq, world), uneven_sizes(rng, lk, world)
        strided = rng.random() < 0.5
        qpos, kpos = token_order(rng, lq, qsizes, strided), token_order(rng, lk, ksizes, strided)
        g = torch.Generator().manual_seed(seed * 100 + case)
        q = torch.randn(b, h, lq, e, dtype=torch.float64, generator=g)
        k = torch.randn(b, h, lk, e, dtype=torch.float64, generator=g)
        v = torch.randn(b, h, lk, ev, dtype=torch.float64, generator=g)
        scale = rng.choice([None, 0.3])
        check_against_serial(
            rank, q, k, v, qpos, kpos, scale=scale, mesh=mesh, algorithm=algorithm, pass_positions=strided, seed=case
        )
    return True


@pytest.mark.parametrize("world,algorithm", [(2, "ring"), (3, "ring"), (4, "ring"), (3, "all_gather")])
def test_random_sizes_uneven_partitions(world, algorithm):
    assert all(run_ranks(_random_cases, world, args=(world * 7 + len(algorithm), algorithm), timeout=60))


def _causal_cases(rank, world, seed, algorithm):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(4):
        lq, lk = rng.randint(world, 12), rng.randint(world, 12)
        strided = case % 2 == 1
        qsizes, ksizes = uneven_sizes(rng, lq, world), uneven_sizes(rng, lk, world)
        qpos, kpos = token_order(rng, lq, qsizes, strided), token_order(rng, lk, ksizes, strided)
        g = torch.Generator().manual_seed(seed + case)
        q = torch.randn(2, 2, lq, 4, dtype=torch.float64, generator=g)
        k = torch.randn(2, 2, lk, 4, dtype=torch.float64, generator=g)
        v = torch.randn(2, 2, lk, 4 if case < 2 else 3, dtype=torch.float64, generator=g)  # fused kernel, torch ops
        check_against_serial(
            rank, q, k, v, qpos, kpos, is_causal=True, mesh=mesh, algorithm=algorithm, pass_positions=strided, seed=case
        )
    return True


@pytest.mark.parametrize("world,algorithm", [(2, "ring"), (3, "ring"), (3, "all_gather")])
def test_causal_contiguous_and_strided_positions(world, algorithm):
    assert all(run_ranks(_causal_cases, world, args=(world, algorithm), timeout=60))


def _mask_cases(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(6):
        lq, lk = rng.randint(world, 11), rng.randint(world, 11)
        strided = rng.random() < 0.5
        qsizes, ksizes = uneven_sizes(rng, lq, world), uneven_sizes(rng, lk, world)
        qpos, kpos = token_order(rng, lq, qsizes, strided), token_order(rng, lk, ksizes, strided)
        g = torch.Generator().manual_seed(seed + case)
        q = torch.randn(2, 3, lq, 4, dtype=torch.float64, generator=g)
        k = torch.randn(2, 3, lk, 4, dtype=torch.float64, generator=g)
        v = torch.randn(2, 3, lk, 4 if case < 4 else 5, dtype=torch.float64, generator=g)  # fused, torch ops
        shape = rng.choice([(lq, lk), (2, 1, lq, lk), (1, 3, 1, lk), (2, 3, lq, lk)])
        if case % 2:
            mask = torch.rand(shape, generator=g) < 0.7
            if case == 3:
                mask[..., 0, :] = False  # a query row with no allowed key: 0, as torch
        else:
            mask = torch.randn(shape, dtype=torch.float64, generator=g)
        check_against_serial(rank, q, k, v, qpos, kpos, attn_mask=mask, mesh=mesh, pass_positions=strided, seed=case)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_bool_and_additive_masks_with_global_key_columns(world):
    assert all(run_ranks(_mask_cases, world, args=(world * 3,), timeout=60))


def _gqa_cases(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case, (hq, hk) in enumerate([(4, 2), (6, 1), (3, 3)]):
        lq, lk = rng.randint(world, 10), rng.randint(world, 10)
        qpos = token_order(rng, lq, uneven_sizes(rng, lq, world), False)
        kpos = token_order(rng, lk, uneven_sizes(rng, lk, world), False)
        g = torch.Generator().manual_seed(seed + case)
        q = torch.randn(2, hq, lq, 4, dtype=torch.float64, generator=g)
        k = torch.randn(2, hk, lk, 4, dtype=torch.float64, generator=g)
        v = torch.randn(2, hk, lk, 3, dtype=torch.float64, generator=g)
        check_against_serial(
            rank,
            q,
            k,
            v,
            qpos,
            kpos,
            enable_gqa=True,
            is_causal=case == 1,
            mesh=mesh,
            pass_positions=False,
            seed=case,
            algorithm=("ring", "all_gather")[case % 2],
        )
    return True


def test_gqa_key_heads_repeat_interleaved():
    assert all(run_ranks(_gqa_cases, 3, args=(5,), timeout=60))


def _dropout_cases(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(3):
        lq, lk = rng.randint(world, 9), rng.randint(world, 9)
        strided = case == 1
        qpos = token_order(rng, lq, uneven_sizes(rng, lq, world), strided)
        kpos = token_order(rng, lk, uneven_sizes(rng, lk, world), strided)
        g = torch.Generator().manual_seed(seed + case)
        q = torch.randn(2, 2, lq, 4, dtype=torch.float64, generator=g)
        k = torch.randn(2, 2, lk, 4, dtype=torch.float64, generator=g)
        v = torch.randn(2, 2, lk, 3, dtype=torch.float64, generator=g)
        check_against_serial(
            rank, q, k, v, qpos, kpos, dropout_p=0.3, is_causal=case == 2, mesh=mesh, pass_positions=strided, seed=case
        )
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_dropout_is_the_serial_mask_rows(world):
    assert all(run_ranks(_dropout_cases, world, args=(11,), timeout=60))


def _replicated_kv(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(3):
        lq, lk = rng.randint(world, 10), rng.randint(1, 7)
        qpos = token_order(rng, lq, uneven_sizes(rng, lq, world), case == 1)
        g = torch.Generator().manual_seed(seed + case)
        q = torch.randn(2, 2, lq, 4, dtype=torch.float64, generator=g)
        k = torch.randn(2, 2, lk, 4, dtype=torch.float64, generator=g)
        v = torch.randn(2, 2, lk, 3, dtype=torch.float64, generator=g)
        mask = (torch.rand(lq, lk, generator=g) < 0.8) if case == 2 else None
        with tplayers.count_collectives() as log:
            partial = check_against_serial(
                rank,
                q,
                k,
                v,
                qpos,
                [None] * world,
                kv_sharded=False,
                mesh=mesh,
                attn_mask=mask,
                pass_positions=True,
                seed=case,
            )
        assert log.count() == 0 and log.bytes() == 0, log.summary()
        dk, dv, dk_ref, dv_ref = partial
        for mine, ref in ((dk, dk_ref), (dv, dv_ref)):  # partial sums: their sum over ranks is the serial grad
            total = mine.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, ref, rtol=1e-10, atol=1e-10)
    return True


def test_replicated_kv_moves_nothing_and_grads_sum_to_serial():
    assert all(run_ranks(_replicated_kv, 3, args=(2,), timeout=60))


def _chunked(rank, world, seed):
    from tplayers.attention import blocks as attention_blocks

    attention_blocks.FUSED_CPU = False  # the torch-ops kernel for every block
    attention_blocks.SCORE_CHUNK_BYTES = 2 * 3 * 8 * 3  # a few keys per chunk: every block is split
    _random_cases(rank, world, seed, "ring")
    _mask_cases(rank, world, seed)
    _causal_cases(rank, world, seed, "ring")
    _dropout_cases(rank, world, seed)
    _gqa_cases(rank, world, seed)
    return True


def test_torch_ops_kernel_with_blocks_split_into_key_chunks():
    assert all(run_ranks(_chunked, 3, args=(4,), timeout=90))
