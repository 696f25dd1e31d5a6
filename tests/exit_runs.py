"""Run a script RUNS times on RANKS ranks and report how each rank exited (helper of test_mesh_exit.py).

    python tests/exit_runs.py SCRIPT RANKS RUNS OUTDIR

Starting RANKS x RUNS interpreters that each import torch and tplayers would take minutes on two
cores, so this process imports them once and forks every rank of every run. Each rank gets the
environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, OMP_NUM_THREADS=1),
runs SCRIPT as the module ``__main__`` (its globals live until the interpreter finalizes, as a
script's do) and then ends the way a script does: through interpreter finalization, atexit
hooks included. Prints one JSON line per run: ``{"run", "rcs", "outputs"}``.
"""

import json
import os
import socket
import sys

import torch  # noqa: F401  (imported once, before forking)

import tplayers  # noqa: F401

script, ranks, runs, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with open(script) as f:
    code = compile(f.read(), script, "exec")
is_rank = False
for run in range(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = []
    for rank in range(ranks):
        log = os.path.join(out_dir, f"run{run}-rank{rank}.log")
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            torch.set_num_threads(1)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            is_rank = True
            break
        children.append((pid, log))
    if is_rank:
        break
    rcs = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, _ in children]
    outputs = [open(log, errors="replace").read()[-3000:] for _, log in children]
    print(json.dumps({"run": run, "rcs": rcs, "outputs": outputs}), flush=True)

if is_rank:
    del run, rank, children, log, pid, fd, s, port  # the script's namespace starts clean
    __file__ = script
    exec(code, globals())  # as __main__; then this interpreter finalizes like the script's would
