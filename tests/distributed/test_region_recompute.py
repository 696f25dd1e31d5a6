"""Per-block activation checkpointing inside a ``DomainParallel`` region (issue 31 item 2): the packages'
own switches (diffusers ``enable_gradient_checkpointing()``, transformers-style ``use_reentrant=True``
through diffusers' ``gradient_checkpointing_func``) on a model sharded at its root. The recomputation
in backward re-enters the region's guard (tplayers.region.recompute), so it is exact: outputs, the
input gradient, every parameter gradient and the parameters after an optimizer step equal the serial
model's in fp64, for two steps, at 2 ranks and 2x2. Each case also checks that the checkpointed
blocks were recomputed in backward, under a guard; and a reentrant checkpoint whose module gets
tensors the checkpoint did not save raises ``ValueError`` on every rank.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

import tplayers
from tplayers.domain.active import active_guard

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
TIGHT = dict(rtol=1e-9, atol=1e-11)


def _mesh(world, mesh_shape):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    return mesh, [mesh.get_local_rank(i) for i in range(mesh.ndim)], tuple(range(2, 2 + mesh.ndim))


def _unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=16,
        in_channels=2,
        out_channels=2,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        attention_head_dim=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    ).double()


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


def _segformer():
    from transformers import SegformerConfig, SegformerModel

    torch.manual_seed(0)
    config = SegformerConfig(
        num_channels=2,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        drop_path_rate=0.0,
    )
    return SegformerModel(config).double()


def _diffusers_switch(model, reentrant):
    model.enable_gradient_checkpointing(_reentrant if reentrant else None)


def _transformers_switch(model, reentrant):
    # transformers' GradientCheckpointingLayer checkpoints its forward body from inside its call:
    # tplayers.region_context_fn re-guards the whole recomputed body (use_reentrant=False only)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": tplayers.region_context_fn}
    )


MODELS = {
    # name: (build, call, the package's switch, a checkpointed block to watch)
    "unet": (
        _unet,
        lambda m, x, step: m(x, torch.tensor([3 + step, 17])).sample,
        _diffusers_switch,
        lambda m: m.down_blocks[0].resnets[0],
    ),
    "vae": (_vae, lambda m, x, step: m(x).sample, _diffusers_switch, lambda m: m.decoder.up_blocks[0]),
    "segformer": (
        _segformer,
        lambda m, x, step: m(x).last_hidden_state,
        _transformers_switch,
        lambda m: m.stages[0].blocks[0].attention,  # the layer checkpoints its forward body
    ),
}


def _reentrant(module, *args):
    return checkpoint(module.__call__, *args, use_reentrant=True)


def _case(rank, world, name, mesh_shape, sizes, reentrant):
    build, call, switch, block = MODELS[name]
    mesh, coords, dims = _mesh(world, mesh_shape)
    serial = build()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    parallel.train(), serial.train()
    switch(parallel, reentrant)  # the package's own switch
    runs = []  # (in backward, under a guard) per call of the watched block
    block(parallel).register_forward_pre_hook(
        lambda m, a: runs.append((torch._C._current_graph_task_id() != -1, active_guard() is not None))
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)

    def local(t):  # this rank's block of a serial tensor: balanced along each sharded dim (tplayers.shard)
        layouts = [tplayers.shard_sizes(t.shape[d], parts) for d, parts in zip(dims, mesh_shape)]
        return local_slice(t, dims, layouts, coords)

    for step in range(2):
        torch.manual_seed(10 + step)
        x = torch.randn(2, 2, *sizes, dtype=torch.float64)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = call(serial, xs, step), call(parallel, xl, step)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        target = torch.randn_like(ys)
        loss_s = F.mse_loss(ys, target)
        loss_p = tplayers.domain_mean(F.mse_loss(yl, local(target), reduction="none"), mesh)
        backward_step_match(loss_s, loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT)
    # each step: the block's forward, then its recomputation in backward under a guard
    assert runs == [(False, True), (True, True)] * 2, runs
    return True


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["unet", "vae"])
def test_package_checkpointing_is_exact_2_ranks(name, reentrant):
    import diffusers  # noqa: F401 - the test extra installs it: a missing one fails, never skips

    run_ranks(_case, 2, args=(name, (2,), (16, 8), reentrant), timeout=240)


@pytest.mark.parametrize("world,mesh_shape,sizes", [(2, (2,), (64, 32)), (4, (2, 2), (64, 64))], ids=["2", "2x2"])
def test_transformers_checkpointing_with_region_context_fn_is_exact(world, mesh_shape, sizes):
    import transformers  # noqa: F401 - the test extra installs it: a missing one fails, never skips

    run_ranks(_case, world, args=("segformer", mesh_shape, sizes, False), timeout=300)


def _transformers_plain(rank, world, reentrant):
    mesh = tplayers.default_mesh()
    model = tplayers.parallelize_module(_segformer(), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    x = tplayers.shard(torch.randn(1, 2, 64, 32, dtype=torch.float64), 2, mesh).requires_grad_(True)
    if not reentrant:  # the body's ops are seen in forward, under the checkpoint's hooks
        with pytest.raises(ValueError, match=r"in a checkpointed function, outside its modules.*region_context_fn"):
            model(x)
        return "forward"
    y = model(x).last_hidden_state  # CheckpointFunction runs the body under no_grad: seen in backward
    with pytest.raises(ValueError, match=r"inside a checkpointed function that is not its call"):
        tplayers.domain_sum(y.square()).backward()
    return "backward"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_transformers_checkpointing_without_region_context_fn_is_refused_on_every_rank(reentrant):
    import transformers  # noqa: F401 - the test extra installs it: a missing one fails, never skips

    outs = run_ranks(_transformers_plain, 2, args=(reentrant,), timeout=120)
    assert outs == ["backward" if reentrant else "forward"] * 2


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["unet", "vae"])
def test_package_checkpointing_is_exact_2x2(name, reentrant):
    import diffusers  # noqa: F401 - the test extra installs it: a missing one fails, never skips

    run_ranks(_case, 4, args=(name, (2, 2), (16, 16), reentrant), timeout=300)


class Closure(nn.Module):
    """Blocks checkpointed through a plain function: ``kind`` "seq" only calls modules (timm's
    ``checkpoint_seq``); "body" also applies a spatial mean to sharded data in the function's body;
    "context" is "body" checkpointed with ``context_fn=tplayers.region_context_fn``."""

    def __init__(self, kind, reentrant):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Tanh())
        self.b = nn.Conv2d(3, 2, 3, padding=1)
        self.kind, self.reentrant = kind, reentrant

    def run(self, t):
        if self.kind in ("body", "context"):
            t = t - t.mean(dim=2, keepdim=True)
        y = self.b(self.a(t))
        return y * t.amax(dim=(2, 3), keepdim=True) if self.kind == "context" else y  # ops after the modules too

    def forward(self, x):
        if self.kind == "context":
            return checkpoint(self.run, x, use_reentrant=False, context_fn=tplayers.region_context_fn)
        return checkpoint(self.run, x, use_reentrant=self.reentrant)


def _closure(rank, world, kind, reentrant):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = Closure(kind, False).double()
    model = tplayers.parallelize_module(
        Closure(kind, reentrant).double(), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    model.load_state_dict(serial.state_dict())
    xs = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    x = tplayers.shard(xs.detach(), 2, mesh).requires_grad_(True)
    if kind == "body" and not reentrant:  # refused in forward, before the op runs
        with pytest.raises(ValueError, match=r"Tensor.mean in a checkpointed function, outside its modules"):
            model(x)
        return "refused"
    if reentrant:  # refused in backward, when the first module is recomputed
        y = model(x)
        with pytest.raises(ValueError, match=r"module 'a' is recomputed .* inside a checkpointed function that is not"):
            tplayers.domain_sum(y.square()).backward()
        return "refused"
    tplayers.domain_sum(model(x).square()).backward()
    serial(xs).square().sum().backward()
    torch.testing.assert_close(x.grad, tplayers.shard(xs.grad, 2, mesh), **TIGHT)
    for (n, p), q in zip(model.named_parameters(), serial.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n, **TIGHT)
    return "exact"


@pytest.mark.parametrize(
    "kind,reentrant,expected",
    [
        ("seq", False, "exact"),
        ("body", False, "refused"),
        ("context", False, "exact"),
        ("seq", True, "refused"),
        ("body", True, "refused"),
    ],
)
def test_checkpointed_plain_function_is_exact_or_refused_on_every_rank(kind, reentrant, expected):
    assert run_ranks(_closure, 2, args=(kind, reentrant), timeout=60) == [expected] * 2
