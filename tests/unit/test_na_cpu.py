"""The compiled CPU kernel of na2d (tplayers/ops/na_cpu.c): it builds wherever a C compiler is on
PATH, agrees with the brute-force oracle and with the tile kernel (fp64 tight, fp32 loose), on
random configurations forward and backward; the cache is safe under concurrent builds; the
TPLAYERS_NA_KERNEL switch and the fall-back without a compiler."""

import itertools
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from na_cases import isas_this_host_runs, na_on_subwindow
from na_oracle import assert_out_and_grads, at_thread_counts, brute_na, brute_na2d

import tplayers
from tplayers.ops import na_cpu, na_dispatch
from tplayers.ops.na_engine import neighborhood_attention
from tplayers.ops.na_geometry import Axis, geometry_args

TIGHT = dict(rtol=1e-10, atol=1e-12)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_c_kernel_is_available_where_a_compiler_is():
    """With a compiler on PATH the kernel builds for both dtypes and na2d uses it by default (so
    the C runs of the oracle tests cannot silently fall back)."""
    assert shutil.which(os.environ.get("CC") or "cc") is not None, "no C compiler on this machine"
    for dtype in (torch.float32, torch.float64):
        lib = na_cpu.load_library(dtype)
        assert lib.na_forward and lib.na_backward
        assert na_cpu.use_c_kernel(torch.zeros(1, dtype=dtype), (7, 7))
    assert not na_cpu.use_c_kernel(torch.zeros(1, dtype=torch.bfloat16), (7, 7))  # bf16: the tile kernel


def test_an_installed_package_ships_every_kernel_source():
    """pyproject.toml's package data matches every file the kernel build reads (na_cpu.SOURCES: the
    C units and the headers they include), so a non-editable install can compile the kernel; SOURCES
    names every na_cpu file (its hash keys the build cache) and UNITS every C unit (each is compiled)."""
    import fnmatch
    import re

    with open(os.path.join(REPO, "pyproject.toml")) as f:
        section = f.read().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    patterns = re.findall(r'"([^"]+)"', re.search(r'^"tplayers\.ops" = \[(.*)\]$', section, re.M).group(1))
    for path in na_cpu.SOURCES:
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path.name} is not in package data {patterns}"
    files = {p.name for p in na_cpu.SOURCE.parent.glob("na_cpu*.[ch]")}
    assert files <= {p.name for p in na_cpu.SOURCES}, files - {p.name for p in na_cpu.SOURCES}
    units = {p.name for p in na_cpu.SOURCE.parent.glob("na_cpu*.c")}
    assert units == {p.name for p in na_cpu.UNITS}, units ^ {p.name for p in na_cpu.UNITS}


@pytest.mark.parametrize("seed", range(3))
def test_random_configurations_with_bias_and_offsets_fp64(seed, monkeypatch):
    """Kernels 3..13, dilation, causal per dim, non-square sizes from just above kernel*dilation to
    over two 16-query blocks, batch and heads > 1, head_dim != value dim, the bias table, and
    q/k offsets (a query sub-window with the key span it needs, as the domain-parallel layer
    passes them): output and the gradients of q, k, v and the table against the oracle."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    rng = random.Random(4200 + seed)
    for case in range(4):
        kernel = (rng.randint(3, 13), rng.randint(3, 13))
        dilation = tuple(rng.choice([1, 1, 2, 3]) if kk <= 5 else rng.choice([1, 2]) if kk <= 7 else 1 for kk in kernel)
        causal = (rng.random() < 0.3, rng.random() < 0.3)
        h, w = (kk * d + rng.choice([0, 1, 3, 9, 21]) for kk, d in zip(kernel, dilation))
        batch, heads, dim, dim_v = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 5)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q, k = (torch.randn(batch, h, w, heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
        v = torch.randn(batch, h, w, heads, dim_v, generator=gen, dtype=torch.float64)
        rpb = torch.randn(heads, 2 * kernel[0] - 1, 2 * kernel[1] - 1, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        scale = rng.choice([None, 0.3])
        ref = brute_na2d(*ref_in[:3], kernel, dilation, causal, scale, rpb=ref_in[3])
        if case % 2:  # the whole image
            q0, q1, c0, c1 = 0, h, 0, w
        else:  # a sub-window and its keys
            q0, q1 = sorted(rng.sample(range(h + 1), 2))
            c0, c1 = sorted(rng.sample(range(w + 1), 2))
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = na_on_subwindow(ins, (h, w), kernel, dilation, causal, (q0, q1, c0, c1), scale=scale)
        where = f"kernel {kernel} dilation {dilation} causal {causal} size {(h, w)} q {(q0, q1, c0, c1)}"
        assert_out_and_grads(out, ref[:, q0:q1, c0:c1], ins, ref_in, gen, where, **TIGHT)


@pytest.mark.parametrize("l2", [None, 1 << 19, 2 << 20])
def test_fp32_matches_tile_kernel_and_fp64_oracle(l2, monkeypatch):
    """fp32 on the C kernel (its own exp, 16 lanes) against the fp64 oracle and the fp32 tile
    kernel: the benchmark shape's kernel and head dim on a smaller image, with borders and bias;
    on the host's plans and on those of a 512 KiB L2 (the backward's rows in column chunks, dK / dV
    added in place: every gradient was wrong there on such a host) and of a 2 MiB one (one chunk)."""
    if l2 is not None:
        monkeypatch.setenv("TPLAYERS_NA_L2", str(l2))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 21, 37, 2, 32, generator=gen) for _ in range(3))
    rpb = torch.randn(2, 13, 13, generator=gen)
    cot = torch.randn(2, 21, 37, 2, 32, generator=gen)
    results = {}
    for choice in ("c", "torch"):
        monkeypatch.setenv("TPLAYERS_NA_KERNEL", choice)
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = neighborhood_attention(
            *ins[:3], (7, 7), (1, 1), (False, False), global_size=(21, 37), rel_pos_bias=ins[3]
        )
        (out * cot).sum().backward()
        results[choice] = [out] + [t.grad for t in ins]
    ref_in = [t.double().requires_grad_() for t in (q, k, v, rpb)]
    ref = brute_na2d(*ref_in[:3], (7, 7), rpb=ref_in[3])
    (ref * cot.double()).sum().backward()
    for i, name in enumerate(("out", "dq", "dk", "dv", "drpb")):
        expect = (ref if i == 0 else ref_in[i - 1].grad).float()
        for choice in ("c", "torch"):
            torch.testing.assert_close(
                results[choice][i], expect, rtol=2e-4, atol=2e-5, msg=lambda m: f"{name} ({choice}): {m}"
            )


def test_threads_split_planes_identically(monkeypatch):
    """With several torch threads the planes are split over Python threads; results (and the
    bias gradient, summed over per-thread partials: rounding only) are those of one thread."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 9, 18, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    rpb = torch.randn(3, 5, 5, generator=gen, dtype=torch.float64)

    def run():
        ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
        out = neighborhood_attention(*ins[:3], (3, 3), (1, 1), (False, False), global_size=(9, 18), rel_pos_bias=ins[3])
        out.square().sum().backward()
        return [out] + [t.grad for t in ins]

    results = at_thread_counts(run)
    for a, b in zip(results[0][:4], results[1][:4]):
        assert torch.equal(a, b)
    torch.testing.assert_close(results[0][4], results[1][4], rtol=1e-12, atol=1e-12)


def test_switch_values_and_errors(monkeypatch):
    q = torch.randn(1, 5, 5, 1, 2)
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "torch")
    assert not na_cpu.use_c_kernel(q, (3, 3))
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "C ")
    assert na_cpu.use_c_kernel(q, (3, 3))
    with pytest.raises(RuntimeError, match=r"TPLAYERS_NA_KERNEL=c.*got torch.float32 on cpu, kernel \(65, 65\)"):
        na_cpu.use_c_kernel(q, (65, 65))  # more window slots than the kernel holds
    assert na_cpu.use_c_kernel(q.half(), (3, 3), torch.float32)  # fp16 / bf16 run the fp32 kernel
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "gemm")
    assert not na_cpu.use_c_kernel(q, (3, 3))
    assert na_dispatch.choose_kernel(q, (3, 3)) == "gemm"
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "")
    assert na_dispatch.choose_kernel(q, (65, 65)) == "torch"  # off the C kernel: the tile kernel
    assert na_dispatch.choose_kernel(q.bfloat16(), (3, 3)) == "c"  # computed in fp32 on the C kernel
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "fast")
    with pytest.raises(
        ValueError, match="TPLAYERS_NA_KERNEL must be 'flex', 'c', 'gemm', 'torch' or unset, got 'fast'"
    ):
        tplayers.na2d(q, q, q, 3)


def _python_env(env: dict) -> dict:
    """This process's environment with ``env`` on top and the repository and tests/ importable."""
    return {**os.environ, **env, "PYTHONPATH": REPO + os.pathsep + os.path.join(REPO, "tests")}


def _run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=_python_env(env), capture_output=True, text=True, timeout=300
    )


BUILD_AND_CHECK = """
    import torch, tplayers
    from na_oracle import brute_na2d
    from tplayers.ops import na_cpu
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 7, 2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(tplayers.na2d(q, k, v, 3), brute_na2d(q, k, v, (3, 3)), rtol=1e-10, atol=1e-12)
    print("USED_C", na_cpu.use_c_kernel(q, (3, 3)))
"""


def test_concurrent_first_builds_compile_once_and_share_one_cached_file(tmp_path):
    """Three processes needing the kernel at once in an empty cache (the ranks of a torchrun job
    on a fresh machine): the units are compiled and linked once (one process builds under the
    lock, the others wait and load its file), all three run the C kernel, one file per dtype stays
    (named by the hash), no temporary or lock file is left; a fourth process reuses it. The
    compiler is a wrapper that logs each compile and link. (The base-ISA build: the quickest to
    compile, 12 s against 20 s for AVX-512 on a 2-vCPU Xeon.)"""
    real_cc = shutil.which(os.environ.get("CC") or "cc")
    assert real_cc is not None, "the C kernel's tests need a C compiler on PATH"
    cache, log = tmp_path / "cache", tmp_path / "cc.log"
    wrapper = tmp_path / "cc-logged"
    wrapper.write_text(
        f'#!/bin/sh\ncase "$1" in --version) ;; *) echo "$PPID $*" >> {log} ;; esac\nexec {real_cc} "$@"\n'
    )
    wrapper.chmod(0o755)
    env = {"TPLAYERS_CACHE": str(cache), "TPLAYERS_NA_KERNEL": "c", "TPLAYERS_NA_ISA": "base", "CC": str(wrapper)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(BUILD_AND_CHECK)],
            env=_python_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "USED_C True" in out
    calls = log.read_text().splitlines()
    compiles = [c for c in calls if " -c " in c]
    links = [c for c in calls if " -shared " in c]
    assert len(compiles) == len(na_cpu.UNITS) and len(links) == 1 and len(calls) == len(na_cpu.UNITS) + 1, calls
    assert len({c.split()[0] for c in calls}) == 1, calls  # every call from one builder process
    files = sorted(os.listdir(cache))
    assert len(files) == 1 and files[0].startswith("na_cpu_f64_") and files[0].endswith(".so"), files
    stamp = os.stat(cache / files[0]).st_mtime_ns
    done = _run_python(BUILD_AND_CHECK, env)
    assert done.returncode == 0 and "USED_C True" in done.stdout, done.stderr
    assert os.stat(cache / files[0]).st_mtime_ns == stamp and sorted(os.listdir(cache)) == files
    assert len(log.read_text().splitlines()) == len(calls)  # the fourth process compiled nothing


def test_the_build_lock_excludes_a_second_holder_and_falls_back_where_locks_fail(tmp_path, monkeypatch):
    """``_build_lock`` (the lock one of several processes builds under): a second process cannot take
    it while it is held and takes it once released; the lock file is gone afterwards; where the file
    system refuses ``flock`` the build goes on unlocked (concurrent builds stay safe)."""
    import fcntl

    lock = tmp_path / ".entry.lock"
    probe = textwrap.dedent(f"""
        import fcntl, os
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("TOOK")
        except BlockingIOError:
            print("BUSY")
    """)
    with na_cpu._build_lock(lock):
        assert lock.exists()
        held = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert held.stdout.strip() == "BUSY", held.stdout + held.stderr
    assert not lock.exists()
    free = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert free.stdout.strip() == "TOOK", free.stdout + free.stderr

    def refused(fd, op):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(fcntl, "flock", refused)
    ran = []
    with na_cpu._build_lock(tmp_path / ".other.lock"):
        ran.append(True)
    assert ran == [True] and sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock"]  # the probe's own file


def test_without_a_compiler_falls_back_or_raises_when_forced(tmp_path):
    env = {"TPLAYERS_CACHE": str(tmp_path), "CC": "no-such-compiler-tplayers", "TPLAYERS_NA_KERNEL": ""}
    done = _run_python(BUILD_AND_CHECK, env)
    assert done.returncode == 0, done.stderr
    assert "USED_C False" in done.stdout and "no-such-compiler-tplayers" in done.stderr  # the warning
    forced = _run_python(BUILD_AND_CHECK, {**env, "TPLAYERS_NA_KERNEL": "c"})
    assert forced.returncode != 0
    assert "RuntimeError: the C na2d kernel needs a C compiler: 'no-such-compiler-tplayers'" in forced.stderr
    assert os.listdir(tmp_path) == []


def test_a_unit_that_fails_to_compile_raises_with_its_command_and_leaves_nothing(tmp_path, monkeypatch):
    """The units compile side by side (na_cpu.UNITS): one failing unit raises with its command and
    the compiler's message, and the cache keeps no library, object or temporary file. (A stand-in
    compiler: it fails on the 1-D backward's unit, writes an empty object for the others.)"""
    cc = tmp_path / "cc-fails-on-one-unit"
    cc.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--version*) echo fake-cc 1.0; exit 0 ;; *na_cpu_direct_bwd.c*) echo "boom: bad unit" >&2; exit 1 ;; esac\n'
        'while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n'
    )
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("TPLAYERS_CACHE", str(cache))
    with pytest.raises(RuntimeError, match=r"(?s)failed to compile \(.*na_cpu_direct_bwd\.c\).*boom: bad unit"):
        na_cpu._load.__wrapped__(torch.float64, "base")
    assert os.listdir(cache) == []


def test_only_q_needs_grad_and_an_expanded_grad_out(monkeypatch):
    """Backward without dk/dv (only q requires grad: the kernel skips them) and with the stride-0
    gradient of ``.sum()`` (read through its strides): dq equals the all-gradients run's."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 9, 23, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    qa = q.clone().requires_grad_()
    tplayers.na2d(qa, k, v, (3, 5), (2, 1), (False, True)).sum().backward()
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = brute_na2d(*ins, (3, 5), (2, 1), (False, True))
    ref.sum().backward()
    torch.testing.assert_close(qa.grad, ins[0].grad, **TIGHT)


def test_head_dims_of_whole_vectors_fp64(monkeypatch):
    """Head dims that are whole multiples of the vector (fp64: 8 lanes) take the in-register
    transposes of q/k/v/dO and of out/dq/dk/dv; rows wider than two blocks, a bias table."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 6, 35, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 6, 35, 2, 8, generator=gen, dtype=torch.float64)
    rpb = torch.randn(2, 5, 9, generator=gen, dtype=torch.float64)
    ins = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, rpb)]
    out = neighborhood_attention(*ins[:3], (3, 5), (1, 1), (False, False), global_size=(6, 35), rel_pos_bias=ins[3])
    ref = brute_na2d(*ref_in[:3], (3, 5), rpb=ref_in[3])
    assert_out_and_grads(out, ref, ins, ref_in, gen, "d16/dv8", **TIGHT)


@pytest.mark.parametrize("isa", isas_this_host_runs())
def test_gradients_streamed_past_the_caches_match_the_oracle(isa, monkeypatch):
    """The backward writes dq / dk / dv with non-temporal stores where a vector (AVX-512) or two
    (AVX2) make a whole 64-byte line that starts on a line, with plain stores elsewhere (each build
    this host runs): the planes backward on head dims whose pixels start on and off lines (2-D d24,
    fp32: 288-byte pixels) with heads that share a line written by different threads, and the 1-D
    direct backward's dq (d32); fp32 against the fp64 oracle and fp64 tight; equal at 1 and 3
    threads. (fp64 and the 1-D case have aligned destinations only; the base build stores plainly.
    Streamed columns that a later chunk adds to: test_na_cpu_tiles' long rows in chunks.)"""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_ISA", isa)
    cases = (((2, 7, 37, 3, 24), (3, 5), (1, 2)), ((2, 70, 2, 32), (7,), (1,)))
    for (shape, kernel, dilation), dtype in itertools.product(cases, (torch.float64, torch.float32)):
        gen = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
        rank = len(kernel)

        def run():
            ins = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
            out = neighborhood_attention(*ins, kernel, dilation, (False,) * rank, global_size=shape[1 : 1 + rank])
            out.backward(torch.ones_like(out))
            return [out] + [t.grad for t in ins]

        results = at_thread_counts(run)
        for a, b in zip(results[0], results[1]):
            assert torch.equal(a, b)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = brute_na(*ref_in, kernel, dilation=dilation)
        ref.backward(torch.ones_like(ref))
        tol = TIGHT if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
        for name, a, b in zip(("out", "dq", "dk", "dv"), results[0], [ref] + [t.grad for t in ref_in]):
            torch.testing.assert_close(a.double(), b.detach(), **tol, msg=lambda m: f"{name} {shape} {dtype}: {m}")


def test_nan_propagates_exactly_like_the_oracle(monkeypatch):
    """A NaN in one query makes exactly that query's output NaN, a NaN key exactly the outputs of
    the queries whose window holds it (the oracle's pattern; the tile kernel spreads a NaN key over
    its whole tile, since -inf + NaN is NaN)."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 8, 21, 1, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    q[0, 2, 3, 0, 5] = float("nan")
    k[0, 6, 17, 0, 1] = float("nan")
    got = torch.isnan(tplayers.na2d(q, k, v, 3))
    expect = torch.isnan(brute_na2d(q, k, v, (3, 3)))
    assert expect.any() and torch.equal(got, expect)


def test_nan_outside_a_causal_window_stays_within_the_kernel_size(monkeypatch):
    """With is_causal the masked slots are read and weighted 0, so a NaN key or value just outside
    a query's causal window may make its output NaN (docs/neighborhood-attention.md): every NaN of
    the oracle is NaN here, and every extra NaN is within the kernel size of the NaN input."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    for width, causal in ((16, (False, True)), (21, (True, True))):
        for pos in (0, 1, width // 2, width - 1):
            for which in (1, 2):
                gen = torch.Generator().manual_seed(pos)
                qkv = [torch.randn(1, 5, width, 1, 16, generator=gen, dtype=torch.float64) for _ in range(3)]
                qkv[which][0, 2, pos, 0, 3] = float("nan")
                got = torch.isnan(tplayers.na2d(*qkv, 3, is_causal=causal))[0, :, :, 0].any(-1)
                expect = torch.isnan(brute_na2d(*qkv, (3, 3), causal=causal))[0, :, :, 0].any(-1)
                where = f"width {width} causal {causal} NaN in {'kv'[which - 1]} at {pos}"
                assert expect.any() and not (expect & ~got).any(), where
                for i, j in (got & ~expect).nonzero().tolist():
                    assert abs(i - 2) <= 2 and abs(j - pos) <= 2, (where, i, j)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_qkv_views_are_read_in_place_and_bitwise_equal(dtype, monkeypatch):
    """q, k, v as views of one qkv tensor (pixels 3 heads * D apart, as NeighborhoodAttention makes
    them): the planes kernels read them through their strides, forward and backward (the strides
    handed to the kernels are the views'), and the output and the gradients equal the contiguous
    run's bit for bit: 2-D with dilation and causal, 3-D, a wide 1-D window (the line kernel) and
    the 1-D direct kernel (dense copies: its reads are dense); the plane kernels on views directly
    too."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    seen = []
    real = na_cpu._kernel_inputs

    def spy(*args):  # records the strides each kernel call was handed (None: dense)
        got = real(*args)
        seen.append(got[3])
        return got

    monkeypatch.setattr(na_cpu, "_kernel_inputs", spy)
    gen = torch.Generator().manual_seed(11)
    cases = [
        (2, (12, 23), 5, dict(dilation=(1, 2), is_causal=(True, False))),
        (3, (6, 7, 9), 3, {}),
        (1, (300,), 33, {}),
    ]
    cases.append((1, (200,), 7, {}))
    for rank, size, kk, extra in cases:
        fn = getattr(tplayers, f"na{rank}d")
        qkv = torch.randn(2, *size, 3, 4, 16, generator=gen, dtype=torch.float64).to(dtype)
        views = qkv.unbind(rank + 1)
        dense = [t.clone().requires_grad_() for t in views]
        assert not views[0].is_contiguous()
        direct = rank == 1 and kk <= na_cpu.lanes(torch.float32 if dtype == torch.bfloat16 else dtype)
        seen.clear()
        with torch.no_grad():
            out = fn(*views, kk, **extra)
        strided = [s for s in seen if s is not None]
        assert not strided if direct else strided and strided[0][1] == 3 * 4 * 16, (rank, seen)
        ref = fn(*dense, kk, **extra)
        assert torch.equal(out, ref), (rank, dtype)
        seen.clear()
        leaf = qkv.clone().requires_grad_()
        trained = fn(*leaf.unbind(rank + 1), kk, **extra)
        assert (
            all(s is None for s in seen) if direct else len(seen) == 1 and seen[0] is not None
        )  # in place with grad too
        cot = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
        got = torch.autograd.grad(trained, leaf, cot)[0].unbind(rank + 1)
        want = torch.autograd.grad(ref, dense, cot)
        assert torch.equal(trained, ref) and all(torch.equal(a, b) for a, b in zip(got, want)), (rank, dtype)
    # the plane kernels themselves on views (forward and backward), against dense inputs
    geo = geometry_args([Axis(9, 3, 1, 1, 0, 0, 9, 0, 9, 4), Axis(20, 5, 1, 1, 0, 0, 20, 0, 20, 4)], 1 << 17, 1 << 15)
    qkv = torch.randn(2, 180, 3, 4 * 16, generator=gen, dtype=torch.float64).to(dtype)
    views, dense = qkv.unbind(2), [t.contiguous() for t in qkv.unbind(2)]
    seen.clear()
    out = na_cpu.c_forward(*views, None, geo, 0.25, 4)
    cot = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    got = na_cpu.c_backward(cot, *views, None, out, geo, 0.25, 4)
    assert len(seen) == 2 and all(s is not None for s in seen)  # both kernels read the views in place
    ref = na_cpu.c_forward(*dense, None, geo, 0.25, 4)
    want = na_cpu.c_backward(cot, *dense, None, ref, geo, 0.25, 4)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(got[:3], want[:3]))


@pytest.mark.parametrize("raw", ["lots", "-5", "0", "1.5e6"])
def test_a_bad_l2_override_is_refused(raw, monkeypatch):
    """TPLAYERS_NA_L2 other than a positive number of bytes: ValueError naming it, before any plan."""
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", "c")
    monkeypatch.setenv("TPLAYERS_NA_L2", raw)
    q = torch.randn(1, 9, 10, 1, 8)
    with pytest.raises(ValueError, match="TPLAYERS_NA_L2 must be a positive number of bytes"):
        tplayers.na2d(q, q, q, 3)
