"""tplayers.na2d against a brute-force NATTEN-rule oracle (and natten itself when installed)."""

import random
import warnings

import pytest
import torch
from na_cases import na_on_subwindow
from na_oracle import assert_out_and_grads, brute_na2d, window_1d

import tplayers
from tplayers.ops.na_engine import neighborhood_attention
from tplayers.ops.na_layout import axis_tiles, key_span

TIGHT = dict(rtol=1e-10, atol=1e-12)
#: every test here runs on both na2d kernels: the compiled CPU one and the torch tile one
pytestmark = pytest.mark.usefixtures("na_kernel")


def _random_case(rng, max_extra=5):
    kernel = (rng.randint(1, 5), rng.randint(1, 5))
    dilation = (rng.randint(1, 3), rng.randint(1, 3))
    causal = (rng.random() < 0.3, rng.random() < 0.3)
    size = tuple(rng.randint(k * d, k * d + max_extra) for k, d in zip(kernel, dilation))
    return kernel, dilation, causal, size


def test_window_rule_hand_checked():
    # odd kernel: centred, shifted inside at both borders
    assert window_1d(0, 10, 3, 1, False) == [0, 1, 2]
    assert window_1d(5, 10, 3, 1, False) == [4, 5, 6]
    assert window_1d(9, 10, 3, 1, False) == [7, 8, 9]
    # even kernel: left = k//2 = 2, right = k//2 - 1 = 1
    assert window_1d(5, 10, 4, 1, False) == [3, 4, 5, 6]
    assert window_1d(9, 10, 4, 1, False) == [6, 7, 8, 9]
    # dilation 3 on length 10: groups {0,3,6,9}, {1,4,7}, {2,5,8}; rule inside each group
    assert window_1d(9, 10, 3, 3, False) == [3, 6, 9]
    assert window_1d(1, 10, 3, 3, False) == [1, 4, 7]
    assert window_1d(8, 10, 2, 3, False) == [5, 8]
    # causal: the k most recent in the group
    assert window_1d(1, 10, 3, 1, True) == [0, 1]
    assert window_1d(7, 10, 3, 2, True) == [3, 5, 7]
    # the layout module agrees
    assert key_span(9, 10, length=10, kernel=3, dilation=3, causal=False) == (3, 10)
    assert key_span(0, 2, length=10, kernel=4, dilation=1, causal=False) == (0, 4)


@pytest.mark.parametrize("seed", range(4))
def test_forward_and_backward_match_brute_force_fp64(seed):
    rng = random.Random(seed)
    for _ in range(6):
        kernel, dilation, causal, (h, w) = _random_case(rng)
        heads, dim = rng.randint(1, 3), rng.randint(1, 4)
        scale = rng.choice([None, 0.37])
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q, k, v = (torch.randn(2, h, w, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = tplayers.na2d(*ins, kernel, dilation, causal, scale)
        ref = brute_na2d(*ref_ins, kernel, dilation, causal, scale)
        torch.testing.assert_close(out, ref, **TIGHT)
        cot = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out * cot).sum().backward()
        (ref * cot).sum().backward()
        for name, a, b in zip("qkv", ins, ref_ins):
            torch.testing.assert_close(
                a.grad, b.grad, **TIGHT, msg=lambda m: f"d{name} {kernel} {dilation} {causal}: {m}"
            )


@pytest.mark.parametrize("seed", range(3))
def test_engine_tiles_offsets_and_rel_pos_bias(seed):
    """Any tile size; queries/keys as sub-windows of a larger image; the bias table."""
    rng = random.Random(100 + seed)
    for _ in range(6):
        kernel, dilation, causal, (h, w) = _random_case(rng)
        heads = rng.randint(1, 2)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q, k, v = (torch.randn(1, h, w, heads, 3, generator=gen, dtype=torch.float64) for _ in range(3))
        rpb = torch.randn(heads, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])
        # a query sub-window and the key span it needs
        q0, q1 = sorted(rng.sample(range(h + 1), 2))
        c0, c1 = sorted(rng.sample(range(w + 1), 2))
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = na_on_subwindow(
            ins, (h, w), kernel, dilation, causal, (q0, q1, c0, c1), tile=(rng.randint(1, 6), rng.randint(1, 6))
        )
        assert_out_and_grads(out, ref[:, q0:q1, c0:c1], ins, ref_in, gen, **TIGHT)


@pytest.mark.parametrize("seed", range(3))
def test_chunked_kernel_batches_padding_and_bias(seed):
    """The chunked tile kernel: chunks of one tile up to all tiles, chunks mixing window
    patterns, padding slots (tiles not dividing a dilation group), batch > 1, bias."""
    rng = random.Random(200 + seed)
    for _ in range(5):
        kernel, dilation, causal, (h, w) = _random_case(rng, max_extra=7)
        heads, batch = rng.randint(1, 3), rng.randint(1, 3)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        dim, dim_v = rng.randint(1, 4), rng.randint(1, 5)
        q, k = (torch.randn(batch, h, w, heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(batch, h, w, heads, dim_v, generator=gen, dtype=torch.float64)
        rpb = torch.randn(heads, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, rpb=ref_in[3])
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        tile = (rng.randint(1, 5), rng.randint(1, 5))
        out = neighborhood_attention(
            *ins[:3],
            kernel,
            dilation,
            causal,
            global_size=(h, w),
            rel_pos_bias=ins[3],
            tile=tile,
            chunk_scores=rng.choice([1, 40, 300, 1 << 20]),
        )
        torch.testing.assert_close(out, ref, **TIGHT)
        cot = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        (out * cot).sum().backward()
        (ref * cot).sum().backward()
        for name, a, b in zip(("q", "k", "v", "rpb"), ins, ref_in):
            torch.testing.assert_close(a.grad, b.grad, **TIGHT, msg=lambda m: f"d{name} {kernel} {dilation}: {m}")


def test_gradcheck_tiny(na_kernel):
    """Both kernels; the last two cases are wider than one 16-query block of the C kernel, and causal."""
    gen = torch.Generator().manual_seed(0)
    for kernel, dilation, causal, size in [
        ((3, 2), (1, 2), (False, False), (4, 5)),
        ((2, 3), (2, 1), (True, False), (5, 4)),
        ((3, 2), (1, 2), (False, True), (4, 19)),
        ((3, 3), (2, 1), (True, False), (7, 5)),
    ]:
        q, k, v = (
            torch.randn(1, *size, 2, 2, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)
        )
        rpb = torch.randn(
            2, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64, requires_grad=True
        )
        fn = lambda q, k, v, b: neighborhood_attention(  # noqa: E731
            q, k, v, kernel, dilation, causal, global_size=size, rel_pos_bias=b
        )
        assert torch.autograd.gradcheck(fn, (q, k, v, rpb))


def test_tile_tables_cover_every_query_once():
    rng = random.Random(7)
    for _ in range(30):
        kernel, dil, causal = rng.randint(1, 6), rng.randint(1, 4), rng.random() < 0.3
        length = rng.randint(kernel * dil, kernel * dil + 12)
        q0, q1 = sorted(rng.sample(range(length + 1), 2))
        k0, k1 = key_span(q0, q1, length=length, kernel=kernel, dilation=dil, causal=causal)
        t = axis_tiles(length, kernel, dil, causal, q0, q1 - q0, k0, k1 - k0, rng.randint(1, 8))
        # each query is computed in exactly the slot out_pos names, and that slot holds it
        assert torch.equal(t.q_index.flatten()[t.out_pos], torch.arange(q1 - q0))
        for slot, local in zip(t.out_pos.tolist(), range(q1 - q0)):
            tile, m = divmod(slot, t.tile)
            keys = (t.k_index[tile][t.mask[tile, m]] + k0).tolist()
            assert keys == window_1d(q0 + local, length, kernel, dil, causal)


def test_errors_name_the_argument():
    x = torch.randn(1, 6, 6, 1, 4)
    with pytest.raises(ValueError, match="kernel_size"):
        tplayers.na2d(x, x, x, 0)
    with pytest.raises(ValueError, match="along W"):
        tplayers.na2d(x, x, x, (3, 4), dilation=(1, 2))
    with pytest.raises(ValueError, match="is_causal"):
        tplayers.na2d(x, x, x, 3, is_causal=1)
    with pytest.raises(ValueError, match=r"\(B, H, W, heads, head_dim\)"):
        tplayers.na2d(x[0], x[0], x[0], 3)


def test_memory_bounded_far_below_dense_96x96():
    from memory_probe import peak_bytes

    b, heads, dim, kernel = 1, 2, 16, 7
    q, k, v = (torch.randn(b, 96, 96, heads, dim) for _ in range(3))
    dense = b * heads * (96 * 96) ** 2 * 4  # one fp32 attention matrix
    bound = b * heads * 96 * 96 * kernel**2 * 4  # B*heads*H*W*k^2 fp32 scores
    cold = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))  # builds the cached window mask too
    warm = peak_bytes(lambda: tplayers.na2d(q, k, v, kernel))
    qg = q.clone().requires_grad_()
    train = peak_bytes(lambda: tplayers.na2d(qg, k, v, kernel).sum().backward())
    # the issue-13 target: <= 4x the bound (measured 0.8x / 0.6x / 2.1x: nothing score-sized is kept)
    assert warm < 4 * bound and cold < 4 * bound, (warm, cold, bound)
    assert train < 4 * bound, (train, bound)
    assert max(cold, warm, train) < dense / 12, (cold, warm, train, dense)


def test_matches_natten():
    import natten  # the test extra installs it (natten>=0.21): a missing one fails, never skips

    rng = random.Random(3)
    checked = 0
    for _ in range(10):
        kernel = (rng.randint(2, 6), rng.randint(2, 6))
        dilation = (rng.randint(1, 3), rng.randint(1, 3))
        causal = (rng.random() < 0.3, rng.random() < 0.3)
        h, w = rng.choice([(16, 16), (8, 32), (12, 32), (16, 24)])
        if kernel[0] * dilation[0] > h or kernel[1] * dilation[1] > w:
            continue
        q, k, v = (torch.randn(1, h, w, 2, 8) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = natten.na2d(q, k, v, kernel_size=kernel, dilation=dilation, is_causal=causal)
        torch.testing.assert_close(tplayers.na2d(q, k, v, kernel, dilation, causal), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tplayers.na2d(q, k, v, kernel, dilation, causal, backend="natten"), ref)
        checked += 1
    assert checked >= 5


def test_backend_flag(monkeypatch):
    import tplayers.ops.na as na_module

    x = torch.randn(1, 6, 6, 1, 4)
    with pytest.raises(ValueError, match="backend"):
        tplayers.na2d(x, x, x, 3, backend="cuda")
    monkeypatch.setattr(na_module, "_natten", lambda: None)  # as if natten were not installed
    with pytest.raises(ImportError, match="pip install natten"):
        tplayers.na2d(x, x, x, 3, backend="natten")
