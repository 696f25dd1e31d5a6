"""copy_into: every stored-piece copy bit-exact on its fast paths (load and save directions)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tplayers.checkpoint import fastcopy
from tplayers.checkpoint.fastcopy import copy_into, moved_dim

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool,
          torch.complex64]


def _random_bits(shape, dtype, gen) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals), not just nice values."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().view(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).view(shape)
    if dtype.is_floating_point:  # make sure the edge patterns are there
        flat = t.view(-1)
        flat[0], flat[1] = -0.0, float("nan")
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.contiguous()


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _offset_copy(t: torch.Tensor, elems: int) -> torch.Tensor:
    """``t`` copied into a buffer at an element offset (storage not aligned to wider units when odd)."""
    flat = torch.empty(t.numel() + elems, dtype=t.dtype)
    out = flat[elems:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_direction_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    # (natural shape, shard dim): 2-D (Q == 1), 3-D with Q in {2, 3}, a conv weight (Q == 9), dim 2 of 4-D
    cases = [((70, 90), 1), ((33, 130, 2), 1), ((40, 101, 3), 1), ((16, 48, 3, 3), 1), ((4, 6, 60, 5), 2)]
    for (shape, d), offset, narrowed in itertools.product(cases, (0, 1), (False, True)):
        natural = _random_bits(shape, dtype, gen)
        stored = _offset_copy(natural.movedim(d, 0).contiguous(), offset)
        src = stored.movedim(0, d)
        assert moved_dim(src) == d
        if narrowed:  # the destination is a range of a larger tensor (a fused block, a resharded range)
            big_shape = list(shape)
            big_shape[d] += 7
            big = _random_bits(tuple(big_shape), dtype, gen)
            keep = big.clone()
            dst = big.narrow(d, 3, shape[d])
        else:
            big = dst = torch.zeros(shape, dtype=dtype)
            keep = None
        copy_into(dst, src, [None])
        assert _same(dst, natural), (shape, d, offset, narrowed)
        if keep is not None:  # nothing outside the range is touched
            expected = keep.clone()
            expected.narrow(d, 3, shape[d]).copy_(natural)
            assert _same(big, expected), (shape, d, offset)


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_direction_exact(dtype):
    gen = torch.Generator().manual_seed(1)
    cases = [((70, 90), 1), ((33, 130, 2), 1), ((40, 101, 3), 1), ((16, 48, 3, 3), 1), ((4, 6, 60, 5), 2)]
    for (shape, d), narrowed in itertools.product(cases, (False, True)):
        big_shape = list(shape)
        big_shape[d] += 9 if narrowed else 0
        whole = _random_bits(tuple(big_shape), dtype, gen)
        piece = whole.narrow(d, 5, shape[d]) if narrowed else whole
        src = piece.movedim(d, 0)  # what save stages: the shard dim first
        dst = _offset_copy(torch.zeros(src.shape, dtype=dtype), 1)  # contiguous, maybe misaligned
        copy_into(dst, src, [None])
        assert _same(dst, piece.movedim(d, 0).contiguous()), (shape, d, narrowed)


def test_fast_paths_are_taken(monkeypatch):
    """The 2-D transposes really go through the matrix view (not an elementwise fallback)."""
    calls = []
    real = fastcopy._as_matrix
    monkeypatch.setattr(fastcopy, "_as_matrix", lambda *a: calls.append(a[1:]) or real(*a))
    stored = torch.randn(300, 64)
    dst = torch.empty(64, 300)
    copy_into(dst, stored.movedim(0, 1))
    assert calls == [(300, 64, 1)] and torch.equal(dst, stored.t())
    calls.clear()
    w = torch.randn(64, 300, 2).to(torch.bfloat16)  # Q == 2 bf16 items: one int32 unit
    out = torch.empty(300, 64, 2, dtype=torch.bfloat16)
    copy_into(out, w.movedim(1, 0))
    assert calls == [(64, 300, 2)] and torch.equal(out, w.movedim(1, 0))


def test_plain_and_small_copies_unchanged():
    a = torch.randn(10, 10)
    b = torch.empty(10, 10)
    copy_into(b, a.t())  # below the size where torch's transpose path applies
    assert torch.equal(b, a.t())
    c = torch.randn(5000)
    e = torch.empty(5000)
    copy_into(e, c)
    assert torch.equal(e, c)
    f = torch.empty(100, 100, dtype=torch.float64)  # a cast falls back to copy_
    g = torch.randn(100, 100)
    copy_into(f, g.t())
    assert torch.equal(f, g.t().double())
