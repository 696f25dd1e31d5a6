"""Triton kernels (installed as ``tplayers.kernels``). Imported only by ``tplayers.ops``."""
