"""Triton halo pack / unpack / unpack-add kernels == the torch reference, bitwise (TRITON_INTERPRET=1 on CPU)."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel module's import

import triton  # noqa: E402,F401 - the test extra installs it: a missing one fails, never skips

from tplayers.kernels import halo_pack  # noqa: E402
from tplayers.ops import pack_faces_reference, unpack_faces_reference  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _make(rng, dtype, device, shape=None, layout=None):
    if shape is None:
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.3:
            shape[-1] = halo_pack.BLOCK // 8 + rng.randint(1, 40)  # several blocks, not a multiple
        layout = rng.choice(["contiguous", "transposed", "sliced", "channels_last"])
    ndim = len(shape)
    x = torch.randn(shape, dtype=torch.float32, device=device).to(dtype)
    if layout == "transposed" and ndim >= 2:
        x = x.transpose(0, ndim - 1).contiguous().transpose(0, ndim - 1)
    elif layout == "sliced":
        big = torch.randn([s + 2 for s in shape], dtype=torch.float32, device=device).to(dtype)
        x = big[tuple(slice(1, 1 + s) for s in shape)]
    elif layout == "channels_last" and ndim == 4:
        x = x.to(memory_format=torch.channels_last)
    elif layout == "channels_last" and ndim == 5:
        x = x.to(memory_format=torch.channels_last_3d)
    return x, shape, layout


def _faces(rng, n):
    k = rng.randint(0, min(n, 4))  # halo widths 0..k
    faces = [(0, rng.randint(0, k)), (n - (w := rng.randint(0, k)), w)]
    if rng.random() < 0.3:
        faces.append((rng.randint(0, n - 1), 1))
    return faces


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_bitwise(dtype):
    rng = random.Random(str(dtype))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for _ in range(25):
        x, shape, layout = _make(rng, dtype, device)
        dim = rng.randrange(x.dim())
        faces = _faces(rng, x.size(dim))
        ref = pack_faces_reference(x, dim, faces)
        got = halo_pack.pack(x, dim, faces)
        assert torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8)), (x.shape, dim, faces)
        # unpack into a fresh tensor with x's strides; faces may overlap only when copying identical data
        disjoint = sorted(f for f in faces if f[1])
        if any(a[0] + a[1] > b[0] for a, b in zip(disjoint, disjoint[1:])):
            faces = faces[:1]
            ref = pack_faces_reference(x, dim, faces)
        buf = torch.randn(ref.numel(), device=device).to(dtype)
        for accumulate in (False, True):
            base, _, _ = _make(rng, dtype, device, shape, layout)  # same strides as x
            expect = unpack_faces_reference(buf, base.clone(), dim, faces, accumulate).contiguous()
            out = halo_pack.unpack(buf, base, dim, faces, accumulate)
            assert out.data_ptr() == base.data_ptr()  # in place
            assert torch.equal(out.contiguous().view(torch.uint8), expect.view(torch.uint8)), (
                x.shape,
                layout,
                dim,
                faces,
                accumulate,
            )


def test_front_door_routes_to_triton_when_forced(monkeypatch):
    import tplayers.ops.halo as front

    monkeypatch.setenv("TPLAYERS_HALO_BACKEND", "triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors: Triton's interpreter (set above)
    x = torch.arange(60, dtype=torch.float64, device=device).reshape(3, 4, 5).transpose(1, 2)
    faces = [(0, 2), (2, 1), (1, 2)]
    assert front._use_triton(x)
    assert torch.equal(front.pack_faces(x, 2, faces), pack_faces_reference(x, 2, faces))
    out = torch.zeros(3, 5, 4, dtype=torch.float64, device=device)
    buf = torch.arange(75, dtype=torch.float64, device=device)
    expect = unpack_faces_reference(buf, out.clone(), 2, faces, True)  # overlapping rows add up
    assert torch.equal(front.unpack_faces(buf, out, 2, faces, accumulate=True), expect)


def test_forcing_triton_on_cpu_tensors_outside_the_interpreter_raises(monkeypatch):
    import tplayers.ops.halo as front

    monkeypatch.setenv("TPLAYERS_HALO_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1\); got a tensor on cpu"):
        front.pack_faces(torch.zeros(2, 3, 4), 2, [(0, 1)])


@pytest.mark.parametrize(
    "shape,layout",
    [
        ((2, 3, 9), "contiguous"),
        ((2, 3, 9), "sliced"),
        ((1, 3, 5, 4, 6), "contiguous"),
        ((2, 3, 5, 4, 6), "channels_last"),
        ((1, 2, 4, 5, 3), "sliced"),
    ],
)
def test_3d_and_5d_every_dim_one_launch(shape, layout, monkeypatch):
    """(N, C, L) and (N, C, D, H, W) tensors: both faces of an exchange along each spatial dim in one
    launch, pack / unpack / unpack-add bitwise equal to the reference."""
    rng = random.Random(repr(shape) + layout)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    launches = []
    real = halo_pack._halo_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(halo_pack, "_halo_kernel", Counting())
    for dtype in (torch.float64, torch.bfloat16):
        x, _, _ = _make(rng, dtype, device, list(shape), layout)
        for dim in range(2, len(shape)):
            n = x.size(dim)
            faces = [(0, 2), (n - 1, 1)]
            launches.clear()
            got = halo_pack.pack(x, dim, faces)
            assert len(launches) == 1
            assert torch.equal(
                got.view(torch.uint8), pack_faces_reference(x, dim, faces).contiguous().view(torch.uint8)
            )
            buf = torch.randn(got.numel(), device=device).to(dtype)
            for accumulate in (False, True):
                base, _, _ = _make(rng, dtype, device, list(shape), layout)
                expect = unpack_faces_reference(buf, base.clone(), dim, faces, accumulate).contiguous()
                launches.clear()
                out = halo_pack.unpack(buf, base, dim, faces, accumulate)
                assert len(launches) == 1
                assert torch.equal(out.contiguous().view(torch.uint8), expect.view(torch.uint8)), (dim, accumulate)
