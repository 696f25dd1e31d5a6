"""Make PyPI's torchvision importable beside the CPU build of torch, for the test environment only.

    python tests/guard_torchvision.py

timm and segmentation_models_pytorch import torchvision. The torchvision wheel pip resolves against
``torch==2.13.0`` (``constraints.txt``) is a CUDA build: its C extension does not load beside the CPU
torch here, so ``torchvision::nms`` and ``torchvision::qnms`` are never defined, and the two
``torch.library.register_fake`` calls for them in ``torchvision/_meta_registrations.py`` raise at
import (``operator torchvision::nms does not exist``), which also breaks every transformers model
import once torchvision is installed. Every other registration in that file is already guarded by
``torchvision.extension._has_ops()``; this script adds the same guard to those two, in the installed
file, and does nothing when torchvision is absent, already imports, or was already guarded. The
library never imports torchvision and never patches anything: this is the README's test command only.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

_ERROR = "operator torchvision::nms does not exist"
_CALLS = ('@torch.library.register_fake("torchvision::nms")', '@torch.library.register_fake("torchvision::qnms")')


def _imports() -> tuple[bool, str]:
    run = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
    return run.returncode == 0, run.stderr


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("guard_torchvision: torchvision not installed, nothing to do")
        return 0
    ok, err = _imports()
    if ok:
        print("guard_torchvision: torchvision imports, nothing to do")
        return 0
    if _ERROR not in err:
        print(f"guard_torchvision: torchvision fails to import for another reason:\n{err}", file=sys.stderr)
        return 1
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    for call in _CALLS:
        if call not in text:
            print(f"guard_torchvision: {call!r} not found in {path}", file=sys.stderr)
            return 1
        op = call.split('"')[1]
        guarded = f"@(torch.library.register_fake({op!r}) if torchvision.extension._has_ops() else (lambda f: f))"
        text = text.replace(call, guarded)
    path.write_text(text)
    ok, err = _imports()
    if not ok:
        print(f"guard_torchvision: still fails after guarding {path}:\n{err}", file=sys.stderr)
        return 1
    print(f"guard_torchvision: guarded the nms / qnms fake registrations in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
