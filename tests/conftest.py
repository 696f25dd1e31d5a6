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
