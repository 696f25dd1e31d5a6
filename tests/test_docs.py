"""The code in README.md and docs/*.md runs as written (issue 34).

Every ```python block is either a complete script or marked, on its first line, as
``# fragment of: <path>`` naming the complete file it comes from (which must exist). Complete
blocks run under ``python -m torch.distributed.run --standalone --nproc-per-node N``: N is 2 unless
the block's comments name a launch (``torchrun --nproc-per-node 4``; ``torchrun --nproc-per-node 2
ckpt.py save`` ... ``then: torchrun --nproc-per-node 3 ckpt.py load`` runs the block as ckpt.py
with those arguments, in that order, in one directory). To stay within a couple of minutes on two
cores, the blocks that share a launch run one after another in one torchrun process
(tests/docs_runner.py: each as ``__main__`` in a fresh namespace and its own directory, the
default dtype reset between them); ``TPLAYERS_DOCS_SEPARATE=1`` gives every block its own torchrun.
A failure names the block's file, line and heading and shows every rank's output for it.

Commands (```bash blocks, and inline ``torchrun ...`` / ``python ...`` spans in the prose): every
repository script they name exists and takes every ``--flag`` they pass (its source defines it),
every torchrun flag is torchrun's, every pip extra and constraints file exists; examples/demo.sh,
which the README's first command runs, is checked the same way. The two commands of
docs/domain-parallel.md and docs/region-guard.md (an example each, about 8 s) are run as written;
the README's install-and-test commands are not (CI runs exactly those), nor are benchmarks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
RUNNER = os.path.join(ROOT, "tests", "docs_runner.py")
BLOCK_TIMEOUT_S = 90  # per block (a few tens of seconds each on a loaded 2-core box)
OPTIONAL = ("transformers", "diffusers", "monai")  # the test extra installs them; missing: those blocks skip

FRAGMENT_RE = re.compile(r"^# fragment of: (\S+)")
LAUNCH_RE = re.compile(r"torchrun (?:--standalone )?--nproc-per-node (\d+)(?: (\w+\.py)((?: [\w./-]+)*))?")


@dataclass
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    heading: str
    lang: str
    code: str
    launches: list = field(default_factory=list)  # [(ranks, argv)]

    def __str__(self):
        return f"{self.file}:{self.line} [{self.heading}]"

    @property
    def fragment_of(self):
        m = FRAGMENT_RE.match(self.code)
        return m.group(1) if m else None


def doc_blocks(lang=None):
    out = []
    for rel in DOC_FILES:
        heading, fence = "(top)", None
        with open(os.path.join(ROOT, rel)) as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, 1):
            if fence is None:
                m = re.match(r"^```(\S*)\s*$", line)
                if m:
                    fence, body = (i, m.group(1)), []
                elif line.startswith("#"):
                    heading = line.lstrip("#").strip()
            elif line.rstrip() == "```":
                out.append(Block(rel, fence[0], heading, fence[1], "\n".join(body) + "\n"))
                fence = None
            else:
                body.append(line)
        assert fence is None, f"{rel}:{fence[0]}: unclosed code fence"
    return [b for b in out if lang is None or b.lang == lang]


def launches(block):
    """[(ranks, script name or None, args)] named in the block's comments; default one 2-rank run."""
    found = []
    for line in block.code.splitlines():
        if "#" in line:
            for m in LAUNCH_RE.finditer(line.split("#", 1)[1]):
                found.append((int(m.group(1)), m.group(2), (m.group(3) or "").split()))
    return found or [(2, None, [])]


def python_blocks():
    return doc_blocks("python")


def complete_blocks():
    return [b for b in python_blocks() if b.fragment_of is None]


# ---------------------------------------------------------------------------------------------
# python blocks: complete or marked


def test_every_python_block_is_complete_or_a_marked_fragment():
    blocks = python_blocks()
    assert len(blocks) >= 20, f"found only {len(blocks)} python blocks: is the parser broken?"
    for b in blocks:
        compile(b.code, str(b), "exec")  # a syntax error in any block, fragment or not
        target = b.fragment_of
        if target is not None:
            assert os.path.isfile(os.path.join(ROOT, target)), f"{b}: fragment of {target!r}, which does not exist"
        else:
            names = {name for _, name, _ in launches(b)}
            assert len(names) == 1, f"{b}: its launches name different scripts {names}"
    assert any(b.fragment_of is None for b in blocks)


# ---------------------------------------------------------------------------------------------
# python blocks: run


def _needs_missing_module(block):
    for mod in OPTIONAL:
        if re.search(rf"^\s*(import|from) {mod}\b|^\s*import .*\b{mod}\b", block.code, re.M):
            if importlib.util.find_spec(mod) is None:
                return mod
    return None


def _segments(log_dir, ranks, index):
    """Each rank's output for job ``index`` (from its BEGIN line), or its whole log's tail."""
    out = []
    for r in range(ranks):
        path = os.path.join(log_dir, f"rank{r}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else "(no log)"
        start = text.find(f"@@@ BEGIN {index} ") if index is not None else -1
        seg = text[start:] if start >= 0 else text
        out.append(f"--- rank {r} ---\n{seg[-4000:]}")
    return "\n".join(out)


def _run_group(jobs, ranks, work_dir, tag):
    """Run ``jobs`` in one torchrun; returns [(job, message)] for the jobs that failed. After a
    failure the rest are relaunched, so every failing block is reported."""
    failures, start = [], 0
    while start < len(jobs):
        todo = jobs[start:]
        log_dir = os.path.join(work_dir, f"logs-{tag}-{start}")
        os.makedirs(log_dir)
        jobs_path = os.path.join(log_dir, "jobs.json")
        with open(jobs_path, "w") as f:
            json.dump([{k: j[k] for k in ("id", "script", "argv", "timeout")} for j in todo], f)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            RUNNER,
            jobs_path,
            log_dir,
        ]
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        )
        try:
            res = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=sum(j["timeout"] for j in todo) + 60
            )
            rc, launcher = res.returncode, (res.stdout + res.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, launcher = "timeout", str(e)
        logs = [
            open(os.path.join(log_dir, f"rank{r}.log"), errors="replace").read()
            if os.path.exists(os.path.join(log_dir, f"rank{r}.log"))
            else ""
            for r in range(ranks)
        ]
        ended = [max((int(m) for m in re.findall(r"^@@@ END (\d+)$", t, re.M)), default=-1) for t in logs]
        done = min(ended) + 1  # jobs every rank finished
        if rc == 0 and done == len(todo):
            break
        if done == len(todo):  # every block ended, the process did not exit cleanly
            failures.append(
                (
                    todo[-1],
                    f"exited with {rc} after its last block:\n{_segments(log_dir, ranks, None)}"
                    f"\n--- launcher ---\n{launcher}",
                )
            )
            break
        failures.append(
            (
                todo[done],
                f"failed (torchrun exit {rc}) at {ranks} ranks:\n"
                f"{_segments(log_dir, ranks, done)}\n--- launcher ---\n{launcher}",
            )
        )
        start += done + 1
    return failures


@pytest.mark.timeout(900)  # the launches' own timeouts bound it; about 40 s batched, 4 min one launch each
def test_python_blocks_run_as_written(tmp_path):
    """Every complete block runs with its launches and its asserts hold (see the module docstring)."""
    blocks, skipped = complete_blocks(), []
    phases = {}  # phase -> ranks -> [job]
    failed_blocks = set()
    for i, b in enumerate(blocks):
        missing = _needs_missing_module(b)
        if missing:
            skipped.append(f"{b} (needs {missing})")
            continue
        runs = launches(b)
        block_dir = tmp_path / f"block{i:02d}"
        block_dir.mkdir()
        script = block_dir / (runs[0][1] or "block.py")
        script.write_text(b.code)
        for phase, (ranks, name, args) in enumerate(runs):
            job = {
                "id": str(b),
                "script": str(script),
                "argv": [script.name, *args],
                "timeout": BLOCK_TIMEOUT_S,
                "block": i,
            }
            if os.environ.get("TPLAYERS_DOCS_SEPARATE") == "1":  # every block its own torchrun
                phases.setdefault((phase, i), {}).setdefault(ranks, []).append(job)
            else:
                phases.setdefault(phase, {}).setdefault(ranks, []).append(job)
    failures = []
    t0 = time.time()
    for phase in sorted(phases, key=lambda p: p if isinstance(p, tuple) else (p, -1)):
        for ranks, jobs in sorted(phases[phase].items()):
            jobs = [j for j in jobs if j["block"] not in failed_blocks]  # a later launch needs the earlier one
            tag = f"p{phase if not isinstance(phase, tuple) else '-'.join(map(str, phase))}-n{ranks}"
            for job, msg in _run_group(jobs, ranks, str(tmp_path), tag):
                failed_blocks.add(job["block"])
                failures.append(f"{job['id']} ({' '.join(job['argv'])}): {msg}")
    print(
        f"{len(blocks)} complete blocks, {len(blocks) - len(skipped)} run in {time.time() - t0:.0f} s; "
        f"skipped: {skipped or 'none'}"
    )
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------------------
# commands


INLINE_RE = re.compile(r"`((?:torchrun|python3?|\.venv/bin/python|bash|pip) [^`]+)`")


def _commands():
    """(where, command) for every command of a ```bash block and every inline command span."""
    out = []
    for b in doc_blocks("bash"):
        text = re.sub(r"\\\n\s*", " ", b.code)
        for line in text.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out += [(str(b), c.strip()) for c in re.split(r"&&|;|\|\|", line) if c.strip()]
    for rel in DOC_FILES:
        text = open(os.path.join(ROOT, rel)).read()
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # prose only
        for m in INLINE_RE.finditer(text.replace("\n", " ")):
            out.append((f"{rel} (inline)", m.group(1)))
    return out


def _script_source(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _check_flags(where, cmd, flags, source, what):
    for flag in flags:
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{where}: `{cmd}`: {what} takes no {flag}"


def _torchrun_options():
    from torch.distributed.run import get_args_parser

    return {opt: action.nargs != 0 for opt, action in get_args_parser()._option_string_actions.items()}


def _check_command(where, cmd, torchrun_opts):
    env_assign = re.compile(r"^[A-Z_]+=")
    tokens = [t.strip("[]") for t in shlex.split(cmd)]
    tokens = [t for t in tokens if t and not env_assign.match(t)]
    prog = os.path.basename(tokens[0])
    if prog == "torchrun" or tokens[1:3] == ["-m", "torch.distributed.run"]:
        rest = tokens[1:] if prog == "torchrun" else tokens[3:]
        i = 0
        while i < len(rest) and rest[i].startswith("-"):
            opt = rest[i].split("=", 1)[0]
            assert opt in torchrun_opts, f"{where}: `{cmd}`: torchrun has no option {opt}"
            i += 2 if torchrun_opts[opt] and "=" not in rest[i] else 1
        assert i < len(rest), f"{where}: `{cmd}`: no script"
        _check_script(where, cmd, rest[i], rest[i + 1 :])
    elif prog.startswith("python"):
        if tokens[1] == "-m":
            module, args = tokens[2], tokens[3:]
            if module.startswith("tplayers"):
                pkg = os.path.join(ROOT, *module.split("."))
                assert os.path.isdir(pkg), f"{where}: `{cmd}`: no package {module}"
                source = "".join(_script_source(os.path.join(pkg, f)) for f in os.listdir(pkg) if f.endswith(".py"))
                for sub in [a for a in args[:1] if not a.startswith("-")]:
                    assert f'"{sub}"' in source, f"{where}: `{cmd}`: {module} has no command {sub}"
                _check_flags(where, cmd, [a.split("=")[0] for a in args if a.startswith("--")], source, module)
            elif module == "venv":
                pass
            else:
                assert importlib.util.find_spec(module) is not None, f"{where}: `{cmd}`: no module {module}"
        else:
            _check_script(where, cmd, tokens[1], tokens[2:])
    elif prog == "bash":
        _check_script(where, cmd, tokens[1], tokens[2:])
    elif prog == "pip" or tokens[1:2] == ["install"]:
        _check_pip(where, cmd, tokens)
    else:
        raise AssertionError(f"{where}: `{cmd}`: unknown command {prog}")


def _check_pip(where, cmd, tokens):
    pyproject = _script_source("pyproject.toml")
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^(\w+) = \[", section, re.M))
    for i, t in enumerate(tokens):
        if t == "-c":
            assert os.path.isfile(os.path.join(ROOT, tokens[i + 1])), f"{where}: `{cmd}`: no {tokens[i + 1]}"
        for extra in re.findall(r"\[(\w+)\]", t):
            assert extra in extras, f"{where}: `{cmd}`: pyproject.toml has no extra {extra!r} ({sorted(extras)})"


def _check_script(where, cmd, script, args):
    if "/" not in script:  # a user's own script (train.py, ckpt.py): nothing to check
        return
    assert os.path.isfile(os.path.join(ROOT, script)), f"{where}: `{cmd}`: no file {script}"
    _check_flags(where, cmd, [a.split("=")[0] for a in args if a.startswith("--")], _script_source(script), script)


def test_commands_name_existing_scripts_and_flags():
    opts = _torchrun_options()
    commands = _commands()
    assert len(commands) >= 20, commands
    for where, cmd in commands:
        if cmd.startswith(("pip ", ".venv/bin/pip ")):
            _check_pip(where, cmd, shlex.split(cmd))
        else:
            _check_command(where, cmd, opts)
    # the README's demo command runs examples/demo.sh: its commands must name real scripts and flags
    demo = _script_source("examples/demo.sh").replace('"$CKPT"', "CKPT").replace("$PY ", "python ")
    demo = demo.replace("$RUN ", "python -m torch.distributed.run --standalone --nproc-per-node 2 ")
    lines = [ln.strip() for ln in demo.splitlines() if ln.strip().startswith("python ")]
    assert len(lines) >= 10, lines
    for line in lines:
        _check_command("examples/demo.sh", line, opts)


@pytest.mark.parametrize(
    "where, command",
    [
        ("docs/domain-parallel.md", "torchrun --nproc-per-node 2 examples/domain_cnn.py"),
        ("docs/region-guard.md", "torchrun --nproc-per-node 2 examples/unet.py"),
    ],
)
def test_cheap_bash_blocks_run(where, command):
    assert (where, command) in [(w.split(":")[0], c) for w, c in _commands()], f"{where} no longer has `{command}`"
    args = shlex.split(command)
    cmd = [sys.executable, "-m", "torch.distributed.run", *args[1:]]  # torchrun, from this interpreter
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)),
    )
    assert res.returncode == 0, f"{where}: `{command}` exited {res.returncode}:\n{(res.stdout + res.stderr)[-4000:]}"
