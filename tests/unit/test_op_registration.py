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


def test_import_leaves_dynamo_unloaded_until_a_domain_region_is_made():
    """``import tplayers`` (every module) does not import Dynamo (about 1.2 s of a 2 s import on a
    2-vCPU Xeon): :func:`~tplayers.ops.registry.constant_result` marks the ``ensure_*`` functions and
    the layout priming as ``torch.compiler.assume_constant_result`` does (same attributes), and the
    refusals' graph breaks (:class:`~tplayers.ops.registry.GraphBreak`) are built when a domain region
    is made; an eager tensor-parallel layer never loads it."""
    out = _run("""
        import sys
        assert "torch._dynamo" not in sys.modules, "import tplayers loaded Dynamo"
        from tplayers.ops.registry import constant_result

        def mine():
            return 1

        def public():
            return 1

        constant_result(mine)
        marks = {k: v for k, v in vars(mine).items()}
        assert "torch._dynamo" not in sys.modules
        torch.compiler.assume_constant_result(public)
        assert marks == dict(vars(public)) and marks, (marks, vars(public))
        print("ok")
    """)
    assert out.strip() == "ok"
    out = _run("""
        import sys
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        layer = tplayers.ColumnParallelLinear(4, 6)
        layer(torch.randn(2, 4))
        assert "torch._dynamo" not in sys.modules, "an eager tensor-parallel layer loaded Dynamo"
        model = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.ReLU())
        tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2,))})
        assert "torch._dynamo" in sys.modules, "a domain region builds its refusals"
        from tplayers.region.compiled import refuse_routed, refuse_unchecked
        assert refuse_routed._disabled is not None and refuse_unchecked._disabled is not None
        dist.destroy_process_group()
        print("ok")
    """)
    assert out.strip() == "ok"
