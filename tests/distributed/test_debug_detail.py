"""Tensor-parallel inputs are not compared across ranks per call (that would cost a collective per
step); ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is the documented way to find such a bug, and it reports it.

torch reads the variable when it is imported, so (as a user would) it is set before launch: the
ranks run in a fresh interpreter with it in their environment.
"""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from harness import run_ranks

    def fn(rank, world):
        import torch, tplayers
        mesh = tplayers.init_mesh(device_type="cpu")
        layer = tplayers.RowParallelLinear(8, 4, mesh=mesh)
        x = torch.randn(3 if rank == 1 else 2, layer.weight.shape[1])  # rank 1 got another batch: a user bug
        try:
            layer(x)
        except RuntimeError as e:
            return str(e)
        return "no error"

    if __name__ == "__main__":
        for rank, msg in enumerate(run_ranks(fn, 2, timeout=30)):
            assert "Detected mismatch between collectives" in msg, msg
            assert "TensorShape=[2, 4]" in msg and "TensorShape=[3, 4]" in msg, msg
        print("REPORTED-ON-EVERY-RANK")
    """
)


def test_detail_debug_reports_mismatched_tp_inputs(tmp_path):
    script = tmp_path / "detail.py"
    script.write_text(SCRIPT.format(tests=TESTS))
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and "REPORTED-ON-EVERY-RANK" in proc.stdout, proc.stdout + proc.stderr
