"""Element-wise dropout on domain-sharded data in training (issue 31: smp's DeepLabV3 ASPP
``nn.Dropout(0.5)``): every rank draws the serial mask and multiplies its slice, so the model equals the
serial one in fp64 with every rank seeded alike: outputs, input gradient, every parameter gradient, after
an SGD step, and the generator advanced as the serial model's (the next draw agrees). ``F.dropout``,
``nn.Dropout(inplace=True)`` and ``torch.dropout`` on contiguous and channels-last slabs and on flattened
pixels (tokens), 2 and 3 ranks with uneven rows and a 2x2 mesh; prefix tokens (a CLS token before the
patches) refused on every rank.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-12, atol=1e-13)


class Dropped(nn.Module):
    def __init__(self, kind, channels_last):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)
        self.kind, self.channels_last = kind, channels_last
        self.drop = nn.Dropout(0.3, inplace=True)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.channels_last:
            h = h.contiguous(memory_format=torch.channels_last)
        if self.kind == "functional":
            h = F.dropout(h, p=0.3, training=self.training)
        elif self.kind == "module_inplace":
            h = self.drop(h * 1.0)
        elif self.kind == "tokens":  # flattened pixels (B, H*W, C): one contiguous block of tokens per rank
            n, c, hh, ww = h.shape
            tokens = F.dropout(h.flatten(2).transpose(1, 2), p=0.3, training=self.training)
            h = tokens.transpose(1, 2).reshape(n, c, hh, ww)
        else:
            h = torch.dropout(h, 0.3, self.training)
        return self.b(h)


def _parity(rank, world, kind, channels_last, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(0)
    serial = Dropped(kind, channels_last).double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    shape = (2, 2, sum(layouts[0]), sum(layouts[1]) if len(layouts) > 1 else 7)
    for step in range(2):
        x = torch.randn(shape, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        torch.manual_seed(10 + step)
        ys = serial(xs)
        after_serial = torch.rand(3)
        torch.manual_seed(10 + step)
        yp = parallel(xl)
        assert torch.equal(torch.rand(3), after_serial), "the generator advanced differently from the serial model"
        torch.testing.assert_close(yp, local(ys), **TIGHT)
        with torch.no_grad():  # the mask dropped something (eval mode draws nothing)
            assert not torch.allclose(serial.eval()(x), ys)
        serial.train()
        cot = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
        backward_step_match(
            (ys * cot).sum(),
            tplayers.domain_sum(yp * local(cot), mesh),
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


@pytest.mark.parametrize("kind", ["functional", "module_inplace", "torch_dropout", "tokens"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_elementwise_dropout_draws_the_serial_mask(kind, channels_last):
    run_ranks(_parity, 2, args=(kind, channels_last, (2,), [[5, 3]]), timeout=60)


def test_elementwise_dropout_on_3_ranks_and_a_2x2_mesh():
    run_ranks(_parity, 3, args=("functional", False, (3,), [[4, 2, 3]]), timeout=60)
    run_ranks(_parity, 4, args=("module_inplace", True, (2, 2), [[5, 3], [2, 5]]), timeout=60)


class PrefixTokens(nn.Module):
    """A CLS token before the flattened pixels, then dropout: a rank's tokens are not one block of the serial
    sequence (the prefix sits on every rank): refused on every rank, naming ParallelDropout."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(2, 4, 1)
        self.cls = nn.Parameter(torch.zeros(1, 1, 4))

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat((self.cls.expand(t.shape[0], -1, -1), t), dim=1)
        return F.dropout(t, p=0.1, training=True)


def _prefix(rank, world):
    model = tplayers.parallelize_module(PrefixTokens().double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    with pytest.raises(ValueError, match=r"which holds prefix tokens \(a CLS token"):
        model(torch.randn(2, 2, [5, 3][rank], 4, dtype=torch.float64))
    return True


def test_dropout_of_prefix_tokens_raises_on_every_rank():
    assert run_ranks(_prefix, 2, timeout=60) == [True, True]
