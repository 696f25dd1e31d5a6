"""neuraloperator's FNO as its package writes it, under {"": DomainParallel}: the grid positional embedding
(global coordinates), lifting and projection ChannelMLPs (1x1 Conv1d over flattened pixels), spectral
convolutions (rfftn, fftshift, mode slices around the centre, opt_einsum contraction, irfftn), skips.
neuraloperator hard-codes complex64 spectra, so this runs in fp32 (fp64 exactness of the same routes:
test_global_slices). Outputs, input gradient, every parameter gradient and two SGD steps (AdamW in the checkpoint test), at 2 ranks (H,
uneven), 2x2 (uneven) and a 3-D FNO at 2 ranks; a checkpoint saved at 2 ranks loads at 1 and 4."""

import copy

import neuralop  # noqa: F401  (the test extra installs it, pyproject.toml: a missing one fails, not skips)
import pytest
import torch
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch.distributed.device_mesh import DeviceMesh

import tplayers

FP32 = dict(rtol=2e-4, atol=2e-5)


class Blocks(torch.nn.Module):
    """neuraloperator's FNOBlocks alone (two layers, instance norm, a factorized Tucker weight), no lifting."""

    def __init__(self, n_dims):
        super().__init__()
        from neuralop.layers.fno_block import FNOBlocks

        self.blocks = FNOBlocks(2, 2, (4,) * n_dims, n_layers=2, norm="instance_norm", factorization="tucker")

    def forward(self, x):
        return self.blocks(self.blocks(x, 0), 1)


def _fno(n_dims, positional="grid"):
    from neuralop.models import FNO

    torch.manual_seed(0)
    if positional == "blocks":
        return Blocks(n_dims)
    return FNO(
        n_modes=(4,) * n_dims,
        hidden_channels=6,
        in_channels=2,
        out_channels=1,
        n_layers=2,
        positional_embedding=positional,
    )


def _parity(rank, world, mesh_shape, layouts, shape, n_dims, positional):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    serial = _fno(n_dims, positional)
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    # SGD with momentum: AdamW's step normalises a near-zero fp32 gradient to +-lr, amplifying float noise
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    for step in range(2):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **FP32)
        w = torch.randn(ys.shape, generator=torch.Generator().manual_seed(10 + step))
        loss_p = tplayers.domain_sum(yl * local(w), mesh)
        backward_step_match((ys * w).sum(), loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, **FP32)
    return True


@pytest.mark.parametrize(
    "world,mesh_shape,layouts,shape,n_dims,positional",
    [
        (2, (2,), [[9, 7]], (2, 2, 16, 10), 2, "grid"),
        (2, (2,), [[9, 7]], (2, 2, 16, 10), 2, None),  # without the positional embedding
        (2, (2,), [[9, 7]], (2, 2, 16, 10), 2, "blocks"),  # FNOBlocks alone: instance norm, Tucker weights
        (4, (2, 2), [[9, 7], [6, 5]], (1, 2, 16, 11), 2, None),
        (4, (2, 2), [[9, 7], [6, 5]], (1, 2, 16, 11), 2, "blocks"),
        (4, (2, 2), [[9, 7], [6, 5]], (1, 2, 16, 11), 2, "grid"),
        (2, (2,), [[5, 4]], (1, 2, 9, 8, 6), 3, "grid"),  # a 3-D FNO
    ],
)
def test_neuraloperator_fno_as_written(world, mesh_shape, layouts, shape, n_dims, positional):
    run_ranks(_parity, world, args=(mesh_shape, layouts, shape, n_dims, positional), timeout=240)


def _input():
    return torch.randn(2, 2, 12, 16, generator=torch.Generator().manual_seed(3))  # W // 2 + 1 = 9 modes: 3 a rank at 4


def _model(world):
    serial = _fno(2)
    if world == 1 and not torch.distributed.is_initialized():
        return serial, serial
    parallel = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    return serial, parallel


def _train_and_save(rank, world, path):
    _, parallel = _model(world)
    opt = torch.optim.AdamW(parallel.parameters(), lr=0.01)
    tplayers.domain_sum(parallel(tplayers.shard(_input(), 2)) ** 2).backward()
    opt.step()
    tplayers.save_checkpoint(parallel, path, optimizer=opt)
    return True


def _load_at(rank, world, path):
    trained, parallel = _model(world)
    opt_s = torch.optim.AdamW(trained.parameters(), lr=0.01)
    (trained(_input()) ** 2).sum().backward()
    opt_s.step()
    opt = torch.optim.AdamW(parallel.parameters(), lr=0.01)
    tplayers.load_checkpoint(parallel, path, optimizer=opt)
    for (k, v), ref in zip(parallel.named_parameters(), trained.parameters()):
        assert v.dtype == ref.dtype, k
        torch.testing.assert_close(v, ref, **FP32, msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(opt.state[v]["exp_avg"], opt_s.state[ref]["exp_avg"], **FP32)
    x = _input()
    torch.testing.assert_close(parallel(tplayers.shard(x, 2)), tplayers.shard(trained(x), 2), **FP32)
    return True


def test_a_neuraloperator_fno_checkpoint_saved_at_2_ranks_loads_at_1_and_4(tmp_path):
    path = str(tmp_path / "fno")
    run_ranks(_train_and_save, 2, args=(path,), timeout=120)
    for world in (1, 4):
        run_ranks(_load_at, world, args=(path,), timeout=120)
