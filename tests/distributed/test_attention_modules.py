"""DistributedMultiheadAttention / ContextParallelAttention against nn.MultiheadAttention on the
gathered tokens: outputs, input and parameter gradients, after an optimizer step (fp64)."""

import copy
import random

import pytest
import torch
import torch.distributed as dist
from attention_cases import uneven_sizes
from harness import run_ranks
from torch import nn

import tplayers

TIGHT = dict(rtol=1e-10, atol=1e-10)


def _mine(x, sizes, rank, dim):
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank])


def _assert_param_grads(twin, serial):
    for (name, p), (_, s) in zip(twin.named_parameters(), serial.named_parameters()):
        torch.testing.assert_close(p.grad, s.grad, **TIGHT, msg=lambda m: f"{name}: {m}")


class PixelAttentionBlock(nn.Module):
    """A custom block: self-attention over the flattened pixels of (N, C, H, W), plus residual."""

    def __init__(self, channels, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)

    def forward(self, x, **kw):
        n, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (N, H*W, C)
        out, _ = self.attn(tokens, tokens, tokens, need_weights=False, **kw)
        return x + out.transpose(1, 2).reshape(n, c, h, w)


def _pixel_block(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(3):
        n, heads, hd = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 4)
        c, h, w = heads * hd, rng.randint(world, 7), rng.randint(1, 4)
        torch.manual_seed(seed + case)
        serial = PixelAttentionBlock(c, heads).double()
        twin = copy.deepcopy(serial)
        twin.attn = tplayers.DistributedMultiheadAttention.from_module(serial.attn, mesh=mesh)
        assert list(twin.state_dict()) == list(serial.state_dict())
        twin = copy.deepcopy(twin)  # shares the mesh, copies parameters
        assert twin.attn.mesh is mesh
        opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
        opt_t = torch.optim.SGD(twin.parameters(), lr=0.1)
        hs = uneven_sizes(rng, h, world)  # uneven H, zeros allowed
        for step in range(2):
            x = torch.randn(n, c, h, w, dtype=torch.float64)
            kpm = torch.rand(n, h * w) < 0.3 if step else None
            if kpm is not None:
                kpm[:, 0] = False  # every query keeps a key
            xs, xt = x.clone().requires_grad_(), _mine(x, hs, rank, 2).clone().requires_grad_()
            ys = serial(xs, key_padding_mask=kpm)
            yt = twin(xt, key_padding_mask=kpm)
            torch.testing.assert_close(yt, _mine(ys, hs, rank, 2), **TIGHT)
            cot = torch.randn(ys.shape, dtype=torch.float64)
            ys.backward(cot), yt.backward(_mine(cot, hs, rank, 2))
            torch.testing.assert_close(xt.grad, _mine(xs.grad, hs, rank, 2), **TIGHT)
            _assert_param_grads(twin, serial)
            opt_s.step(), opt_t.step(), opt_s.zero_grad(), opt_t.zero_grad()
            for p, s in zip(twin.parameters(), serial.parameters()):
                torch.testing.assert_close(p, s, **TIGHT)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_multihead_attention_over_pixels_uneven_h(world):
    assert all(run_ranks(_pixel_block, world, args=(world,), timeout=90))


def _sequence_first_cross(rank, world, seed):
    """batch_first=False, separate kdim/vdim, replicated text keys (no K/V traffic), dropout."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(seed)
    serial = nn.MultiheadAttention(6, 2, dropout=0.25, kdim=5, vdim=3).double()
    twin = tplayers.DistributedMultiheadAttention.from_module(serial, mesh=mesh, kv_sharded=False)
    assert list(twin.state_dict()) == list(serial.state_dict())
    sizes = [4, 1, 2][:world] if world == 3 else [4, 3]
    lq = sum(sizes)
    x = torch.randn(lq, 2, 6, dtype=torch.float64)
    text = torch.randn(5, 2, 5, dtype=torch.float64)  # replicated keys
    tv = torch.randn(5, 2, 3, dtype=torch.float64)
    for training in (False, True):
        serial.train(training), twin.train(training)
        xs, ts, vs = (t.clone().requires_grad_() for t in (x, text, tv))
        xt, tt, vt = (
            _mine(x, sizes, rank, 0).clone().requires_grad_(),
            text.clone().requires_grad_(),
            tv.clone().requires_grad_(),
        )
        torch.manual_seed(7)
        ys, _ = serial(xs, ts, vs, need_weights=False)
        torch.manual_seed(7)
        with tplayers.count_collectives() as log:
            yt, _ = twin(xt, tt, vt, need_weights=False, q_positions=torch.arange(sizes[rank]) + sum(sizes[:rank]))
        assert log.count() == (1 if training else 0), log.summary()  # dropout: the query lengths only
        torch.testing.assert_close(yt, _mine(ys, sizes, rank, 0), **TIGHT)
        ys.square().sum().backward(), yt.square().sum().backward()
        torch.testing.assert_close(xt.grad, _mine(xs.grad, sizes, rank, 0), **TIGHT)
        torch.testing.assert_close(tt.grad, ts.grad, **TIGHT)  # summed over ranks by the twin
        torch.testing.assert_close(vt.grad, vs.grad, **TIGHT)
        _assert_param_grads(twin, serial)
        serial.zero_grad(), twin.zero_grad()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_cross_attention_replicated_keys_sequence_first(world):
    assert all(run_ranks(_sequence_first_cross, world, args=(world,), timeout=90))


class CausalAudio(nn.Module):
    """Conv1d then causal self-attention over time (sequence-first MHA), a time-series model."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(2, c, 3, padding=1)
        self.attn = nn.MultiheadAttention(c, 2)

    def forward(self, x, mask):
        h = self.conv(x).permute(2, 0, 1)  # (L, N, C)
        out, _ = self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)
        return out


def _causal_audio(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(3)
    serial = CausalAudio(4).double()
    twin = copy.deepcopy(serial)
    twin.conv = tplayers.DistributedConv1d.from_module(serial.conv, mesh=mesh)
    twin.attn = tplayers.DistributedMultiheadAttention.from_module(serial.attn, mesh=mesh)
    length = 11
    sizes = tplayers.shard_sizes(length, world)
    x = torch.randn(2, 2, length, dtype=torch.float64)
    full_mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
    xs, xt = x.clone().requires_grad_(), _mine(x, sizes, rank, 2).clone().requires_grad_()
    ys = serial(xs, full_mask)
    yt = twin(xt, _mine(full_mask, sizes, rank, 0))  # the hint's rows; causality is global
    torch.testing.assert_close(yt, _mine(ys, sizes, rank, 0), **TIGHT)
    ys.square().sum().backward(), yt.square().sum().backward()
    torch.testing.assert_close(xt.grad, _mine(xs.grad, sizes, rank, 2), **TIGHT)
    _assert_param_grads(twin, serial)
    return True


def test_causal_attention_over_a_sharded_1d_sequence():
    assert all(run_ranks(_causal_audio, 3, timeout=60))


def _context_module(rank, world):
    mesh = tplayers.default_mesh()
    attn = tplayers.ContextParallelAttention(mesh=mesh, kv_sharded=False)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 3 * world, 4, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, k)
    ref.sum().backward()
    kl = k.detach().clone().requires_grad_()
    out = attn(q[..., 3 * rank : 3 * rank + 3, :], kl, kl)
    torch.testing.assert_close(out, ref[..., 3 * rank : 3 * rank + 3, :], **TIGHT)
    out.sum().backward()
    torch.testing.assert_close(kl.grad, k.grad, **TIGHT)  # summed over ranks
    return True


def test_context_parallel_attention_module_replicated_keys():
    assert all(run_ranks(_context_module, 2, timeout=60))


def _module_raises(rank, world):
    mesh = tplayers.default_mesh()
    twin = tplayers.DistributedMultiheadAttention(4, 2, mesh=mesh).double()
    x = torch.randn(3, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="must span the global keys"):  # one rank's mask is wrong
        twin(x, x, x, key_padding_mask=torch.zeros(1, 3 * world + rank, dtype=torch.bool))
    with pytest.raises(ValueError, match="add_bias_kv=True is unsupported"):
        tplayers.DistributedMultiheadAttention(4, 2, add_bias_kv=True, mesh=mesh)
    with pytest.raises(ValueError, match="add_zero_attn=True is unsupported"):
        tplayers.DistributedMultiheadAttention.from_module(nn.MultiheadAttention(4, 2, add_zero_attn=True), mesh=mesh)
    with pytest.raises(TypeError, match="expects an nn.MultiheadAttention"):
        tplayers.DistributedMultiheadAttention.from_module(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(ValueError, match="is_causal is a hint and needs attn_mask"):
        twin(x, x, x, need_weights=False, is_causal=True)
    from tplayers.functional import multi_head_attention_forward as mha

    w, b = twin.in_proj_weight, twin.in_proj_bias
    ow, ob = twin.out_proj.weight, twin.out_proj.bias
    with pytest.raises(ValueError, match="static_k/static_v is unsupported"):
        mha(x, x, x, 4, 2, w, b, None, None, False, 0.0, ow, ob, need_weights=False, static_k=x, mesh=mesh)
    with pytest.raises(ValueError, match="expected embed dim 8"):
        mha(x, x, x, 8, 2, w, b, None, None, False, 0.0, ow, ob, need_weights=False, mesh=mesh)
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        mha(
            x,
            x,
            x,
            4,
            2,
            w,
            b,
            None,
            None,
            False,
            0.0,
            ow,
            ob,
            need_weights=False,
            mesh=mesh,
            key_padding_mask=torch.zeros(3, 3 * world, dtype=torch.bool),
        )
    dist.barrier()
    return True


def test_module_raises_on_every_rank():
    assert all(run_ranks(_module_raises, 2, timeout=60))


def _weights(rank, world, seed):
    """need_weights=True (nn's default): this rank's rows of the weights, averaged or per head,
    differentiable, with masks, dropout and the causal hint; batch_first both ways."""
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(4):
        torch.manual_seed(seed + case)
        batch_first = case % 2 == 0
        serial = nn.MultiheadAttention(6, 2, dropout=0.2 if case == 1 else 0.0, batch_first=batch_first).double()
        twin = tplayers.DistributedMultiheadAttention.from_module(serial, mesh=mesh)
        length = rng.randint(world, 9)
        sizes = uneven_sizes(rng, length, world)
        seq = 1 if batch_first else 0
        x = torch.randn((2, length, 6) if batch_first else (length, 2, 6), dtype=torch.float64)
        kw, kw_local = {}, {}
        if case == 2:
            kw["key_padding_mask"] = kw_local["key_padding_mask"] = torch.rand(2, length) < 0.3
            kw["key_padding_mask"][:, 0] = False
        if case == 3:
            mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
            kw = dict(attn_mask=mask, is_causal=True)
            kw_local = dict(attn_mask=_mine(mask, sizes, rank, 0), is_causal=True)
        average = case != 1
        xs, xt = x.clone().requires_grad_(), _mine(x, sizes, rank, seq).clone().requires_grad_()
        torch.manual_seed(11)
        ys, ws = serial(xs, xs, xs, average_attn_weights=average, **kw)
        torch.manual_seed(11)
        yt, wt = twin(xt, xt, xt, average_attn_weights=average, **kw_local)
        torch.testing.assert_close(yt, _mine(ys, sizes, rank, seq), **TIGHT)
        torch.testing.assert_close(wt, _mine(ws, sizes, rank, -2), **TIGHT)
        (ys.square().sum() + ws.square().sum()).backward()
        (yt.square().sum() + wt.square().sum()).backward()
        torch.testing.assert_close(xt.grad, _mine(xs.grad, sizes, rank, seq), **TIGHT)
        _assert_param_grads(twin, serial)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_need_weights_rows_of_the_serial_weights(world):
    assert all(run_ranks(_weights, world, args=(world,), timeout=90))
