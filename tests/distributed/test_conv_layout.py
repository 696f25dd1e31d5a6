"""The DistributedConvNd twins keep nn.ConvNd's memory formats, whatever layout they convolve in.

Serial ``nn.Conv2d`` returns a channels_last output for a channels_last input (or weight) and a
contiguous one otherwise; its input gradient keeps the input's layout. The twin must do the same
(code after it may ``view`` the output), for ``memory_format=None`` (convolve in that layout, no
conversion) and for an explicit layout (convolve in it, convert the output back): contiguous and
channels_last inputs, fp64 and fp32, 2-D and 3-D, both strategies (overlap_halo=True: main-plus-strips), an uneven
partition. Values and every gradient equal the serial module's.
"""

import pytest
import torch
from harness import run_ranks
from oracle import memory_layout as layout
from oracle import same_layout
from torch import nn

import tplayers
from tplayers.sharding import offsets_from_sizes

_CL = {4: torch.channels_last, 5: torch.channels_last_3d}
_NN = {2: nn.Conv2d, 3: nn.Conv3d}
_TWIN = {2: tplayers.DistributedConv2d, 3: tplayers.DistributedConv3d}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4)}  # summation order


def _cases(nd):
    for dtype in (torch.float64, torch.float32):
        for x_cl in (False, True):
            for fmt in (None, torch.contiguous_format, torch.channels_last):
                for overlap in (False, True):
                    yield dtype, x_cl, fmt, overlap


def _check(rank, world, nd, w_cl):
    mesh = tplayers.default_mesh()
    sizes = [5, 8]  # uneven
    seen = set()
    for dtype, x_cl, fmt, overlap in _cases(nd):
        torch.manual_seed(7)
        serial = _NN[nd](16, 24, 3, padding=1, bias=True).to(dtype)
        shape = (2, 16, sum(sizes)) + (6,) * (nd - 1)
        twin = _TWIN[nd].from_module(serial, mesh=mesh, memory_format=fmt, overlap_halo=overlap)
        if w_cl:  # a model converted with .to(memory_format=channels_last): weights channels-last
            serial = serial.to(memory_format=_CL[nd + 2])
            twin = twin.to(memory_format=_CL[nd + 2])
        x = torch.randn(shape, dtype=dtype)
        if x_cl:
            x = x.contiguous(memory_format=_CL[nd + 2])
        local = x.narrow(2, offsets_from_sizes(sizes)[rank], sizes[rank]).clone(memory_format=torch.preserve_format)
        assert layout(local) == layout(x)
        local.requires_grad_(True)
        xs = x.clone(memory_format=torch.preserve_format).requires_grad_(True)
        ys, y = serial(xs), twin(local)
        what = f"{nd}-D {dtype} x_cl={x_cl} w_cl={w_cl} memory_format={fmt} overlap={overlap}"
        assert layout(ys) != "both" and same_layout(y, ys), f"{what}: output {layout(y)}, serial {layout(ys)}"
        seen.add(layout(y))
        if layout(y) == "contiguous":
            y.view(y.shape[0], -1)  # code after an nn.Conv2d may view its output
        yg = tplayers.gather(y, 2, mesh)
        torch.testing.assert_close(yg, ys, **TOL[dtype], msg=lambda m: f"{what}: {m}")
        cot = torch.randn_like(ys)
        (ys * cot).sum().backward()
        (y * cot.narrow(2, sum(sizes[:rank]), y.shape[2])).sum().backward()
        assert same_layout(local.grad, xs.grad), f"{what}: grad {layout(local.grad)}, serial {layout(xs.grad)}"
        torch.testing.assert_close(
            tplayers.gather(local.grad, 2, mesh), xs.grad, **TOL[dtype], msg=lambda m: f"{what} grad x: {m}"
        )
        torch.testing.assert_close(
            twin.weight.grad, serial.weight.grad, **TOL[dtype], msg=lambda m: f"{what} grad w: {m}"
        )
        torch.testing.assert_close(twin.bias.grad, serial.bias.grad, **TOL[dtype], msg=lambda m: f"{what} grad b: {m}")
    return sorted(seen)


@pytest.mark.parametrize("nd,w_cl", [(2, False), (2, True), (3, False)])
def test_output_and_grad_keep_the_serial_layout(nd, w_cl):
    seen = run_ranks(_check, 2, args=(nd, w_cl), timeout=180)
    # both layouts really came out (3-D fp64 channels-last inputs give contiguous, as nn.Conv3d does)
    assert seen[0] == (["cl"] if w_cl else ["cl", "contiguous"]), seen


def test_memory_format_argument_checked():
    # checked in the constructor, before any process group is needed
    for bad in (torch.preserve_format, "channels_last"):
        with pytest.raises(
            ValueError, match="memory_format must be None, torch.channels_last or torch.contiguous_format, got"
        ):
            tplayers.DistributedConv2d(4, 4, 3, memory_format=bad)


def _compiled(rank, world):
    import torch._dynamo as dynamo

    mesh = tplayers.default_mesh()
    cases = [
        (True, None, False),
        (False, torch.channels_last, False),
        (False, torch.channels_last, True),
        (True, torch.contiguous_format, False),
    ]  # (channels_last input, memory_format, overlap)
    for x_cl, fmt, overlap in cases:
        torch.manual_seed(3)
        serial = nn.Conv2d(4, 6, 3, padding=1).double()
        twin = tplayers.DistributedConv2d.from_module(serial, mesh=mesh, memory_format=fmt, overlap_halo=overlap)
        x = torch.randn(2, 4, 11, 7, dtype=torch.float64)
        if x_cl:
            x = x.contiguous(memory_format=torch.channels_last)
        local = tplayers.shard(x, 2, mesh).clone(memory_format=torch.preserve_format)
        dynamo.reset()
        compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
        results = []
        for layer in (compiled, twin):
            xl = local.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
            y = layer(xl)
            (y * torch.arange(y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
            results.append((y.detach(), xl.grad, twin.weight.grad.clone()))
            twin.zero_grad()
        what = f"x_cl={x_cl} memory_format={fmt} overlap={overlap}"
        ys = serial(x)
        for got, ref in zip(results[0], results[1]):
            torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13, msg=lambda m: f"{what}: {m}")
        assert same_layout(results[0][0], ys) and layout(results[0][0]) != "both", what
        assert same_layout(results[0][1], x), what
    return True


def test_layouts_under_torch_compile():
    """fullgraph (aot_eager): the output conversion of a forced layout, and channels_last inputs,
    compile without a graph break and equal eager, layouts included."""
    run_ranks(_compiled, 2, timeout=240)
