"""The region guard on per-pixel ops on flattened pixels with replicated operands (issue 31): ``cdist``
against a codebook, ``argmin`` over it, ``F.embedding`` lookups of sharded indices.

diffusers' ``VQModel`` (its ``VectorQuantizer``: ``z.view(-1, C)``, ``torch.cdist``, ``argmin``,
``nn.Embedding``, the commitment loss as a spatial mean) and a hand-written quantizer run under
``{"": DomainParallel(...)}`` against the serial model in fp64 at 2 ranks, 3 ranks (uneven) and on a
2x2 mesh: outputs, the commitment loss, the input gradient, every parameter gradient (the codebook's
included), after an SGD step with momentum, train then eval mode.
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

import tplayers

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

TIGHT = dict(rtol=1e-9, atol=1e-11)


def _vq_model():
    from diffusers import VQModel

    torch.manual_seed(0)
    return VQModel(
        in_channels=2,
        out_channels=2,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=3,
        num_vq_embeddings=16,
        norm_num_groups=4,
        vq_embed_dim=3,
    ).double()


class Quantizer(nn.Module):
    """A VQ-VAE bottleneck written by hand: conv, per-pixel distances to a codebook (``cdist`` with
    ``p``), ``argmin``, an embedding lookup, the straight-through estimator, a global commitment loss;
    and the transposed form (``cdist(codebook, pixels)``, its ``argmin`` over the codebook's dim 0)."""

    def __init__(self, p=2.0, codes=8):
        super().__init__()
        self.p = p
        self.conv_in = nn.Conv2d(2, 3, 3, padding=1)
        self.codebook = nn.Embedding(codes, 3)
        self.conv_out = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        z = self.conv_in(x).permute(0, 2, 3, 1)
        flat = z.reshape(-1, 3)
        idx = torch.cdist(flat, self.codebook.weight, p=self.p).argmin(dim=1)
        idx_t = torch.cdist(self.codebook.weight, flat, p=self.p).argmin(dim=0)  # the same, transposed
        zq = self.codebook(idx).view(z.shape) + 0.0 * F.embedding(idx_t, self.codebook.weight).view(z.shape)
        loss = ((zq.detach() - z) ** 2).mean() + 0.25 * ((zq - z.detach()) ** 2).mean()
        zq = z + (zq - z).detach()
        return self.conv_out(zq.permute(0, 3, 1, 2)), loss


def _parity(rank, world, kind, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    if kind == "vq":
        serial = _vq_model()
        call = lambda m, x: m(x, return_dict=False)  # noqa: E731 - (sample, commit_loss)
    else:
        torch.manual_seed(3)
        serial = Quantizer(**kind).double()
        call = lambda m, x: m(x)  # noqa: E731
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for mode in ["train", "train", "eval"]:
        serial.train(mode == "train"), parallel.train(mode == "train")
        shape = [2, 2] + [sum(layouts[i]) if i < len(dims) else 6 for i in range(2)]
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, loss_s = call(serial, xs)
        yl, loss_p = call(parallel, xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        torch.testing.assert_close(loss_p, loss_s, **TIGHT)  # the global commitment loss on every rank
        target = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
        backward_step_match(
            F.mse_loss(ys, target) + loss_s,
            tplayers.domain_mean(F.mse_loss(yl, local(target), reduction="none"), mesh) + loss_p,
            xs,
            xl,
            local,
            serial,
            parallel,
            opt_s,
            opt_p,
            **TIGHT,
        )
    return True


@pytest.mark.parametrize(
    "world,mesh_shape,layouts", [(2, (2,), [[5, 5]]), (4, (2, 2), [[5, 5], [4, 4]])], ids=["2", "2x2"]
)
def test_diffusers_vq_model_is_exact(world, mesh_shape, layouts):
    # 10 rows -> 5 latent rows (balanced: 3 + 2, uneven) -> 10 output rows (5 + 5, the input's partition)
    run_ranks(_parity, world, args=("vq", mesh_shape, layouts), timeout=240)


@pytest.mark.parametrize("p,codes", [(2.0, 8), (2.0, 40), (1.0, 8)])
def test_hand_written_quantizer_is_exact(p, codes):
    # 8 codes: torch's cdist picks its path from the global row count (all-reduced); 40: always the mm path
    kind = dict(p=p, codes=codes)
    run_ranks(_parity, 2, args=(kind, (2,), [[5, 4]]), timeout=120)
    run_ranks(_parity, 3, args=(kind, (3,), [[4, 3, 2]]), timeout=120)


# ------------------------------------------------------------------ refused
class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.table = nn.Embedding(6, 3)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, self.conv(x))


def _refused(rank, world, fn, what):
    model = tplayers.parallelize_module(Op(fn).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 3, [5, 4][rank], 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=what) as err:
        model(x)
    assert "domain region" in str(err.value)
    return True


def _flat(h):
    return h.permute(0, 2, 3, 1).reshape(-1, 3)


def test_cdist_between_two_sharded_sets_of_rows_raises_on_every_rank():
    fn = lambda m, h: torch.cdist(_flat(h), _flat(h))  # noqa: E731 - pixel-to-pixel distances
    run_ranks(_refused, 2, args=(fn, "cdist between two sharded sets of rows"), timeout=60)


def test_cdist_over_a_sharded_vector_dim_raises_on_every_rank():
    fn = lambda m, h: torch.cdist(h.transpose(2, 3), torch.ones(2, 3, 4, h.shape[2], dtype=h.dtype))  # noqa: E731
    run_ranks(_refused, 2, args=(fn, "cdist contracting a sharded dim"), timeout=60)


@pytest.mark.parametrize(
    "key,value", [("max_norm", 1.0), ("scale_grad_by_freq", True), ("sparse", True)], ids=lambda v: str(v)
)
def test_embedding_options_that_need_the_whole_batch_raise_on_every_rank(key, value):
    fn = lambda m, h: F.embedding(_flat(h).argmin(dim=1), m.table.weight, **{key: value})  # noqa: E731
    run_ranks(_refused, 2, args=(fn, f"embedding with {key}={value!r} on sharded indices"), timeout=60)
