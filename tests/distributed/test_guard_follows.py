"""The guard follows the data, not the call (issue 33 item 1): sharded data is exact or refused on every
rank wherever it goes, against the serial model in fp64 (outputs, input gradients, every parameter
gradient, after an SGD step and on a second input).

- a model method other than ``forward``: diffusers' ``AutoencoderKL.decode`` / ``.encode`` under
  ``{"": DomainParallel}`` at 2 ranks (H) and 4 ranks (2x2), and a plain model's ``decode`` whose own code
  takes a spatial mean of a twin's output (the output leaves the member's call as a ``DomainTensor``);
- a plan matching leaf modules and containers on a ResNet (the model around them is a region too);
- a module outside the region fed sharded data (``{"decoder": DomainParallel}`` with the VAE's
  ``post_quant_conv`` outside it: its weight gradient summed over the ranks);
- refusals on every rank within seconds: an op no rule proves exact applied by a method to a member's
  output, a 3x3 convolution outside the region fed sharded data.
"""

import copy
import os
import time

import pytest
import torch
from torch import nn

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

from harness import run_ranks  # noqa: E402
from hf_util import require  # noqa: E402 - sets HF_HUB_OFFLINE

import tplayers  # noqa: E402
from tplayers.domain.tensor import DomainTensor  # noqa: E402

TIGHT = dict(rtol=1e-9, atol=1e-11)
SECONDS = 30


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=2,
        out_channels=2,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        latent_channels=2,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=16,
    ).double()


class Net(nn.Module):
    """``decode``: twins, then the method's own spatial mean of their output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.decode(x)

    def decode(self, x):
        h = self.norm(self.conv(x))  # the norm twin takes (and saves for backward) a DomainTensor
        return h - h.mean(dim=(2, 3), keepdim=True)

    def flipped(self, x):  # torch.flip along a sharded dim: no rule proves it exact
        return torch.flip(self.conv(x), dims=(2,))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.bn1(self.conv1(x)))))


class ResNet(nn.Module):
    """torchvision's ResNet layout: stem leaves, residual stages, pooled head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1, self.layer2 = Block(4), Block(4)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 3)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.layer2(self.layer1(x))), 1))


class Outside(nn.Module):
    """A 3x3 convolution outside the region, fed the region's sharded input by a method (its F.conv2d
    is routed to the window core by the watching guard: exact)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Conv2d(2, 2, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())

    def forward(self, x):
        return self.body(self.pre(x))


class OutsideTransposed(Outside):
    """A 3x3 transposed convolution outside the region: refused (no functional route)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.ConvTranspose2d(2, 2, 3, padding=1)


CASES = {
    # name: (build, plan key, call, input shape (N, C, H, W))
    "vae_decode": (_vae, "", lambda m, x: m.decode(x).sample, (1, 2, 7, 6)),
    "vae_encode": (_vae, "", lambda m, x: m.encode(x).latent_dist.mode(), (1, 2, 14, 12)),
    "vae_outside": (_vae, "decoder", lambda m, x: m.decode(x).sample, (1, 2, 7, 6)),
    "method": (Net, "", lambda m, x: m.decode(x), (2, 2, 9, 7)),
    "resnet_leaves": (ResNet, "conv1|bn1|maxpool|layer[1-2]|avgpool", lambda m, x: m(x), (2, 2, 18, 14)),
    "outside_conv": (Outside, "body", lambda m, x: m(x), (2, 2, 9, 5)),
}


def _mesh(world):
    if world == 4:
        return tplayers.init_mesh((2, 2), ("h", "w"), device_type="cpu"), (2, 3)
    return tplayers.default_mesh(), (2,)


def _exact(rank, world, case):
    build, key, call, shape = CASES[case]
    mesh, dims = _mesh(world)
    if case.startswith("vae"):
        require("diffusers")
    serial = build().double()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {key: tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(par.parameters(), lr=0.1)
    dim = dims if len(dims) > 1 else dims[0]
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        xs = x.clone().requires_grad_()
        xl = tplayers.shard(x, dim, mesh).clone().requires_grad_()
        ref, out = call(serial, xs), call(par, xl)
        if ref.dim() == 4:
            if case != "outside_conv":  # (the root's own call returns its plain slice)
                assert isinstance(out, DomainTensor), type(out)  # left the member's call: its ops stay guarded
            got = tplayers.gather(out, dim, mesh)
        else:
            got = out
        torch.testing.assert_close(got, ref, **TIGHT)
        w = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
        (ref * w).sum().backward()
        (got * w).sum().backward()
        torch.testing.assert_close(xl.grad, tplayers.shard(xs.grad, dim, mesh), **TIGHT)
        ps, pp = dict(serial.named_parameters()), dict(par.named_parameters())
        assert set(ps) == set(pp)
        for name, p in ps.items():
            torch.testing.assert_close(pp[name].grad, p.grad, **TIGHT, msg=lambda m: f"{case} {name}: {m}")
        for name, b in serial.named_buffers():  # BatchNorm running statistics
            torch.testing.assert_close(dict(par.named_buffers())[name], b, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
    return True


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_data_is_exact_wherever_it_goes(case, world):
    assert all(run_ranks(_exact, world, args=(case,), timeout=120))


def _refused(rank, world, case):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    if case == "flip":
        par = tplayers.parallelize_module(Net().double(), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
        call = par.flipped
    else:  # a 3x3 transposed convolution outside the region ("body"), fed sharded data by the model around it
        par = tplayers.parallelize_module(
            OutsideTransposed().double(), {"body": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
        )
        call = par
    x = tplayers.shard(torch.randn(1, 2, 9, 5, dtype=torch.float64), 2, mesh)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        call(x)
    assert time.monotonic() - start < SECONDS
    return str(info.value)


@pytest.mark.parametrize("case,words", [("flip", ["flip", "sharded"]), ("outside_conv", ["conv_transpose2d", "pre"])])
def test_ops_outside_the_region_call_are_refused_on_every_rank(case, words):
    for msg in run_ranks(_refused, 3, args=(case,), timeout=60):
        for w in words:
            assert w in msg, msg
