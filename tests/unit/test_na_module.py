"""NeighborhoodAttention (single device) and the per-rank halo layout, against brute force."""

import random

import pytest
import torch
from na_oracle import brute_na2d, window_1d

import tplayers
from tplayers.ops.na_layout import axis_halos

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _reference(layer, x):
    """The module's function spelled out with the brute-force oracle."""
    b, h, w, c = x.shape
    qkv = torch.nn.functional.linear(x, layer.qkv.weight, layer.qkv.bias).view(b, h, w, 3, layer.num_heads, -1)
    out = brute_na2d(
        qkv[:, :, :, 0],
        qkv[:, :, :, 1],
        qkv[:, :, :, 2],
        layer.kernel_size,
        layer.dilation,
        layer.is_causal,
        layer.scale,
        rpb=layer.rpb,
    )
    return layer.proj(out.reshape(b, h, w, c))


@pytest.mark.parametrize("seed", range(3))
def test_module_matches_brute_force_with_rel_pos_bias(seed, na_kernel):
    rng = random.Random(seed)
    for _ in range(3):
        kernel = (rng.randint(1, 4), rng.randint(1, 4))
        dilation = (rng.randint(1, 2), rng.randint(1, 2))
        causal = (rng.random() < 0.3, rng.random() < 0.3)
        heads = rng.randint(1, 3)
        torch.manual_seed(rng.randrange(1 << 30))
        layer = tplayers.NeighborhoodAttention(
            2 * heads,
            heads,
            kernel,
            dilation,
            causal,
            qk_scale=rng.choice([None, 0.5]),
            rel_pos_bias=True,
            dtype=torch.float64,
        )
        with torch.no_grad():
            layer.rpb.normal_()
        x = torch.randn(
            2,
            kernel[0] * dilation[0] + rng.randint(0, 3),
            kernel[1] * dilation[1] + rng.randint(0, 3),
            2 * heads,
            dtype=torch.float64,
        )
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = layer(xa), _reference(layer, xb)
        torch.testing.assert_close(out, ref, **TIGHT)
        grads = torch.autograd.grad((out * out.detach()).sum(), [xa] + list(layer.parameters()))
        ref_grads = torch.autograd.grad((ref * out.detach()).sum(), [xb] + list(layer.parameters()))
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, **TIGHT)


def test_module_shapes_params_and_errors():
    layer = tplayers.NeighborhoodAttention(16, 4, (3, 5), rel_pos_bias=True)
    assert layer.rpb.shape == (4, 5, 9)
    assert layer(torch.randn(2, 6, 7, 16)).shape == (2, 6, 7, 16)
    assert {n for n in layer.shard_specs()} == {n for n, _ in layer.named_parameters()}
    assert all(s.is_replicated for s in layer.shard_specs().values())
    assert tplayers.NeighborhoodAttention(16, 4, 3, qkv_bias=False).qkv.bias is None
    with pytest.raises(ValueError, match="divisible by num_heads"):
        tplayers.NeighborhoodAttention(10, 4, 3)
    with pytest.raises(ValueError, match="shard_dims"):
        tplayers.NeighborhoodAttention(8, 2, 3, shard_dims=(3,))
    with pytest.raises(ValueError, match=r"\(B, H, W, 16\)"):
        layer(torch.randn(2, 6, 7, 8))
    with pytest.raises(ValueError, match="along W"):
        layer(torch.randn(2, 6, 4, 16))


def test_axis_halos_from_global_positions():
    rng = random.Random(11)
    for _ in range(200):
        kernel, dil, causal = rng.randint(1, 6), rng.randint(1, 3), rng.random() < 0.3
        parts = rng.randint(1, 4)
        length = rng.randint(kernel * dil, kernel * dil + 10)
        cuts = sorted(rng.randint(0, length) for _ in range(parts - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [length])]
        # what each shard needs, straight from the rule
        need = []
        start = 0
        for size in sizes:
            keys = [p for i in range(start, start + size) for p in window_1d(i, length, kernel, dil, causal)]
            need.append((max(0, start - min(keys)), max(0, max(keys) + 1 - start - size)) if size else (0, 0))
            start += size
        feasible = all(
            (lo == 0 or (c > 0 and lo <= sizes[c - 1])) and (hi == 0 or (c < parts - 1 and hi <= sizes[c + 1]))
            for c, (lo, hi) in enumerate(need)
        )
        if not feasible:
            with pytest.raises(ValueError, match="halo"):
                axis_halos(sizes, kernel=kernel, dilation=dil, causal=causal)
            continue
        plans = axis_halos(sizes, kernel=kernel, dilation=dil, causal=causal)
        assert [p[1] for p in plans] == need
        for c, (_, _, send) in enumerate(plans):  # a send is the facing neighbour's recv
            assert send == (need[c - 1][1] if c else 0, need[c + 1][0] if c < parts - 1 else 0)
    # an edge shard reaches further than k // 2
    assert axis_halos([6, 2], kernel=5, dilation=1, causal=False)[1][1] == (3, 0)
    with pytest.raises(ValueError, match="global size"):
        axis_halos([2, 2], kernel=5, dilation=1, causal=False)
