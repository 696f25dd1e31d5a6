"""Runs documentation code blocks one after another on this torchrun rank (helper of test_docs.py).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/docs_runner.py JOBS.json LOGDIR

JOBS.json lists jobs ``{"id", "script", "argv", "timeout"}``: each script (a block written to a
file) runs as ``__main__`` with ``sys.argv = argv``, in the script's directory, in a fresh
namespace; the default dtype is reset between blocks. Every rank writes its output to
LOGDIR/rank<R>.log, framed by ``@@@ BEGIN <i>`` / ``@@@ END <i>`` lines. A block that raises (or
runs past its timeout: faulthandler dumps every thread and exits) ends this rank with exit code 1,
and torchrun then stops the others; test_docs.py reads the logs to name the block.
"""

import faulthandler
import json
import os
import runpy
import sys
import traceback


def main():
    jobs_path, log_dir = sys.argv[1], sys.argv[2]
    rank = os.environ.get("RANK", "0")
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    with open(jobs_path) as f:
        jobs = json.load(f)
    import torch
    import torch.distributed as dist

    for i, job in enumerate(jobs):
        print(f"@@@ BEGIN {i} {job['id']}", flush=True)
        os.chdir(os.path.dirname(job["script"]))
        sys.argv = list(job["argv"])
        torch.set_default_dtype(torch.float32)
        faulthandler.dump_traceback_later(job["timeout"], exit=True, file=log)
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except BaseException:  # SystemExit too: a block must run to its end
            traceback.print_exc(file=log)
            print(f"@@@ FAILED {i}", flush=True)
            log.flush()
            os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():  # keep the ranks in step between blocks
            dist.barrier()
        print(f"@@@ END {i}", flush=True)


if __name__ == "__main__":
    main()
