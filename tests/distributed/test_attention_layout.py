"""Attention over sharded tokens: token_positions on 1-D / 2-D meshes (W- and HxW-sharded images,
causal over the strided order), bytes moved against the minimum, peak memory, and every raise."""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from attention_cases import check_against_serial
from harness import run_ranks
from memory_probe import peak_bytes
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend, sdpa_kernel

import tplayers
from tplayers.functional import scaled_dot_product_attention, token_positions


def _image_positions(rank, world, h, w, mesh_shape, mesh_dims):
    """Positions of this rank's pixels of an (h, w) image, from token_positions and by hand."""
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coord = mesh.get_coordinate()
    slices = []
    for size, d in zip((h, w), mesh_dims):
        if d is None:
            slices.append(slice(0, size))
        else:
            start, stop = tplayers.shard_range(size, mesh_shape[d], coord[d])
            slices.append(slice(start, stop))
    local = (slices[0].stop - slices[0].start, slices[1].stop - slices[1].start)
    pos, total = token_positions(local, mesh_dims, mesh)
    expect = torch.arange(h * w).view(h, w)[slices[0], slices[1]].reshape(-1)
    assert total == h * w and torch.equal(pos, expect), (pos, expect)
    return mesh, pos


def _strided_causal(rank, world, seed):
    rng = random.Random(seed)
    layouts = [((2, 2), (0, 1)), ((4,), (None, 0)), ((4,), (0, None)), ((2, 2), (1, 0))]
    for case, (mesh_shape, mesh_dims) in enumerate(layouts):
        h, w = rng.randint(2, 6), rng.randint(4, 7)
        mesh, pos = _image_positions(rank, world, h, w, mesh_shape, mesh_dims)
        allpos = [torch.empty(0)] * world
        dist.all_gather_object(allpos, pos)
        order = [int(r) for r in mesh.mesh.flatten().tolist()]
        flat_pos = [allpos[r] for r in order]  # flattened mesh order
        me = order.index(rank)
        g = torch.Generator().manual_seed(seed + case)
        q = torch.randn(2, 2, h * w, 4, dtype=torch.float64, generator=g)
        k = torch.randn(2, 2, h * w, 4, dtype=torch.float64, generator=g)
        v = torch.randn(2, 2, h * w, 4 if case % 2 else 3, dtype=torch.float64, generator=g)
        for algorithm in ("ring", "all_gather"):
            check_against_serial(
                me, q, k, v, flat_pos, flat_pos, is_causal=True, mesh=mesh, algorithm=algorithm, seed=case
            )
    return True


def test_token_positions_and_causal_over_w_and_hxw_sharded_images():
    assert all(run_ranks(_strided_causal, 4, args=(3,), timeout=90))


def _bytes(rank, world):
    mesh = tplayers.default_mesh()
    sizes = [5, 0, 3][:world] if world == 3 else [3, 6]
    q = torch.randn(2, 2, sizes[rank], 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, sizes[rank], 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, sizes[rank], 3, dtype=torch.float64, requires_grad=True)
    kv_bytes = [2 * 1 * s * (4 + 3) * 8 for s in sizes]  # one rank's K and V (fp64)
    minimum = sum(kv_bytes) - kv_bytes[rank]  # every other rank's K and V, once
    with tplayers.count_collectives() as fwd:
        out = scaled_dot_product_attention(q, k, v, enable_gqa=True, mesh=mesh, algorithm="ring")
    recv = [r for r in fwd.records if r.kind == "recv"]
    assert sum(r.nbytes for r in recv) == minimum, (fwd.summary(), minimum)
    assert sum(r.nbytes for r in fwd.records if r.kind == "send") == sum(kv_bytes) - kv_bytes[(rank + 1) % world]
    assert [r.tag for r in fwd.records if r.kind == "all_gather"] == ["attention.meta"]
    with tplayers.count_collectives() as bwd:
        out.square().sum().backward()
    kv_again = sum(r.nbytes for r in bwd.records if r.kind == "recv" and r.tag == "attention.ring.bwd")
    grads_sent = sum(r.nbytes for r in bwd.records if r.kind == "send" and r.tag == "attention.ring.bwd.grads")
    assert kv_again == minimum  # the ring again, K/V once each
    assert grads_sent == sum(kv_bytes) - kv_bytes[rank]  # partial dK/dV of every other block, once
    assert {r.kind for r in bwd.records} == {"send", "recv"}
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_ring_moves_the_minimum_bytes(world):
    assert all(run_ranks(_bytes, world, timeout=60))


def _memory(rank, world, fused):
    from tplayers.attention import blocks as attention_blocks

    attention_blocks.FUSED_CPU = fused
    mesh = tplayers.default_mesh()
    length, e = 1024, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, length, e, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    cot = torch.randn(1, 1, length, e, dtype=torch.float64, generator=g)

    def serial():
        with sdpa_kernel(SDPBackend.MATH):  # the serial attention that materialises its scores
            F.scaled_dot_product_attention(q, k, v).backward(cot)

    start, stop = tplayers.shard_range(length, world, rank)
    ql, kl, vl = (t.detach()[..., start:stop, :].clone().requires_grad_() for t in (q, k, v))

    def distributed():
        scaled_dot_product_attention(ql, kl, vl, mesh=mesh).backward(cot[..., start:stop, :])

    serial_peak, dist_peak = peak_bytes(serial), peak_bytes(distributed)
    block = 2 * (stop - start) * e * 8  # one rank's K and V block
    assert dist_peak <= serial_peak / 2 + block, (dist_peak, serial_peak, block)
    return dist_peak, serial_peak


@pytest.mark.parametrize("fused", [True, False])
def test_peak_memory_at_most_half_the_serial_plus_one_block(fused):
    peaks = run_ranks(_memory, 2, args=(fused,), timeout=90)
    assert all(d < s for d, s in peaks)


def _expect_raise(fn, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        fn()


def _raises(rank, world):
    mesh = tplayers.default_mesh()
    sdpa = scaled_dot_product_attention
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    # only one rank is wrong, every rank raises before any K/V moves
    bad_e = torch.randn(1, 2, 3, 5 if rank == 1 else 4, dtype=torch.float64)
    _expect_raise(lambda: sdpa(bad_e, bad_e, bad_e, mesh=mesh), "disagree on query")
    bad_v = torch.randn(1, 2, 2 if rank == 0 else 3, 4, dtype=torch.float64)
    _expect_raise(
        lambda: sdpa(q, k, bad_v, mesh=mesh),
        "key and value must hold the same tokens" if rank == 0 else r"invalid arguments on ranks \[0\]",
    )
    mask = torch.ones(3, 6 if rank else 7, dtype=torch.bool)
    _expect_raise(lambda: sdpa(q, k, k, attn_mask=mask, mesh=mesh), "last dim must span the global keys")
    mask_rows = torch.ones(2 if rank == 1 else 3, 3 * world, dtype=torch.bool)
    _expect_raise(
        lambda: sdpa(q, k, k, attn_mask=mask_rows, mesh=mesh),
        "attn_mask must be broadcastable" if rank == 1 else r"invalid arguments on ranks \[1\]",
    )
    qpos = torch.arange(3) + (100 if rank == 0 else 3 * rank)
    _expect_raise(
        lambda: sdpa(q, k, k, is_causal=True, q_positions=qpos, kv_positions=torch.arange(3) + 3 * rank, mesh=mesh),
        "q_positions must lie in",
    )
    _expect_raise(
        lambda: sdpa(q, k, k, is_causal=True, kv_positions=torch.arange(3), mesh=mesh),
        "kv_positions over all ranks must be a permutation",
    )
    _expect_raise(
        lambda: sdpa(q, k, k, is_causal=True, kv_positions=torch.tensor([0, 0, 1]) + 3 * rank, mesh=mesh),
        "kv_positions repeats",
    )
    _expect_raise(
        lambda: sdpa(q, k, k, is_causal=True, kv_positions=torch.arange(3.0), mesh=mesh),
        "kv_positions must be a 1-D int64",
    )  # (every rank: each names its own error)
    _expect_raise(
        lambda: sdpa(q, k, k, mesh=mesh, kv_positions=torch.arange(3), kv_sharded=False),
        "kv_positions is for sharded keys",
    )
    _expect_raise(
        lambda: sdpa(q, k, k, is_causal=True, q_positions=torch.arange(3) if rank else None, mesh=mesh),
        "disagree on q_positions",
    )
    # the same outcome on every rank without any exchange
    _expect_raise(
        lambda: sdpa(q, k, k, attn_mask=torch.ones(3, 3 * world, dtype=torch.bool), is_causal=True, mesh=mesh),
        "attn_mask must be None when is_causal",
    )
    _expect_raise(lambda: sdpa(q, k, k, dropout_p=1.5, mesh=mesh), "dropout_p must be a probability")
    _expect_raise(lambda: sdpa(q, k, k, algorithm="tree", mesh=mesh), "algorithm must be one of")
    _expect_raise(
        lambda: sdpa(q, k, k, attn_mask=torch.zeros(3, 3 * world, requires_grad=True, dtype=torch.float64), mesh=mesh),
        "requires_grad is unsupported",
    )
    _expect_raise(lambda: sdpa(q, [1], k, mesh=mesh), "key must be a torch.Tensor", TypeError)
    _expect_raise(lambda: sdpa(q, k, k, mesh="mesh"), "DeviceMesh", TypeError)
    _expect_raise(lambda: token_positions((3, 4), (0,), mesh), "one entry per factor")
    _expect_raise(lambda: token_positions((3, 4), (0, 0), mesh), "distinct mesh dims")
    _expect_raise(lambda: token_positions((3, 4 + rank), (0, None), mesh), "every rank must hold the same size")
    # the group is still healthy: nothing is left half-exchanged
    out = sdpa(q, k, k, mesh=mesh)
    assert out.shape == (1, 2, 3, 4)
    return True


def test_every_raise_on_every_rank():
    assert all(run_ranks(_raises, 3, timeout=60))
