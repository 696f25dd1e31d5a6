"""The work plans of the compiled C kernel (``na_cpu_plan.h``), built once per call shape.

A plan (the column blocks of a row with their shuffles, the column chunks, the tiles of query rows
with the key rows they read, and the backward's shift tables) depends only on the geometry, the
batch, heads and head dims; building it cost 5-15% of a 1-D call (a row of 4096 keys has 256
blocks) when every call built it twice (once for the scratch size). :func:`plan` keeps the last
:data:`CACHED` plans per process; each is freed (``na_plan_free``) when it leaves the cache.
Plans are read-only during calls, so threads share them.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from functools import lru_cache
from threading import Lock
from typing import Optional, Tuple

import torch

from tplayers.ops.na_geometry import kernel_dims

__all__ = ["plan", "CACHED", "declare", "forward_direct", "forward_line", "call_dims", "l2_override"]

#: plans kept per process (a model has a few shapes per layer kind)
CACHED = 64
_plans: "OrderedDict[tuple, _Plan]" = OrderedDict()
_lock = Lock()


@lru_cache(maxsize=256)
def call_dims(geo: Tuple[int, ...], batch: int, heads: int, dim: int, dim_v: int) -> torch.Tensor:
    """:func:`~tplayers.ops.na_geometry.kernel_dims` of a call shape, built once (the kernels only
    read it; a fresh int64 tensor per call cost ~0.03-0.05 ms of a cold 1-D call)."""
    return kernel_dims(geo, batch, heads, dim, dim_v)


def forward_direct(dims: torch.Tensor, lanes: int) -> bool:
    """Whether :func:`~tplayers.ops.na_cpu.c_forward` runs without a plan, reading q, k, v in place
    (``na_forward_1d``, ``na_cpu_direct_fwd.c``) for the kernel's ``dims`` on ``lanes`` elements per
    vector: 1-D calls (one query and key row), D and Dv multiples of the lanes (at most 16 vectors),
    windows of at most one vector (``kernel <= lanes``: at 1-D 1x4096 h4 d32, k7 measured 1.22-1.61x
    the planes forward, k33 0.89-1.08x: benchmarks/na_direct.py). ``TPLAYERS_NA_DIRECT``: ``0`` off,
    ``all`` every window up to 256 slots (the benchmark's A/B)."""
    _, _, hq, _, hk, _, d, dv, kh, kw, _ = dims.tolist()
    flag = os.environ.get("TPLAYERS_NA_DIRECT", "").strip()
    shape_ok = hq == hk == kh == 1 and d % lanes == 0 and dv % lanes == 0 and max(d, dv) <= 16 * lanes
    return shape_ok and flag != "0" and kw <= (256 if flag == "all" else lanes)


def backward_direct(dims: torch.Tensor, lanes: int) -> bool:
    """Whether :func:`~tplayers.ops.na_cpu.c_backward` runs without a plan, reading q, k, v and dO in
    place (``na_backward_1d``, ``na_cpu_direct_bwd.c``): the calls :func:`forward_direct` runs with its
    default (1-D, head dims multiples of the lanes, windows of at most one vector; at 1-D 1x4096 h4 d32
    k7: benchmarks/na_target.py). ``TPLAYERS_NA_DIRECT=0``: the planes backward."""
    _, _, hq, _, hk, _, d, dv, kh, kw, _ = dims.tolist()
    if os.environ.get("TPLAYERS_NA_DIRECT", "").strip() == "0":
        return False
    return hq == hk == kh == 1 and d % lanes == 0 and dv % lanes == 0 and max(d, dv) <= 16 * lanes and kw <= lanes


def forward_line(dims: torch.Tensor, lanes: int) -> bool:
    """Whether the planes forward of :func:`~tplayers.ops.na_cpu.c_forward` runs ``na_forward_line``
    (``na_cpu_line.c``: query and key planes, values read in place, the output written in place) for
    the kernel's ``dims`` on ``lanes`` elements per vector: 1-D calls (one query and key row) with Dv a
    multiple of the lanes (at most 16 vectors); asked for calls that do not run :func:`forward_direct`.
    ``TPLAYERS_NA_LINE=0``: ``na_forward`` instead (the A/B of ``benchmarks/na_target.py``'s shapes)."""
    _, _, hq, _, hk, _, _, dv, kh, _, _ = dims.tolist()
    if os.environ.get("TPLAYERS_NA_LINE", "").strip() == "0":
        return False
    return hq == hk == kh == 1 and dv % lanes == 0 and dv <= 16 * lanes


def backward_line(dims: torch.Tensor, lanes: int) -> bool:
    """Whether the planes backward of :func:`~tplayers.ops.na_cpu.c_backward` runs ``na_backward_line``
    (``na_cpu_line_bwd.c``: the scores of consecutive blocks sharing key loads, dQ written in place,
    dK / dV added in place by the pixel route) for the kernel's ``dims`` on ``lanes`` elements per
    vector: 1-D calls (one query and key row) with D and Dv multiples of the lanes (at most 8 vectors,
    the pixel route's registers); asked for calls that do not run :func:`backward_direct`.
    ``TPLAYERS_NA_LINE=0``: ``na_backward`` instead (as for :func:`forward_line`)."""
    _, _, hq, _, hk, _, d, dv, kh, _, _ = dims.tolist()
    if os.environ.get("TPLAYERS_NA_LINE", "").strip() == "0":
        return False
    return hq == hk == kh == 1 and d % lanes == 0 and dv % lanes == 0 and max(d, dv) <= 8 * lanes


def declare(lib: ctypes.CDLL) -> None:
    """The plan entry points' ctypes signatures on a freshly loaded kernel ``lib``."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.na_forward_1d.argtypes = [ptr] * 8 + [ctypes.c_double, ctypes.c_long, ctypes.c_long, i32]
    lib.na_forward_1d.restype = None
    lib.na_backward_1d.argtypes = [ptr] * 13 + [ctypes.c_double, i32, i32, i32]
    lib.na_backward_1d.restype = None
    lib.na_forward_line.argtypes = [ptr] * 5 + [ptr, ptr, ptr, ctypes.c_double, ptr, ptr, i32, i32, i32, ptr]
    lib.na_forward_line.restype = None
    lib.na_backward_line.argtypes = [ptr] * 11 + [ptr, ptr, ptr, ctypes.c_double, ptr, ptr, i32, i32, i32, ptr]
    lib.na_backward_line.restype = None
    lib.na_line_blocks.argtypes, lib.na_line_blocks.restype = [ptr, ptr, ptr], i32
    lib.na_row_order.argtypes, lib.na_row_order.restype = [ptr, ptr, ptr, ptr], i32
    lib.na_plan.argtypes, lib.na_plan.restype = [ptr, ptr, ptr, i32], ptr
    lib.na_plan_free.argtypes, lib.na_plan_free.restype = [ptr], None
    lib.na_plan_scratch.argtypes, lib.na_plan_scratch.restype = [ptr, ptr], ctypes.c_long


class _Plan:
    """One C plan: its pointer and its scratch elements per worker; freed with the object."""

    def __init__(self, lib: ctypes.CDLL, dims: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, backward: int):
        self.lib = lib
        self.ptr = ctypes.c_void_p(lib.na_plan(_p(dims), _p(rows), _p(cols), int(backward)))
        self.scratch = int(lib.na_plan_scratch(_p(dims), self.ptr))

    def __del__(self):
        if getattr(self, "ptr", None) is not None and self.ptr.value:
            self.lib.na_plan_free(self.ptr)
            self.ptr = None


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def l2_override() -> Optional[int]:
    """``TPLAYERS_NA_L2``: the L2 cache size in bytes that the plans budget for instead of the host's
    (a plan cuts rows into column chunks past a quarter of it: tests run the plans of a 512 KiB or a
    2 MiB L2 on any host); ``None`` where unset. ``ValueError`` naming it unless a positive integer."""
    raw = os.environ.get("TPLAYERS_NA_L2", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"TPLAYERS_NA_L2 must be a positive number of bytes or unset, got {raw!r}")
    return int(raw)


def plan(lib: ctypes.CDLL, key: Tuple, dims: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, backward: int):
    """The plan of ``lib`` for a call (``key``: everything ``dims`` / ``rows`` / ``cols`` are made
    from: the geometry list, batch, heads, head dims), built on first use; ``backward`` 0 (forward),
    1 (backward with dK / dV) or 2 (without). The cache (:func:`l2_override`) it budgets for is part
    of its key."""
    full = (id(lib), key, int(backward), l2_override())
    with _lock:
        found = _plans.get(full)
        if found is not None:
            _plans.move_to_end(full)
            return found
    made = _Plan(lib, dims, rows, cols, backward)
    with _lock:
        _plans[full] = made
        while len(_plans) > CACHED:
            _plans.popitem(last=False)
    return made
