"""Run a function on N gloo ranks (CPU processes) and report the failing rank's traceback.

    results = run_ranks(fn, world_size=3, args=(...), timeout=30)

``fn(rank, world_size, *args)`` runs in each forked process after the default
process group is up (``file://`` rendezvous, gloo, collective timeout of
``timeout`` seconds). Its return values come back in rank order. If any rank
raises, the test fails with that rank's traceback; the other ranks get a short
grace period and are then killed, so no process is ever left hanging. A rank
that neither finishes nor fails within ``timeout`` seconds fails the test too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta

_CTX = mp.get_context("fork")


def _worker(fn, rank, world_size, init_file, timeout, args, kwargs, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        # Every rank fully connected before any returns (a rank that finished and tore its group
        # down while a peer was still connecting would fail that peer's init).
        dist.barrier()
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass


class RankFailure(AssertionError):
    """A rank raised; the message holds its traceback."""


def run_ranks(fn, world_size: int, args=(), kwargs=None, timeout: float = 60.0, grace: float = 3.0):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks."""
    kwargs = kwargs or {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = _CTX.Queue()
        procs = [
            _CTX.Process(
                target=_worker, args=(fn, r, world_size, init_file, timeout, args, kwargs, results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs, errors = {}, {}
        deadline = time.monotonic() + timeout
        try:
            while len(outputs) + len(errors) < world_size:
                now = time.monotonic()
                if errors:
                    deadline = min(deadline, now + grace)
                remaining = deadline - now
                if remaining <= 0:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 0.5))
                except queue_mod.Empty:
                    if not errors and all(not p.is_alive() for p in procs) and results.empty():
                        break
                    continue
                (outputs if status == "ok" else errors)[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
        if errors:
            # dicts keep arrival order: the first failure reported is the root cause,
            # later ones are usually peers seeing a closed connection.
            first, *others = list(errors)
            msg = f"rank {first} of {world_size} failed:\n{errors[first]}"
            if others:
                msg += f"\n(then ranks {others} failed too; first of them:)\n{errors[others[0]]}"
            raise RankFailure(msg)
        missing = [r for r in range(world_size) if r not in outputs]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            raise RankFailure(f"ranks {missing} of {world_size} did not finish within {timeout}s (exit codes {codes})")
        return [outputs[r] for r in range(world_size)]


def raised(fn):
    """The exception ``fn()`` raised, as ``(type name, message)`` (``ValueError`` / ``TypeError`` only);
    fails if it returned."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    raise AssertionError("expected an error")
