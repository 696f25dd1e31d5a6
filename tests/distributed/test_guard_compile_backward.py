"""Compile, hand-written backward passes, double backward and reparametrized weights under the region
guard (issue 33 item 5): exact, or a clear error on every rank.

- ``torch.compile`` (aot_eager): a region the guard must check (functional means and interpolation,
  diffusers' ``UNet2DModel`` with attention) or never ran eagerly is refused at trace time with a
  ``ValueError`` on every rank (``fullgraph=True``: Dynamo's error carries the reason);
- a custom ``torch.autograd.Function`` applied to sharded data inside a region: ``ValueError`` on every rank
  (its backward would run outside the guard);
- an R1 gradient penalty (double backward) through a domain-parallel discriminator whose convolutions are
  spectral-normed and weight-normed (hook and parametrization forms): exact in fp64 against the serial
  model over two SGD steps (outputs, penalties, every parameter, the power-iteration buffers), and a clear
  error through a twin without a second derivative (GroupNorm);
- ``tplayers.shard`` hands out a dense slice (``.view`` works on it).
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

from harness import run_ranks  # noqa: E402
from hf_util import require  # noqa: E402

import tplayers  # noqa: E402

TIGHT = dict(rtol=1e-9, atol=1e-12)


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h = self.c1(x)
        h = F.interpolate(h - h.mean(dim=(2, 3), keepdim=True), scale_factor=2, mode="bilinear")
        return self.c2(h)


def _unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8,
        in_channels=2,
        out_channels=2,
        layers_per_block=1,
        block_out_channels=(8, 8),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        attention_head_dim=4,
    ).double()


def _compiled(rank, world, kind, warm, fullgraph):
    import torch._dynamo as dynamo

    dynamo.reset()
    torch.manual_seed(0)
    if kind == "unet":
        require("diffusers")
        model, shape, call = _unet(), (1, 2, 8, 8), lambda m, x: m(x, 3).sample
    else:
        model, shape, call = Functional().double(), (1, 2, 9, 6), lambda m, x: m(x)
    par = tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = tplayers.shard(torch.randn(shape, dtype=torch.float64), 2)
    if warm:
        call(par, x)  # the eager call routes ops through the guard
    compiled = torch.compile(par, backend="aot_eager", fullgraph=fullgraph)
    with pytest.raises(Exception) as info:
        call(compiled, x)
    return type(info.value).__name__, str(info.value)


@pytest.mark.parametrize(
    "kind,warm,fullgraph,expect",
    [
        ("functional", False, False, "run one eager call of the model first"),
        ("functional", True, False, "route ops through the region guard"),
        ("functional", True, True, "route ops through the region guard"),
        ("unet", True, False, "route ops through the region guard"),
    ],
)
def test_compile_of_a_region_the_guard_must_check_is_refused_at_trace_time(kind, warm, fullgraph, expect):
    for name, msg in run_ranks(_compiled, 2, args=(kind, warm, fullgraph), timeout=240):
        assert expect in msg, msg
        assert fullgraph or name == "ValueError", (name, msg)


class MeanGrad(torch.autograd.Function):
    """A hand-written backward taking a spatial mean: local on each rank's slice if it ran."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(dim=(2, 3), keepdim=True)


class WithFunction(nn.Module):
    def __init__(self, last):
        super().__init__()
        self.conv, self.last = nn.Conv2d(2, 2, 3, padding=1), last

    def forward(self, x):
        h = MeanGrad.apply(self.conv(x))
        return h if self.last else torch.relu(h)


def _custom_function(rank, world, last):
    par = tplayers.parallelize_module(WithFunction(last).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = tplayers.shard(torch.randn(1, 2, 9, 5, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="custom torch.autograd.Function \\(MeanGrad\\)"):
        par(x)
    with torch.no_grad():  # no backward will run: nothing to refuse
        par(x)
    return True


@pytest.mark.parametrize("last", [False, True])
def test_custom_autograd_function_on_sharded_data_is_refused(last):
    assert all(run_ranks(_custom_function, 2, args=(last,), timeout=60))


def _discriminator(form, norm=False):
    torch.manual_seed(0)
    c1, c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, stride=2, padding=1)
    if form == "hook":
        c1, c2 = nn.utils.spectral_norm(c1), nn.utils.weight_norm(c2)
    elif form == "parametrization":
        c1 = nn.utils.parametrizations.spectral_norm(c1)
        c2 = nn.utils.parametrizations.weight_norm(c2)
    mid = nn.GroupNorm(2, 4) if norm else nn.Tanh()
    return nn.Sequential(
        c1, nn.LeakyReLU(0.2), c2, mid, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 1)
    ).double()


def _r1(rank, world, form):
    mesh, dims = (tplayers.init_mesh((2, 2), ("h", "w"), device_type="cpu"), (2, 3)) if world == 4 else (None, (2,))
    dim = dims if len(dims) > 1 else dims[0]
    serial = _discriminator(form)
    par = tplayers.parallelize_module(_discriminator(form), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh)
    assert list(par.state_dict()) == list(serial.state_dict())
    opt_s, opt_p = torch.optim.SGD(serial.parameters(), lr=0.1), torch.optim.SGD(par.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(2, 2, 10, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        xs, xl = x.clone().requires_grad_(), tplayers.shard(x, dim, mesh).clone().requires_grad_()
        losses = []
        for model, inp in ((serial, xs), (par, xl)):
            logits = model(inp).sum()
            (g,) = torch.autograd.grad(logits, inp, create_graph=True)  # R1: |d D(x) / dx|^2
            penalty = g.square().sum() if model is serial else tplayers.domain_sum(g.square(), mesh)
            (logits + 10 * penalty).backward()
            losses.append((logits.detach(), penalty.detach()))
        torch.testing.assert_close(losses[1], losses[0], **TIGHT)
        ps = dict(serial.named_parameters())
        for name, p in par.named_parameters():
            torch.testing.assert_close(p.grad, ps[name].grad, **TIGHT, msg=lambda m: f"{form} {name}: {m}")
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
    for (name, a), b in zip(par.state_dict().items(), serial.state_dict().values()):  # weights, u / v
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m: f"{form} {name}: {m}")
    return True


@pytest.mark.parametrize("form,world", [("plain", 2), ("hook", 2), ("parametrization", 2), ("parametrization", 4)])
def test_r1_gradient_penalty_through_a_spectral_normed_discriminator_is_exact(form, world):
    assert all(run_ranks(_r1, world, args=(form,), timeout=120))


def _r1_groupnorm(rank, world):
    par = tplayers.parallelize_module(
        _discriminator("plain", norm=True), {"": tplayers.DomainParallel(shard_dims=(2,))}
    )
    x = tplayers.shard(torch.randn(2, 2, 10, 7, dtype=torch.float64), 2).requires_grad_()
    (g,) = torch.autograd.grad(par(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        tplayers.domain_sum(g.square()).backward()
    return True


def test_double_backward_through_a_twin_without_second_derivative_raises():
    assert all(run_ranks(_r1_groupnorm, 2, timeout=60))


def _dense_shard(rank, world):
    full = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    h, w = tplayers.shard(full, 2), tplayers.shard(full, 3)
    assert h.is_contiguous() and w.is_contiguous()
    h.view(2, 3, -1), w.view(2, 3, -1)
    cl = tplayers.shard(full.to(memory_format=torch.channels_last), 3)
    assert cl.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(tplayers.gather(w, 3), full)
    return True


def test_shards_are_dense():
    assert all(run_ranks(_dense_shard, 2, timeout=30))
