import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import shutil  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(params=["c", "gemm", "torch"])
def na_kernel(request, monkeypatch):
    """Runs a test once on each CPU kernel of na2d: the compiled C kernel, the GEMM-tiled kernel and
    the torch tile kernel (``TPLAYERS_NA_KERNEL``). The C run is skipped only where no C compiler is on PATH; with one,
    ``=c`` makes a failed build an error, never a silent fall-back."""
    if request.param == "c" and shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler on PATH: the C na2d kernel cannot be built here")
    monkeypatch.setenv("TPLAYERS_NA_KERNEL", request.param)
    return request.param


#: the peer packages the tests build models from, as each test module's source names them (or the
#: helper module it imports does), with the module that imports the part the tests use
PEERS = {
    "monai": "monai.networks.nets",
    "timm": "timm",
    "segmentation_models_pytorch": "segmentation_models_pytorch",
    "diffusers": "diffusers",
    "transformers": "transformers",
    "neuralop": "neuralop",
}
HELPERS = ("zoo_models", "hf_util", "hf_registry", "fno_models")


def pytest_collection_finish(session):
    """Import, in this process, the peers that the collected test modules use, before any test forks
    its ranks (tests/harness.py forks them from here): every forked rank inherits them instead of
    importing its own copy (``monai.networks.nets`` alone took 3-4 s of CPU per rank on a 2-vCPU
    Xeon; the zoo's monai, timm and smp runs fork 18 ranks). A run of tests that name no peer
    imports none. ``TPLAYERS_TEST_PRELOAD=0`` turns it off."""
    if os.environ.get("TPLAYERS_TEST_PRELOAD", "1") == "0":
        return
    used = " ".join(path.read_text(encoding="utf-8") for path in {item.path for item in session.items})
    for helper in HELPERS:
        if helper in used:
            with open(os.path.join(os.path.dirname(__file__), helper + ".py"), encoding="utf-8") as f:
                used += f.read()
    for name, module in PEERS.items():
        if name in used:
            importlib.import_module(module)
