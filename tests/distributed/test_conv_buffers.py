"""DistributedConv2d reuses its halo-padded input buffer across steps only when nothing reads it.

The buffer of one step is filled again by the next step's forward once the first step's backward
has released it; a second forward while a graph still holds it (a layer applied twice, a graph
kept with ``retain_graph``) gets a new buffer. Exact against nn.Conv2d (fp64) in every case, and
the input gradient (a view of the convolution's own gradient buffer, halo gradients added in place)
equals the serial one.
"""

import torch
from harness import run_ranks
from torch import nn

import tplayers
from tplayers.sharding import offsets_from_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)
SIZES = [5, 8]  # uneven rows of H = 13 on 2 ranks


def _buffer(conv):
    (specs,) = [lay[2] for lay in conv._layouts.values()]
    (spec,) = {id(s): s for s in specs.values() if s.padded.tensor is not None}.values()
    return spec.padded.tensor


def _mine(t, rank):
    return t.narrow(2, offsets_from_sizes(SIZES)[rank], SIZES[rank])


def _reuse(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(3)
    for fmt in (torch.contiguous_format, torch.channels_last):
        serial = nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular").double()
        conv = tplayers.DistributedConv2d.from_module(serial, mesh=mesh)
        xs = [torch.randn(2, 3, 13, 6, dtype=torch.float64).contiguous(memory_format=fmt) for _ in range(3)]
        cot = torch.randn(2, 3, 13, 6, dtype=torch.float64)

        def step(x):
            local = _mine(x, rank).clone(memory_format=fmt).requires_grad_(True)
            y = conv(local)
            (y * _mine(cot, rank)).sum().backward()
            return local.grad

        def serial_grad(x):
            x = x.clone().requires_grad_(True)
            (serial(x) * cot).sum().backward()
            return x.grad

        # consecutive steps: the second and third fill the first step's buffer again
        ptrs = []
        for x in xs:
            serial.zero_grad(), conv.zero_grad()
            g = step(x)
            torch.testing.assert_close(tplayers.gather(g, 2, mesh), serial_grad(x), **TIGHT)
            torch.testing.assert_close(conv.weight.grad, serial.weight.grad, **TIGHT)
            ptrs.append(_buffer(conv).data_ptr())
        assert ptrs[0] == ptrs[1] == ptrs[2], "a released buffer is filled again"

        # the layer applied twice before one backward (weights shared): two buffers, exact
        serial.zero_grad(), conv.zero_grad()
        local = _mine(xs[0], rank).clone(memory_format=fmt).requires_grad_(True)
        y = conv(torch.tanh(conv(local)))
        (y * _mine(cot, rank)).sum().backward()
        x0 = xs[0].clone().requires_grad_(True)
        (serial(torch.tanh(serial(x0))) * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(local.grad, 2, mesh), x0.grad, **TIGHT)
        torch.testing.assert_close(conv.weight.grad, serial.weight.grad, **TIGHT)

        # a graph kept with retain_graph: a forward in between must not overwrite what it saved
        serial.zero_grad(), conv.zero_grad()
        a = _mine(xs[1], rank).clone(memory_format=fmt).requires_grad_(True)
        ya = (conv(a) * _mine(cot, rank)).sum()
        ya.backward(retain_graph=True)
        b = _mine(xs[2], rank).clone(memory_format=fmt).requires_grad_(True)
        (conv(b) * _mine(cot, rank)).sum().backward()
        ya.backward()  # the first graph again: its buffer still holds xs[1]'s rows
        torch.testing.assert_close(tplayers.gather(a.grad, 2, mesh), 2 * serial_grad(xs[1]), **TIGHT)
    return True


def test_padded_buffer_reused_only_when_free():
    assert all(run_ranks(_reuse, 2, timeout=90))
