"""Triton halo pack / unpack / unpack-add kernels == the torch reference, bitwise (TRITON_INTERPRET=1 on CPU)."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel module's import

import triton  # noqa: E402,F401 - the test extra installs it: a missing one fails, never skips

from tplayers.kernels import halo_pack  # noqa: E402
from tplayers.ops import faces_overlap, pack_faces_reference, unpack_faces_reference  # noqa: E402

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

    class Counting:  # counts the launches of either kernel (flat, or tiled for channels_last)
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            launches.append(grid)
            return self.real[grid]

    monkeypatch.setattr(halo_pack, "_halo_kernel", Counting(halo_pack._halo_kernel))
    monkeypatch.setattr(halo_pack, "_halo_tiled_kernel", Counting(halo_pack._halo_tiled_kernel))
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


# The channel-tiled kernel (tensors whose dim 1 has stride 1: channels_last, channels_last_3d). C = 3, 5,
# 17, 67 are not multiples of the tile's channel block (the next power of 2, at most 64: 67 takes two
# blocks), and (1, 17, 5, 70) has faces of 140 spatial elements, past one spatial block (4096 // 32).
TILED_CASES = [
    ((2, 3, 7, 6), torch.channels_last),
    ((1, 17, 5, 70), torch.channels_last),
    ((2, 67, 4, 5), torch.channels_last),
    ((2, 5, 3, 4, 6), torch.channels_last_3d),
    ((1, 17, 4, 3, 5), torch.channels_last_3d),
]


def _filled(shape, dtype, fmt, seed, device):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
    else:
        x = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return x.to(device).contiguous(memory_format=fmt)


def _disjoint_faces(n, count):
    """``count`` (2 or 4) disjoint faces of a dim of size ``n`` (fewer where ``n`` is too small): overlapping
    faces race on a GPU, and must not be accumulated in one launch."""
    if n < count:
        return [(0, 1), (n - 1, 1)] if n >= 2 else [(0, 1)]
    return [(0, min(2, n - 1)), (n - 1, 1)] if count == 2 else [(0, 1), (1, 1), (n - 2, 1), (n - 1, 1)]


def _check_faces(x, dim, faces, fmt, tiled=None):
    """pack, unpack, unpack-add and a pack -> unpack round trip against the torch reference, bitwise."""
    assert not faces_overlap(faces), faces
    dtype, device = x.dtype, x.device
    got = halo_pack.pack(x, dim, faces, tiled=tiled)
    ref = pack_faces_reference(x, dim, faces).contiguous()
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (x.shape, dim, faces, dtype)
    buf = _filled([got.numel()], dtype, torch.contiguous_format, 1, device)
    for accumulate in (False, True):
        base = _filled(x.shape, dtype, fmt, 2, device)
        expect = unpack_faces_reference(buf, base.clone(), dim, faces, accumulate).contiguous()
        out = halo_pack.unpack(buf, base, dim, faces, accumulate, tiled=tiled)
        assert out.data_ptr() == base.data_ptr()
        assert torch.equal(out.contiguous().view(torch.uint8), expect.view(torch.uint8)), (x.shape, dim, faces, dtype)
    back = halo_pack.unpack(got, torch.zeros_like(x), dim, faces, tiled=tiled)  # round trip: the faces come back
    for start, length in faces:
        assert torch.equal(back.narrow(dim, start, length), x.narrow(dim, start, length))


@pytest.mark.parametrize("shape,fmt", TILED_CASES)
def test_tiled_every_dim_bitwise(shape, fmt):
    """Faces along dim 0 and every spatial dim, 2 and 4 (MAX_FACES) faces in one launch, fp32 and bf16."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.bfloat16):
        x = _filled(shape, dtype, fmt, 0, device)
        for dim in [0, *range(2, len(shape))]:
            for count in (2, 4):
                faces = _disjoint_faces(x.size(dim), count)
                assert halo_pack._kernel_for(x, dim, faces, mode=1) == "tiled"  # unpack: tiled from C = 2
                pack_kernel = "tiled" if shape[1] >= halo_pack.MIN_TILED_C_PACK else "flat"
                assert halo_pack._kernel_for(x, dim, faces, mode=0) == pack_kernel
                _check_faces(x, dim, faces, fmt, tiled=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32, torch.int64])
def test_tiled_dtypes_bitwise(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for shape, fmt in [((2, 5, 6, 7), torch.channels_last), ((1, 3, 4, 3, 5), torch.channels_last_3d)]:
        x = _filled(shape, dtype, fmt, 0, device)
        for dim in range(2, len(shape)):
            _check_faces(x, dim, _disjoint_faces(x.size(dim), 2), fmt, tiled=True)


def test_tiled_sliced_and_forced():
    """A sliced channels_last view (batch and row strides not dense) takes the tiled kernel; forcing
    it on contiguous / transposed tensors (channel stride not 1) and forcing the flat kernel on
    channels_last are exact too."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    big = _filled((3, 20, 9, 8), torch.float32, torch.channels_last, 0, device)
    x = big[1:, :17, 2:8, 1:7]
    assert x.stride(1) == 1 and {halo_pack._kernel_for(x, 2, [(0, 2)], mode=m) for m in range(4)} == {"tiled"}
    _check_faces(x, 2, [(0, 2), (4, 2)], torch.channels_last)
    _check_faces(x, 3, [(0, 1), (5, 1)], torch.channels_last)
    for fmt in (torch.contiguous_format, torch.channels_last):
        for dtype in (torch.float32, torch.bfloat16):
            x = _filled((2, 5, 6, 7), dtype, fmt, 3, device)
            _check_faces(x, 3, [(0, 2), (5, 2)], fmt, tiled=fmt is torch.contiguous_format)
    t = _filled((2, 6, 5), torch.float64, torch.contiguous_format, 4, device).transpose(1, 2)  # (N, L, C) as (N, C, L)
    _check_faces(t, 2, [(0, 1), (5, 1)], torch.contiguous_format, tiled=True)


def test_kernel_choice():
    """The tiled kernel for channel-stride-1 tensors with faces off the channels with more than one spatial
    element: to unpack with C > 1, to pack with C >= MIN_TILED_C_PACK; the flat kernel otherwise."""
    choose = halo_pack._kernel_for
    x = torch.zeros(2, 16, 6, 5).to(memory_format=torch.channels_last)
    for dim in (0, 2, 3):
        for mode in range(4):
            assert choose(x, dim, [(0, 1), (4, 1)], mode=mode) == "tiled"
        assert choose(x, dim, [(0, 1)], tiled=False) == "flat"
    assert choose(x, 1, [(0, 1)]) == "flat"  # a face of channels
    narrow = torch.zeros(2, 4, 6, 5).to(memory_format=torch.channels_last)
    assert [choose(narrow, 2, [(0, 1)], mode=m) for m in range(4)] == ["flat", "tiled", "tiled", "tiled"]
    x5 = torch.zeros(1, 32, 4, 4, 4).to(memory_format=torch.channels_last_3d)
    assert choose(x5, 4, [(0, 2)]) == "tiled"
    ncl = torch.zeros(2, 7, 16).transpose(1, 2)  # (N, C, L), C stride 1
    assert choose(ncl, 2, [(0, 2)]) == "tiled"
    assert choose(ncl, 2, [(0, 1), (6, 1)]) == "flat"  # 1-D faces of one row: R = 1
    for mode in range(4):
        assert choose(torch.zeros(2, 16, 6, 5), 2, [(0, 1)], mode=mode) == "flat"  # contiguous
        assert choose(torch.zeros(2, 16, 6, 5, 3), 4, [(0, 1)], mode=mode) == "flat"
        one_c = torch.zeros(2, 1, 6, 5).to(memory_format=torch.channels_last)
        assert choose(one_c, 2, [(0, 1)], mode=mode) == "flat"  # C = 1: the flat walk is coalesced
        thin = torch.zeros(2, 16, 6, 1).to(memory_format=torch.channels_last)
        assert choose(thin, 2, [(0, 1)], mode=mode) == "flat"  # one spatial element per face
        assert choose(torch.zeros(3, 4), 0, [(0, 1)], mode=mode) == "flat"
    with pytest.raises(ValueError, match="tiled halo kernel"):
        choose(torch.zeros(3, 4), 0, [(0, 1)], tiled=True)
    with pytest.raises(ValueError, match="tiled halo kernel"):
        choose(x, 1, [(0, 1)], tiled=True)
