"""The compiled CPU kernel of neighborhood attention (``na_cpu.c``), built on first use.

:func:`use_c_kernel` decides per call whether :func:`~tplayers.ops.na_engine.neighborhood_attention`
runs the C kernel or one of the torch kernels (:mod:`tplayers.ops.na_dispatch`); all compute
NATTEN's exact window (fp rounding may differ). The C kernel is used for CPU tensors of fp32 /
fp64 when the system C compiler can build it (bf16 ones run the fp32 build, which reads them as
bf16; fp16 ones are converted to fp32 by the engine); ``TPLAYERS_NA_KERNEL=torch`` asks for the tile
kernel, ``=gemm`` for the GEMM-tiled kernel (:mod:`tplayers.ops.na_gemm`), ``=c`` for the C kernel
(an error when it cannot be built or does not apply).

The vector width follows the host (:func:`host_isa`): on AVX-512 CPUs the kernel is built with 16
fp32 / 8 fp64 lanes, on AVX2 ones 8 / 4, elsewhere 4 / 2, so every vector is one register. It
is the default wherever it builds (faster than the torch kernels on both ISAs, forward and
backward: ``benchmarks/na.py``, docs/neighborhood-attention.md, benchmarks/RESULTS.md).

It runs tiles of query rows against the key rows they share (``na_cpu.c``, shipped as source;
plans cached by :mod:`tplayers.ops.na_cpu_plans`); 1-D calls whose window fits one vector read
q, k, v (and dO) in place instead, forward and backward (``na_cpu_direct_fwd.c``, ``na_cpu_direct_bwd.c``,
:func:`~tplayers.ops.na_cpu_plans.forward_direct`, :func:`~tplayers.ops.na_cpu_plans.backward_direct`);
wider 1-D windows run line kernels (``na_cpu_line.c``, ``na_cpu_line_bwd.c``:
:func:`~tplayers.ops.na_cpu_plans.forward_line`, :func:`~tplayers.ops.na_cpu_plans.backward_line`).
On the first CPU call (never at import) it is
compiled with ``$CC`` (else ``cc``), ``-O3 -march=native -fPIC -DNA_LANES=n``
(:func:`build_flags`), its units (:data:`UNITS`) side by side and then linked with ``-shared``
(a 2-vCPU Xeon, fp32: 24 s against 37 s as one unit, same run), once per element type, into
``$TPLAYERS_CACHE`` (else ``~/.cache/tplayers``) under a name hashed from the source, the compiler, its version, the flags
and the CPU's model and flags, written under a temporary name and renamed into place. Processes
that need the same build at once (the ranks of a ``torchrun`` job on a fresh machine) build it
once: one compiles under a lock on the cache entry (``flock``, released by the system if the
process dies), the others wait for it and load its file (:func:`_build_lock`); loaded with ``ctypes`` and called on the tensors' data pointers. With
``torch.get_num_threads() > 1`` the (batch, head) planes are split over that many Python threads
(``ctypes`` releases the GIL during the call).

Example::

    import torch, tplayers
    from tplayers.ops import na_cpu
    q = k = v = torch.randn(1, 9, 9, 2, 4)
    out = tplayers.na2d(q, k, v, 3)          # the C kernel when a compiler is on PATH
    na_cpu.use_c_kernel(q)                   # True then
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from tplayers.ops import na_cpu_plans
from tplayers.ops.na_gemm import gemm_backward
from tplayers.ops.na_geometry import kernel_tables, split_geometry

__all__ = [
    "use_c_kernel",
    "kernel_choice",
    "load_library",
    "cache_dir",
    "c_forward",
    "c_backward",
    "C_KERNELS",
    "host_isa",
    "target_isa",
    "lanes",
    "build_flags",
    "backward_is_fused",
    "backward_in_c",
    "attention_backward",
]

SOURCE = Path(__file__).with_name("na_cpu.c")
#: the kernel's compilation units, compiled side by side and linked into one library (alone on a
#: 2-vCPU Xeon, fp32, AVX-512, on a slow day, 2026-11-27: 14.6, 5.1, 3.7, 9.0, 10.0 and 2.5 s; the
#: pixel routes' kernels are a unit of their own so that they compile beside na_cpu.c, which bounds
#: the build where cores are many)
UNITS = (
    SOURCE,
    *(Path(__file__).with_name(f"na_cpu_{unit}.c") for unit in ("line", "line_bwd", "direct_fwd", "direct_bwd", "pix")),
)
#: every file of the kernel (the hash of the built library covers them all)
SOURCES = (
    *UNITS,
    *(
        Path(__file__).with_name(f"na_cpu_{part}.h")
        for part in ("blocks", "io", "rows", "kv", "plan", "probes", "keys", "pix", "direct", "line")
    ),
)
FLAGS = ("-O3", "-fPIC", "-std=gnu11")
_DTYPES = {torch.float32: ("f32", ()), torch.float64: ("f64", ("-DNA_DOUBLE",))}
#: vector width in bits and the ``-march`` that builds for an ISA that is not the host's own
#: (the host's own is built with ``-march=native``)
ISAS = {"avx512": (512, "skylake-avx512"), "avx2": (256, "haswell"), "base": (128, None)}
#: the window slots per axis the kernel's block tables hold (kernels above it use the tile kernel)
MAX_KERNEL = 255
#: window slots per query (row slots x column slots) the kernel runs: its per-block score vectors
#: live on the stack (3 x slots x 64 bytes); larger windows use the tile kernel
MAX_SLOTS = 4096


def kernel_choice() -> str:
    """``TPLAYERS_NA_KERNEL``: ``"auto"`` (unset or empty), ``"flex"``, ``"c"``, ``"gemm"`` or
    ``"torch"``; ``ValueError`` otherwise. Read on every call (a process may change it)."""
    return _kernel_choice(os.environ.get("TPLAYERS_NA_KERNEL", ""))


@lru_cache(maxsize=16)
def _kernel_choice(raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in ("auto", "flex", "c", "gemm", "torch"):
        raise ValueError(f"TPLAYERS_NA_KERNEL must be 'flex', 'c', 'gemm', 'torch' or unset, got {value!r}")
    return value


def cache_dir() -> Path:
    """Where built kernels are kept: ``$TPLAYERS_CACHE`` or ``~/.cache/tplayers``."""
    return Path(os.environ.get("TPLAYERS_CACHE") or Path.home() / ".cache" / "tplayers")


def _cpu_id() -> str:
    """The CPU's model and feature flags (``-march=native`` builds for this CPU only)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        text += "".join(sorted(set(lines)))
    except OSError:
        pass
    return text


def host_isa(flags: Optional[str] = None) -> str:
    """The widest vector ISA of this CPU the kernel is built for: ``"avx512"`` (AVX-512 F/BW/VL),
    ``"avx2"`` (AVX2 and FMA) or ``"base"`` (anything else: SSE2 on x86-64, NEON on arm64).
    ``flags``: a ``/proc/cpuinfo`` flags line to classify instead of this machine's."""
    if flags is None:
        return _this_host_isa()
    have = set(flags.replace(":", " ").split())
    if {"avx512f", "avx512bw", "avx512vl"} <= have:
        return "avx512"
    if {"avx2", "fma"} <= have:
        return "avx2"
    return "base"


@lru_cache(maxsize=1)
def _this_host_isa() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return host_isa(next((line for line in f if line.startswith("flags")), ""))
    except OSError:
        return "base"


def target_isa() -> str:
    """The ISA the kernel is built for: ``TPLAYERS_NA_ISA`` (``avx512`` / ``avx2`` / ``base``; one
    this CPU runs, so a narrower build can be measured on a wider CPU) or :func:`host_isa`. Read on
    every call, checked once per value."""
    return _target_isa(os.environ.get("TPLAYERS_NA_ISA", ""))


@lru_cache(maxsize=16)
def _target_isa(raw: str) -> str:
    host = host_isa()
    value = raw.strip().lower() or host
    order = list(ISAS)
    if value not in ISAS or order.index(value) < order.index(host):
        raise ValueError(
            f"TPLAYERS_NA_ISA must be one of {order[order.index(host) :]} on this CPU (host ISA {host}), got {value!r}"
        )
    return value


def lanes(dtype: torch.dtype, isa: Optional[str] = None) -> int:
    """Elements per vector the kernel is built with: the ISA's register width over the element
    size (AVX-512: 16 fp32 / 8 fp64, AVX2: 8 / 4, base: 4 / 2)."""
    bits = ISAS[isa or target_isa()][0]
    return bits // (8 * dtype.itemsize)


def build_flags(dtype: torch.dtype, isa: Optional[str] = None) -> Tuple[str, ...]:
    """The compiler flags of the kernel for ``dtype`` on ``isa`` (default :func:`target_isa`)."""
    isa = isa or target_isa()
    march = ISAS[isa][1] if isa != host_isa() else "native"
    arch = () if march is None else (f"-march={march}",)
    return FLAGS + arch + _DTYPES[dtype][1] + (f"-DNA_LANES={lanes(dtype, isa)}",)


def load_library(dtype: torch.dtype, isa: Optional[str] = None) -> ctypes.CDLL:
    """The kernel for ``dtype`` (fp32 / fp64) on ``isa`` (default :func:`target_isa`), compiled on
    first use; ``RuntimeError`` saying why when it cannot be built (no compiler, a compile error)."""
    if dtype not in _DTYPES:
        raise RuntimeError(f"the C na2d kernel supports float32 and float64, got {dtype}")
    return _load(dtype, isa or target_isa())


def _compile(cc_path: str, flags: Tuple[str, ...], target: str) -> None:
    """Compile :data:`UNITS` side by side (one compiler process each) and link them into the shared
    library ``target``; a failure raises with the compiler's message."""
    with tempfile.TemporaryDirectory(prefix=".na_cpu_objects.", dir=os.path.dirname(target)) as objects:
        jobs = []
        for unit in UNITS:
            obj = os.path.join(objects, unit.stem + ".o")
            cmd = [cc_path, *flags, "-c", "-o", obj, str(unit)]
            jobs.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        link = [cc_path, "-shared", "-o", target, *(obj for _, obj, _ in jobs), "-lm"]
        failed = []
        for cmd, _, proc in jobs:
            try:
                err = proc.communicate(timeout=300)[1]
            except subprocess.TimeoutExpired:
                proc.kill()
                err = proc.communicate()[1] + b"\n(timed out after 300 s)"
            if proc.returncode != 0:
                failed.append((cmd, err))
        if not failed:
            done = subprocess.run(link, capture_output=True, timeout=300)
            if done.returncode != 0:
                failed.append((link, done.stderr))
        if failed:
            cmd, err = failed[0]
            raise RuntimeError(
                f"the C na2d kernel failed to compile ({' '.join(cmd)}):\n" + err.decode(errors="replace")[-2000:]
            )


@contextlib.contextmanager
def _build_lock(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (created if absent) while the caller builds; a
    waiter re-checks for the built file once it holds the lock. The holder removes the file on
    release: a process arriving later finds the built library first, and one that opens a new lock
    file in between finds it under that lock. Without ``fcntl`` (not POSIX), or where the file
    system refuses the lock, no lock is taken: concurrent builds are still safe, each renaming an
    identical file into place."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX hosts have it
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some network or FUSE mounts): build unlocked
            pass
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # releases the lock


@lru_cache(maxsize=None)
def _load(dtype: torch.dtype, isa: str) -> ctypes.CDLL:
    """:func:`load_library` for one ISA, cached per process."""
    suffix = _DTYPES[dtype][0]
    cc = os.environ.get("CC") or "cc"
    cc_path = shutil.which(cc)
    if cc_path is None:
        raise RuntimeError(f"the C na2d kernel needs a C compiler: {cc!r} ($CC or cc) is not on PATH")
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    flags = build_flags(dtype, isa)
    try:
        version = subprocess.run([cc_path, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the C na2d kernel: cannot run {cc_path} --version: {exc}") from exc
    digest = hashlib.sha256(
        b"\0".join([source, cc_path.encode(), version, " ".join(flags).encode(), _cpu_id().encode()])
    ).hexdigest()[:24]
    folder = cache_dir()
    target = folder / f"na_cpu_{suffix}_{digest}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with _build_lock(folder / f".{target.name}.lock"):
            if not target.exists():  # not built while this process waited for the lock
                fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
                os.close(fd)
                try:
                    _compile(cc_path, flags, tmp)
                    os.replace(tmp, target)  # atomic: readers never see a partial file
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    ptr, i32, dbl = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.na_scratch.argtypes, lib.na_scratch.restype = [ptr, ptr, ptr, i32], ctypes.c_long
    lib.na_chunks.argtypes, lib.na_chunks.restype = [ptr, ptr, ptr, i32], ctypes.c_int
    lib.na_forward.argtypes = [ptr] * 5 + [ptr, ptr, ptr, dbl, ptr, ptr, i32, i32, i32, ptr]
    lib.na_forward.restype = None
    lib.na_backward.argtypes = [ptr] * 11 + [ptr, ptr, ptr, dbl, ptr, ptr, i32, i32, i32, ptr]
    lib.na_backward.restype = None
    na_cpu_plans.declare(lib)
    return lib


def _build_failure(dtype: torch.dtype) -> Optional[str]:
    """None when the kernel for ``dtype`` builds, else why not (warned once per process and ISA)."""
    return _build_failure_on(dtype, target_isa())


@lru_cache(maxsize=None)
def _build_failure_on(dtype: torch.dtype, isa: str) -> Optional[str]:
    try:
        _load(dtype, isa)
    except RuntimeError as exc:
        if kernel_choice() == "auto":
            warnings.warn(f"tplayers.na2d: using the torch tile kernel on the CPU: {exc}", RuntimeWarning, stacklevel=2)
        return str(exc)
    return None


def use_c_kernel(q: torch.Tensor, kernel: Tuple[int, int] = (1, 1), dtype: Optional[torch.dtype] = None) -> bool:
    """Whether na2d runs the C kernel for ``q`` (see the module docstring for the rule), computing
    in ``dtype`` (default ``q``'s; bf16 / fp16 inputs are computed in fp32).

    ``TPLAYERS_NA_KERNEL=c`` raises ``RuntimeError`` where the C kernel does not apply or cannot
    be built, instead of falling back."""
    choice = kernel_choice()
    if choice in ("torch", "gemm", "flex"):
        return False
    dtype = q.dtype if dtype is None else dtype
    applies = (
        q.device.type == "cpu" and dtype in _DTYPES and max(kernel) <= MAX_KERNEL and kernel[0] * kernel[1] <= MAX_SLOTS
    )
    if not applies:
        if choice == "c":
            raise RuntimeError(
                f"TPLAYERS_NA_KERNEL=c: the C na2d kernel runs fp32/fp64 CPU tensors with kernel "
                f"<= {MAX_KERNEL} and <= {MAX_SLOTS} window slots, got {dtype} on {q.device}, "
                f"kernel {kernel}"
            )
        return False
    if choice == "c":
        load_library(dtype)  # raises, saying why
        return True
    return _build_failure(dtype) is None


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _plane_bounds(planes: int) -> List[Tuple[int, int]]:
    """Plane ranges, one per worker thread (``torch.get_num_threads()`` at most)."""
    workers = max(1, min(torch.get_num_threads(), planes))
    return [(planes * w // workers, planes * (w + 1) // workers) for w in range(workers)]


def _split(lib, backward: int, dims: torch.Tensor, tables, planes: int, key):
    """:func:`_plane_bounds` and the call's plan (its ``scratch``: elements each worker needs;
    ``key``: what ``dims`` and the tables are made from)."""
    return _plane_bounds(planes), na_cpu_plans.plan(lib, key, dims, tables[0], tables[1], backward)


def _kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, direct: bool):
    """``(q, k, v, sx)`` as a C kernel reads pixel-major ``(B, P, heads*C)`` inputs: the 1-D direct
    kernels (``direct``) dense copies and ``sx`` None; the planes kernels any batch / pixel strides
    (e.g. views of one qkv tensor, read in place; a last dim that is not contiguous is copied) and
    ``sx`` their element strides (batch, pixel, head, channel) as the 12 int64s ``open_call`` reads
    (``na_cpu_plan.h``), None where all three are dense (the kernels' own strides)."""
    if direct:
        return q.contiguous(), k.contiguous(), v.contiguous(), None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if all(t.is_contiguous() for t in (q, k, v)):
        return q, k, v, None
    sx = [s for t in (q, k, v) for s in (t.stride(0), t.stride(1), t.shape[2] // heads, 1)]
    return q, k, v, torch.tensor(sx, dtype=torch.int64)


def _kernel_dtype(q: torch.Tensor) -> torch.dtype:
    """The build that runs ``q``: bf16 inputs are read by the fp32 kernel (widened as it loads them)."""
    return torch.float32 if q.dtype == torch.bfloat16 else q.dtype


def c_forward(q, k, v, table, geo: List[int], scale: float, heads: int) -> torch.Tensor:
    """Forward on the C kernel: ``q`` (B, Pq, heads*D), ``k``/``v`` (B, Pk, heads*D|Dv), each with
    its last dim contiguous (any batch and pixel strides: views of one qkv tensor are read in place),
    ``table`` (heads, 2kH-1, 2kW-1) or None -> (B, Pq, heads*Dv). bf16 ``q``, ``k``, ``v`` run the
    fp32 kernel (read as bf16, computed in fp32; the output and ``table`` fp32)."""
    dtype, isa = _kernel_dtype(q), target_isa()
    lib = load_library(dtype, isa)
    batch = q.shape[0]
    shape = (tuple(geo), batch, heads, q.shape[-1] // heads, v.shape[-1] // heads)
    dims = na_cpu_plans.call_dims(*shape)
    rows, cols = kernel_tables(shape[0])
    out = q.new_empty(batch, q.shape[1], v.shape[-1], dtype=dtype)
    tab = None if table is None else table.detach().contiguous()
    nl = lanes(dtype, isa)
    direct = na_cpu_plans.forward_direct(dims, nl)
    q, k, v, sx = _kernel_inputs(q, k, v, heads, direct)
    if direct:  # na_cpu_direct_fwd.c; queries split over the threads, >= 256 each
        tensors, bf, n = (q, k, v, tab, out, dims, rows, cols), int(q.dtype == torch.bfloat16), batch * q.shape[1]
        w = max(1, min(torch.get_num_threads(), n // 256))
        _parallel(
            lambda a, b: lib.na_forward_1d(*map(_ptr, tensors), scale, a, b, bf),
            [(n * i // w, n * (i + 1) // w) for i in range(w)],
        )
        return out
    planes = batch * heads
    bounds, plan = _split(lib, 0, dims, (rows, cols), planes, shape)  # shape: everything dims is made of
    # 1-D windows wider than a vector: consecutive blocks share key loads, output in place (na_cpu_line.c)
    entry = lib.na_forward_line if na_cpu_plans.forward_line(dims, nl) else lib.na_forward

    def work(p0, p1):
        scratch = q.new_empty(plan.scratch, dtype=dtype)
        tensors = (q, k, v, tab, out, dims, rows, cols)
        entry(*map(_ptr, tensors), scale, plan.ptr, _ptr(scratch), p0, p1, int(q.dtype == torch.bfloat16), _ptr(sx))

    _parallel(work, bounds)
    return out


def c_backward(grad_out, q, k, v, table, out, geo: List[int], scale: float, heads: int, want_kv: bool = True):
    """``(dq, dk, dv, dtable)`` of :func:`c_forward`; ``dk``/``dv`` None unless ``want_kv``,
    ``dtable`` None without a table. ``grad_out`` may have any strides (an expanded gradient
    of ``.sum()`` is read in place). bf16 ``q``, ``k``, ``v``: ``grad_out``, ``out`` and the
    gradients are fp32. ``out`` is not read (the kernels take rowsum(dO * O) as the sum of P * dP
    over each window, which they compute anyway); the argument keeps the kernel pair's signature.
    ``q``, ``k``, ``v`` as :func:`c_forward` takes them; the gradients are dense."""
    dtype, isa = _kernel_dtype(q), target_isa()
    lib = load_library(dtype, isa)
    grad_out = grad_out.to(dtype)
    batch = q.shape[0]
    dim_v = v.shape[-1] // heads
    dims = na_cpu_plans.call_dims(tuple(geo), batch, heads, q.shape[-1] // heads, dim_v)
    rows, cols = kernel_tables(tuple(geo))
    try:
        g4 = grad_out.view(batch, q.shape[1], heads, dim_v)
    except RuntimeError:
        g4 = grad_out.contiguous().view(batch, q.shape[1], heads, dim_v)
    tab = None if table is None else table.detach().contiguous()
    planes = batch * heads
    nl = lanes(dtype, isa)
    direct = na_cpu_plans.backward_direct(dims, nl)
    line = not direct and na_cpu_plans.backward_line(dims, nl)  # na_cpu_line_bwd.c
    if (direct or line) and g4.stride(-1) != 1:  # these load dO's channels as vectors
        g4 = g4.contiguous()
    strides = torch.tensor(g4.stride(), dtype=torch.int64)
    q, k, v, sx = _kernel_inputs(q, k, v, heads, direct)
    dq = q.new_empty(q.shape, dtype=dtype)  # dense, whatever q's strides
    dk, dv = (k.new_empty(k.shape, dtype=dtype), v.new_empty(v.shape, dtype=dtype)) if want_kv else (None, None)
    bf = int(q.dtype == torch.bfloat16)
    if direct:  # na_cpu_direct_bwd.c: q, k, v, dO read in place, no plan
        bounds = _plane_bounds(planes)

        def work(p0, p1, dtab):
            tensors = (g4, strides, q, k, v, tab, dq, dk, dv, dtab, dims, rows, cols)
            lib.na_backward_1d(*map(_ptr, tensors), scale, p0, p1, bf)

    else:
        bounds, plan = _split(lib, 1 if want_kv else 2, dims, (rows, cols), planes, (tuple(geo), *dims.tolist()))
        entry = lib.na_backward_line if line else lib.na_backward

        def work(p0, p1, dtab):
            scratch = q.new_empty(plan.scratch, dtype=dtype)
            tensors = (g4, strides, q, k, v, tab, out, dq, dk, dv, dtab, dims, rows, cols)
            entry(*map(_ptr, tensors), scale, plan.ptr, _ptr(scratch), p0, p1, bf, _ptr(sx))

    dtabs = [None if tab is None else torch.zeros_like(tab) for _ in bounds]
    _parallel(work, [(p0, p1, d) for (p0, p1), d in zip(bounds, dtabs)])
    dtable = None if tab is None else sum(dtabs[1:], dtabs[0])
    return dq, dk, dv, dtable


def _parallel(work, jobs) -> None:
    if len(jobs) == 1:
        work(*jobs[0])
        return
    with ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(work, *job) for job in jobs]:
            f.result()


def backward_is_fused(geo: List[int], dtype: torch.dtype) -> bool:
    """Whether the C backward sums a block's dK/dV in registers: the ``kW`` slots of one key row
    (``(kW - 1) * dilation_W`` columns apart) must fit two vectors from the block's first key
    (``(kW - 1) * dW <= lanes``)."""
    col = split_geometry(geo)[0][-1]
    return (col.kernel - 1) * col.dilation <= lanes(dtype)


def backward_in_c(geo: List[int], dtype: torch.dtype) -> bool:
    """Whether :data:`C_KERNELS` run the C backward: where it is fused (:func:`backward_is_fused`)
    or where nearly all query columns are interior (stride 1 and at least ``4 (kW - 1) dW + 2
    lanes`` columns): wider windows sum dK/dV key-centrically there (``key_sums`` in ``na_cpu.c``;
    1-D 4096 k33: 1.3-2.0x the tile kernel's backward, ``benchmarks/na.py``), while in the blocks
    near the borders each slot is a read-modify-write of memory (2-D 48x48 k19, where they are 2 of
    3 blocks (AVX-512) or 4 of 6 (AVX2): 1.0x and 0.48x of the tile kernel's backward), so
    elsewhere the GEMM kernel's backward runs (:mod:`tplayers.ops.na_gemm`)."""
    col = split_geometry(geo)[0][-1]
    wide_ok = col.stride == 1 and col.q_count >= 4 * (col.kernel - 1) * col.dilation + 2 * lanes(dtype)
    return backward_is_fused(geo, dtype) or wide_ok


def attention_backward(grad_out, q, k, v, table, out, geo: List[int], scale, heads, want_kv=True, want_bias=True):
    """``(dq, dk, dv, dtable)`` of :func:`c_forward`: the C backward where :func:`backward_in_c` or
    where it runs ``na_backward_line`` (:func:`~tplayers.ops.na_cpu_plans.backward_line`: 1-D, head
    dims of whole vectors, any stride, dilation and row length: 1-D 1x4096 h4 d32 k33 stride 4
    1.60x, stride 33 1.52x, 1x100 1.61x, causal 8x120 1.75x the GEMM kernel's forward + backward,
    AVX-512), else :func:`~tplayers.ops.na_gemm.gemm_backward` (same values up to fp rounding; bf16
    ``q``, ``k``, ``v`` widened to fp32 for it)."""
    dtype = _kernel_dtype(q)
    dims = na_cpu_plans.call_dims(tuple(geo), q.shape[0], heads, q.shape[-1] // heads, v.shape[-1] // heads)
    if backward_in_c(geo, dtype) or na_cpu_plans.backward_line(dims, lanes(dtype)):
        return c_backward(grad_out, q, k, v, table, out, geo, scale, heads, want_kv=want_kv)
    q, k, v, grad_out = (x.to(dtype).contiguous() for x in (q, k, v, grad_out))
    return gemm_backward(grad_out, q, k, v, table, out, geo, scale, heads, want_kv, want_bias)


#: The compiled C plane kernels (the GEMM kernel's backward where the C one is not fused), for
#: :class:`~tplayers.ops.na_gemm.GeoAttention`.
C_KERNELS = (c_forward, attention_backward)
