"""init_mesh(timeout=...) bounds how long a stalled rank (alive, never joining) blocks its peers,
on a 1-D mesh and on every dim of a 2-D mesh (whose sub-groups torch would otherwise create with
the 30-minute default). Launched with torchrun, as a user would."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist, tplayers
    two_d = os.environ["WORLD_SIZE"] == "4"
    mesh = tplayers.init_mesh((2, 2) if two_d else None, ("dp", "tp") if two_d else ("tp",),
                              device_type="cpu", timeout=timedelta(seconds=2))
    sub = mesh["tp"] if two_d else mesh
    if dist.get_rank() == 1:
        time.sleep(7)          # stalled: alive, never joins the collective
        sys.exit(0)
    if dist.get_rank() != 0:
        sys.exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=sub.get_group())
        print("NO-ERROR", flush=True)
    except RuntimeError as e:
        print(f"RAISED {time.monotonic() - start:.1f} {'Timed out' in str(e)}", flush=True)
    """
)


@pytest.mark.parametrize("world", [2, 4])
def test_stalled_peer_fails_within_the_timeout(tmp_path, world):
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(("RAISED", "NO-ERROR"))), "")
    assert line.startswith("RAISED"), proc.stdout + proc.stderr
    _, seconds, timed_out = line.split()
    # the peer's own timeout fired (not the stalled rank's exit at 7 s closing the connection)
    assert timed_out == "True" and float(seconds) < 5, line
