"""Real packages' CNNs under ``{"": DomainParallel(shard_dims=(2,))}``, against the serial model in fp64:
diffusers' ``UNet2DModel`` without attention (GroupNorm, SiLU, strided-conv downsampling, nearest
upsampling, skips, a timestep embedding) and MONAI's 3-D ``UNet`` (residual units, InstanceNorm3d,
PReLU, ConvTranspose3d) sharded along D. Outputs, input gradients, every parameter gradient, after an
SGD step with momentum and on a second input; both again with every convolution on the main-plus-strips
path. Small and self-contained (re-run after a region-guard change).
"""

import copy
import os

import pytest
import torch

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

from harness import run_ranks  # noqa: E402
from hf_util import require  # noqa: E402 - sets HF_HUB_OFFLINE
from oracle import assert_params_match, edge_convs  # noqa: E402

import tplayers  # noqa: E402
import tplayers.layers.conv as conv_module  # noqa: E402

TIGHT = dict(rtol=1e-9, atol=1e-10)
PLAN = {"": tplayers.DomainParallel(shard_dims=(2,))}


def _diffusers_unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=16,
        in_channels=2,
        out_channels=2,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        add_attention=False,
        norm_num_groups=4,
    ).double()


def _monai_unet():
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,), num_res_units=1).double()


BUILD = {"diffusers": (_diffusers_unet, lambda m, x, t: m(x, t).sample), "monai": (_monai_unet, lambda m, x, t: m(x))}


def _compare(rank, world, kind, shape, edges=False):
    if edges:  # every slab takes the convolutions' main-plus-strips strategy (tplayers.layers._conv_fn)
        conv_module.EDGE_MIN_ELEMENTS = 0
    mesh = tplayers.default_mesh()
    build, call = BUILD[kind]
    serial = build()
    model = tplayers.parallelize_module(copy.deepcopy(serial), PLAN, mesh=mesh)
    assert any(type(m).__name__.startswith("Distributed") for m in model.modules())
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        t = torch.tensor([3, 7][: shape[0]])
        xs = x.clone().requires_grad_(True)
        xp = tplayers.shard(x, 2, mesh).clone().requires_grad_(True)
        ys = call(serial, xs, t)
        yg = tplayers.gather(call(model, xp, t), 2, mesh)
        torch.testing.assert_close(yg, ys, **TIGHT, msg=lambda m: f"{kind} step {step}: {m}")
        cot = torch.randn(ys.shape, dtype=ys.dtype, generator=gen)
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(xp.grad, 2, mesh), xs.grad, **TIGHT)
        assert_params_match(model, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(model, serial, grads=False, **TIGHT)
    assert (edge_convs(model) > 0) == edges, edge_convs(model)
    return True


@pytest.mark.parametrize("world,shape", [(2, (2, 2, 16, 8)), (3, (1, 2, 12, 8))])
def test_diffusers_unet2d_without_attention(world, shape):
    require("diffusers")
    run_ranks(_compare, world, args=("diffusers", shape), timeout=180)


@pytest.mark.parametrize("world,shape", [(2, (1, 1, 8, 6, 6))])
def test_monai_unet_3d(world, shape):
    require("monai")
    run_ranks(_compare, world, args=("monai", shape), timeout=180)


@pytest.mark.parametrize(
    "kind,world,shape",
    [("diffusers", 2, (2, 2, 16, 8)), ("diffusers", 3, (1, 2, 12, 8)), ("monai", 2, (1, 1, 8, 6, 6))],
)
def test_whole_models_on_the_edge_path(kind, world, shape):
    """The same models with every convolution slab on the main-plus-strips path."""
    require(kind)
    run_ranks(_compare, world, args=(kind, shape), kwargs=dict(edges=True), timeout=180)
