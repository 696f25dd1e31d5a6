"""The examples run end to end under torchrun on 2 CPU ranks (short settings)."""

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_tp_transformer_example():
    out = _torchrun("tp_transformer.py", "--steps", "10")
    assert "parity step 1" in out and "done" in out
    assert "plan on a mesh of 2 ranks" in out
