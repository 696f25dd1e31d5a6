"""The reference of issue 35's "at least 2x today's kernel": the compiled C kernel as it was when the
issue was filed (its source at commit ``c2a6f01``, unchanged until ``e1e71da``), built from the git
history into a temporary folder with the flags the current kernel is built with (same compiler,
``-march``, lanes), and run through the same autograd function and geometry as the current kernel,
so the two are timed side by side in one run.

Its backward is routed as it was then: the old C backward where its dK/dV sums stayed in registers
(``(kW - 1) * dilation <= lanes``), else the torch tile kernel's backward (``TPLAYERS_NA_KERNEL=torch``
of today, whose 1-D tiles have grown faster since: a stricter reference than the one of the filing).
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from tplayers.ops import na_cpu, na_engine
from tplayers.ops.na_gemm import GeoAttention
from tplayers.ops.na_geometry import Axis, geometry_args, kernel_dims, kernel_tables

#: the commit of the C kernel at the issue's filing
COMMIT = "c2a6f01"
FILES = ("tplayers/ops/na_cpu.c", "tplayers/ops/na_cpu_blocks.h")
ROOT = Path(__file__).resolve().parent.parent
_LIBS: dict = {}


def _source(name: str) -> bytes:
    """One file of the old kernel: from ``$TPLAYERS_NA_REFERENCE_DIR`` (a copy, for a checkout without
    the git history) or ``git show``."""
    folder = os.environ.get("TPLAYERS_NA_REFERENCE_DIR")
    if folder:
        return Path(folder, Path(name).name).read_bytes()
    return subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{COMMIT}:{name}"], capture_output=True, check=True, timeout=60
    ).stdout


def reference_library(dtype: torch.dtype = torch.float32) -> Optional[ctypes.CDLL]:
    """The old kernel for ``dtype``, built on first use; None (and a printed reason) when the git
    history or the compiler is missing."""
    if dtype in _LIBS:
        return _LIBS[dtype]
    lib = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in FILES:
                Path(tmp, Path(name).name).write_bytes(_source(name))
            target = Path(tmp, "ref.so")
            flags = na_cpu.build_flags(dtype)
            cc = os.environ.get("CC") or "cc"
            subprocess.run(
                [cc, *flags, "-shared", "-o", str(target), str(Path(tmp, "na_cpu.c")), "-lm"],
                capture_output=True,
                check=True,
                timeout=300,
            )
            lib = ctypes.CDLL(str(target))  # stays mapped after the folder is removed
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"  MISSING REFERENCE: the C kernel of {COMMIT} cannot be built here ({exc})")
        _LIBS[dtype] = None
        return None
    ptr, i32, dbl = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.na_scratch.argtypes, lib.na_scratch.restype = [ptr, i32], ctypes.c_long
    lib.na_forward.argtypes = [ptr] * 5 + [ptr, ptr, ptr, dbl, ptr, i32, i32]
    lib.na_forward.restype = None
    lib.na_backward.argtypes = [ptr] * 11 + [ptr, ptr, ptr, dbl, ptr, i32, i32]
    lib.na_backward.restype = None
    _LIBS[dtype] = lib
    return lib


def _p(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def old_forward(q, k, v, table, geo, scale, heads):
    lib = reference_library(q.dtype)
    dims = kernel_dims(geo, q.shape[0], heads, q.shape[-1] // heads, v.shape[-1] // heads)
    rows, cols = kernel_tables(tuple(geo))
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    scratch = q.new_empty(lib.na_scratch(_p(dims), 0))
    tab = None if table is None else table.detach().contiguous()
    lib.na_forward(_p(q), _p(k), _p(v), _p(tab), _p(out), _p(dims), _p(rows), _p(cols), scale, _p(scratch), 0,
                   q.shape[0] * heads)  # fmt: skip
    return out


def old_backward(grad_out, q, k, v, table, out, geo, scale, heads, want_kv=True, want_bias=True):
    lib = reference_library(q.dtype)
    batch, dim_v = q.shape[0], v.shape[-1] // heads
    dims = kernel_dims(geo, batch, heads, q.shape[-1] // heads, dim_v)
    rows, cols = kernel_tables(tuple(geo))
    g4 = grad_out.contiguous().view(batch, q.shape[1], heads, dim_v)
    strides = torch.tensor(g4.stride(), dtype=torch.int64)
    dq = torch.empty_like(q)
    dk, dv = (torch.empty_like(k), torch.empty_like(v)) if want_kv else (None, None)
    if want_kv:  # the old kernel accumulated into dK / dV
        dk.zero_()
        dv.zero_()
    tab = None if table is None else table.detach().contiguous()
    dtab = None if tab is None else torch.zeros_like(tab)
    scratch = q.new_empty(lib.na_scratch(_p(dims), 1 if want_kv else 2))
    lib.na_backward(_p(g4), _p(strides), _p(q), _p(k), _p(v), _p(tab), _p(out), _p(dq), _p(dk), _p(dv), _p(dtab),
                    _p(dims), _p(rows), _p(cols), scale, _p(scratch), 0, batch * heads)  # fmt: skip
    return dq, dk, dv, dtab


OLD_KERNELS = (old_forward, old_backward)


def old_fused(kernel: int, dtype=torch.float32) -> bool:
    """Whether the old routing ran the old C backward (else the tile kernel's)."""
    return (kernel - 1) <= na_cpu.lanes(dtype)


def plane_call(shape, kernel):
    """``(geo, scale, heads, to_pixels)`` of an ``na{n}d`` call on ``shape`` ``(B, *S, heads, D)`` with
    ``kernel`` on every axis, as the engine builds them (1-D gets its leading row axis of 1)."""
    rank = len(shape) - 3
    spatial = tuple(shape[1 : 1 + rank])
    kern = (kernel,) * rank
    if rank == 1:
        spatial, kern = (1, *spatial), (1, kernel)
    tile = na_engine.default_tile(kern)
    axes = [Axis(n, kk, 1, 1, 0, 0, n, 0, n, t) for n, kk, t in zip(spatial, kern, tile)]
    geo = geometry_args(axes, 1 << 17, 1 << 15)

    def to_pixels(x):
        return x.reshape(x.shape[0], math.prod(spatial), -1).contiguous()

    return geo, shape[-1] ** -0.5, shape[-2], to_pixels


def plane_fn(shape, kernel, kernels):
    """``f(q, k, v)`` on the plane kernels ``kernels`` through :class:`GeoAttention` (pixel-major)."""
    geo, scale, heads, to_pixels = plane_call(shape, kernel)

    def fn(q, k, v):
        return GeoAttention.apply(to_pixels(q), to_pixels(k), to_pixels(v), None, geo, scale, heads, kernels)

    return fn
