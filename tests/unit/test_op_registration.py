"""The ``tplayers::`` custom ops: importing tplayers (every module of it) registers nothing; the first
use registers them, once; later uses (and explicit repeated calls) find them in place.

Each check runs in a fresh interpreter, so no other test's compile has registered anything before it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import importlib, pkgutil
import torch
import tplayers

def ours():
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("tplayers::"))

for m in pkgutil.walk_packages(tplayers.__path__, "tplayers."):
    if m.name != "tplayers.checkpoint.__main__":
        importlib.import_module(m.name)
from tplayers.ops.registry import registered
assert ours() == [] and registered() == (), (ours(), registered())
"""


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_import_registers_nothing_and_the_first_compile_registers_once():
    out = _run("""
        import torch._dynamo as dynamo
        def f(q, k, v):
            return tplayers.na2d(q, k, v, 3)

        q, k, v = (torch.randn(1, 6, 7, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        want = f(q, k, v)
        assert ours() == [], "an eager call registers nothing"
        names = ["tplayers::na2d_tiles", "tplayers::na2d_tiles_backward"]
        for _ in range(2):  # the second compile (a fresh trace) finds the ops registered
            dynamo.reset()
            got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
            assert torch.equal(got, want)
            got.sum().backward()
            assert ours() == names and list(registered()) == names, (ours(), registered())
        print("ok")
    """)
    assert out.strip() == "ok"


def test_explicit_registration_is_idempotent():
    out = _run("""
        from tplayers.comm.collectives import ensure_collective_ops
        from tplayers.comm.halo import ensure_halo_ops
        from tplayers.layers._conv_fn import _ensure_conv_ops
        from tplayers.ops.na_compile import ensure_na_ops

        for _ in range(3):
            assert ensure_collective_ops() and ensure_halo_ops() and _ensure_conv_ops() and ensure_na_ops()
        want = sorted(["tplayers::all_reduce", "tplayers::all_gather", "tplayers::halo_pad",
                       "tplayers::halo_adjoint", "tplayers::halo_conv_backward", "tplayers::na2d_tiles",
                       "tplayers::na2d_tiles_backward"])
        assert ours() == want and sorted(registered()) == want, (ours(), registered())
        print("ok")
    """)
    assert out.strip() == "ok"


def test_registry_docstring_example():
    out = _run("""
        import doctest
        import tplayers.ops.registry as registry

        result = doctest.testmod(registry)
        assert result.attempted >= 4 and result.failed == 0, result
        assert ours() == [], "the example registers under its own namespace only"
        print("ok")
    """)
    assert out.strip() == "ok"
