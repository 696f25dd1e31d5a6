"""Attention written out by hand over domain-sharded pixels (issue 31 item 3): ``q @ k.transpose(-2, -1)``,
a relative-position bias, softmax, dropout, ``@ v`` (matmul and einsum spellings), smp's position
attention (``bmm`` of the values with the transposed scores), a Gram matrix over pixels. The guard gathers
the keys and values whole in the serial order (tplayers/region/rules_linalg.py) and sums partial products
over pixels, so each rank computes its rows of the serial scores: exact in fp64 against the serial model
(outputs, input gradient, every parameter gradient, the parameters after an SGD step with momentum; a
softmax / log-softmax along a sharded dim is routed: global max and sum of exponentials) at
2 and 3 ranks with uneven rows and on a 2x2 mesh (each rank's tokens then not contiguous in the serial
order). Pairing prefix tokens (a CLS token before the pixels) is refused on every rank, naming SDPA.
"""

import copy

import pytest
import torch
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-10, atol=1e-11)


class Eager(nn.Module):
    """Single-head attention over every pixel, written as the packages write it (``how``: "matmul" with a
    learned bias over pixel pairs of a fixed grid and dropout on the scores; "einsum", MONAI's SABlock
    spelling, two heads; "bmm", smp MAnet's position attention; "pab", MAnet's PABBlock: one softmax over
    every pixel pair; "gram", a Gram matrix of the features and a log-softmax over the pixels)."""

    def __init__(self, how, grid):
        super().__init__()
        self.how, n = how, grid[0] * grid[1]
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.qkv = nn.Conv2d(4, 12, 1)
        self.bias = nn.Parameter(0.1 * torch.randn(n, n))
        self.drop = nn.Dropout(0.25)
        self.out = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        b, c, hh, ww = h.shape
        q, k, v = self.qkv(h).flatten(2).chunk(3, dim=1)  # (B, C, N) each
        if self.how == "matmul":
            s = q.transpose(1, 2) @ k * c**-0.5 + self.bias  # (B, N, N)
            y = (self.drop(s.softmax(dim=-1)) @ v.transpose(1, 2)).transpose(1, 2)
        elif self.how == "einsum":
            q, k, v = (t.reshape(b, 2, c // 2, -1).transpose(-1, -2) for t in (q, k, v))  # (B, heads, N, d)
            s = torch.einsum("bhxd,bhyd->bhxy", q, k) * (c // 2) ** -0.5
            y = torch.einsum("bhxy,bhyd->bhxd", self.drop(s.softmax(dim=-1)), v).transpose(-1, -2).reshape(b, c, -1)
        elif self.how == "bmm":
            s = torch.bmm(q.permute(0, 2, 1), k).softmax(dim=-1)  # smp MAnet's PAM_Module
            y = torch.bmm(v, s.permute(0, 2, 1))
        elif self.how == "pab":  # smp MAnet's PABBlock: a softmax over every pixel pair (a sharded dim)
            s = torch.matmul(q.transpose(1, 2), k)
            s = nn.functional.softmax(s.view(b, -1), dim=1).view(b, hh * ww, hh * ww)
            y = torch.matmul(s, v.transpose(1, 2)).transpose(1, 2)
        else:
            f = h.flatten(2)
            gram = f @ f.transpose(1, 2) / f.shape[-1]  # (B, C, C): summed over every pixel
            y = torch.einsum("bcd,bdn->bcn", gram.softmax(dim=-1), v) + torch.log_softmax(v, dim=2)  # over pixels
        return self.out(h + y.view(b, c, hh, ww))


def _exact(rank, world, how, mesh_shape, rows, hw):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    dims = (2,) if len(mesh_shape) == 1 else (2, 3)
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    torch.manual_seed(0)
    serial = Eager(how, hw).double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    local = lambda t: local_slice(t, dims, rows, coords)  # noqa: E731
    for step in range(2):
        x = torch.randn(2, 2, *hw, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        torch.manual_seed(7 + step)  # the same dropout draws in both
        ys = serial(xs)
        torch.manual_seed(7 + step)
        yl = parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        w = torch.randn_like(ys)
        loss_s, loss_p = (ys * w).sum(), tplayers.domain_sum(yl * local(w), mesh)
        backward_step_match(loss_s, loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT)
    serial.eval(), parallel.eval()
    torch.testing.assert_close(parallel(local(x)), local(serial(x)), **TIGHT)
    return True


CASES = [
    (2, (2,), [[5, 4]], (9, 5)),
    (3, (3,), [[4, 3, 2]], (9, 4)),
    (4, (2, 2), [[4, 3], [3, 2]], (7, 5)),  # tokens of a rank not contiguous in the serial order
]


@pytest.mark.parametrize("how", ["matmul", "einsum", "bmm", "pab", "gram"])
@pytest.mark.parametrize("case", CASES, ids=["2", "3", "2x2"])
def test_hand_written_attention_over_sharded_pixels_is_exact(how, case):
    world, mesh_shape, rows, hw = case
    assert run_ranks(_exact, world, args=(how, mesh_shape, rows, hw), timeout=120) == [True] * world


def _manet(rank, world):
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    model = smp.MAnet(
        "tu-test_resnet", encoder_weights=None, classes=2, encoder_depth=4, decoder_channels=(16, 8, 8, 8)
    )
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(2, 2))
    model = tplayers.parallelize_module(model.double(), {"": tplayers.DomainParallel(shard_dims=(2, 3))}, mesh=mesh)
    coords = [mesh.get_local_rank(i) for i in range(2)]
    x = local_slice(torch.randn(1, 3, 64, 64, dtype=torch.float64), (2, 3), [[32, 32], [32, 32]], coords)
    with pytest.raises(ValueError, match=r"in module 'decoder.center'") as err:
        model(x)
    return str(err.value).split("Rank 0: ")[-1]


def test_manet_on_a_2x2_mesh_is_refused_on_every_rank():
    """smp's MAnet: its position attention (a softmax over every pixel pair, the scores gathered) is routed,
    and ``reshape(B, C, H, W)`` of the ``(B, HW, C)`` result is the serial view: channels sharded, moved
    back to the input's rows for the sum with it (exact at 2 ranks: the zoo). On a 2x2 mesh the channels
    are not one contiguous block per rank: the sum is refused on every rank."""
    outs = run_ranks(_manet, 4, timeout=120)
    assert len(set(outs)) == 1, outs


class TokensToChannels(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 1)

    def forward(self, x):
        b, _, h, w = x.shape
        return self.conv(x).flatten(2).transpose(1, 2).reshape(b, 6, h, w)  # (B, HW, C) -> (B, C, H, W)


def _tokens_to_channels(rank, world):
    model = tplayers.parallelize_module(TokensToChannels().double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    with pytest.raises(ValueError, match=r"the length 2 read from a sharded dim sizes dim 2.*serial reshape places"):
        model(tplayers.shard(torch.randn(2, 3, 4, 4, dtype=torch.float64), 2))
    return True


def test_a_reshape_moving_tokens_into_channels_is_refused_on_every_rank():
    """Read locally, ``reshape(b, C, h, w)`` of this rank's ``(b, h*w, C)`` tokens keeps its rows in dim 1 and
    puts the length ``h`` read from the sharded dim on a whole dim: the serial reshape fills that dim with
    other elements (it was silently a different tensor)."""
    assert run_ranks(_tokens_to_channels, 2, timeout=60) == [True, True]


def _softmax_dtype(rank, world):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 4, dtype=torch.float64)
    model = tplayers.parallelize_module(Scale().double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    y = model(tplayers.shard(x, 2))
    want = tplayers.shard(Scale().double()(x), 2)
    assert y.dtype == want.dtype == torch.float32
    torch.testing.assert_close(y, want)
    return True


class Scale(nn.Module):
    def forward(self, x):
        return x.softmax(2, torch.float32) + torch.log_softmax(x, 2, torch.float32)  # dtype given positionally


def test_softmax_along_a_sharded_dim_keeps_a_positional_dtype():
    assert run_ranks(_softmax_dtype, 2, timeout=60) == [True, True]
