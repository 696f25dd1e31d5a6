"""Which kernel runs one neighborhood-attention call, and its default tiles.

Four kernels compute the same thing (NATTEN's window; fp rounding may differ):

* ``"flex"``: torch's ``flex_attention`` with a neighborhood block mask
  (:mod:`tplayers.ops.na_flex`), compiled, on CUDA tensors where
  :func:`~tplayers.ops.na_flex.flex_applies` (measured 1.4-10x the tile kernel forward, 1.9-14x
  forward + backward, on an H100); forced on the CPU it runs eagerly, forward only (tests);
* ``"c"``: the compiled C kernel (:mod:`tplayers.ops.na_cpu`), fp32/fp64 CPU tensors, where it
  builds; its backward is the GEMM kernel's where the C backward does not apply
  (:func:`~tplayers.ops.na_cpu.backward_in_c`: wide column windows on short rows, except 1-D
  calls with head dims of whole vectors, which the C line backward runs);
* ``"gemm"``: the GEMM-tiled torch kernel (:mod:`tplayers.ops.na_gemm`), any device and dtype;
* ``"torch"``: the torch tile kernel (:mod:`tplayers.ops.na_kernel`), any device and dtype.

``TPLAYERS_NA_KERNEL`` (``flex`` / ``c`` / ``gemm`` / ``torch``) forces one (``flex`` and ``c``
raise where they cannot run). Unset, :func:`choose_kernel` takes flex where it applies, the C
kernel where it applies (measured 1.3-3.3x the torch kernels forward on every shape class of
``benchmarks/na.py``), else the tile kernel: the GEMM kernel measured 0.83-0.97x of it forward on every class with as many key heads as query
heads (same tiles; both are batched small GEMMs), but with grouped key/value heads (GQA/MQA) it
runs the query heads of a group against one gathered key tile as one taller GEMM and no expanded
copy of K and V: 1.28-1.31x the tile kernel forward and 1.33x backward (2-D k7, 8 heads over 2
or 1 key heads), so off the C kernel grouped calls take the GEMM kernel.
The GEMM kernel is the default in one place: the C kernel's backward where that is not fused
(wide column windows: 0.99-1.07x the tile kernel's backward at 1-D k33, 1.04-1.24x at 2-D k19). Figures:
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from tplayers.ops import na_cpu, na_flex, na_layout
from tplayers.ops.na_geometry import eager_cached

__all__ = ["choose_kernel", "default_tile", "compute_dtype", "DTYPES", "check_dtype"]

#: the element types neighborhood attention takes; bf16 / fp16 run in fp32 (:func:`compute_dtype`)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The element type the kernels compute in for inputs of ``dtype``: bf16 and fp16 inputs run
    the fp32 kernels (the C kernel reads bf16 itself, the others convert on the way in; the output
    rounded back: fp32 scores, softmax state and accumulation, gradients summed in fp32), measured
    1.6-3.8x faster forward than the GEMM kernel's native bf16 matmuls and 0.95-1.08x the fp32 C
    kernel itself (``benchmarks/na_bf16.py``); fp32 and fp64 run as they are. The flex kernel (the
    CUDA default) takes bf16 / fp16 inputs as they are, with this fp32 inside the kernel
    (:mod:`tplayers.ops.na_flex`)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def check_dtype(q: torch.Tensor, who: str, name: str = "q") -> None:
    """``TypeError`` naming ``name`` unless ``q`` has one of :data:`DTYPES`."""
    if q.dtype not in DTYPES:
        raise TypeError(
            f"{who}: {name} must be float32, float64, bfloat16 or float16 (bf16 / fp16 computed in fp32), got {q.dtype}"
        )


def choose_kernel(
    q: torch.Tensor,
    kernel: Sequence[int],
    grouped: bool = False,
    v: Optional[torch.Tensor] = None,
    rel_pos_bias: Optional[torch.Tensor] = None,
) -> str:
    """``"flex"``, ``"c"``, ``"gemm"`` or ``"torch"`` for a call on ``q`` (and ``v``, when given:
    the flex kernel is considered only then) with per-axis ``kernel``, computed in
    :func:`compute_dtype` of ``q``'s; ``grouped``: fewer key/value heads than query heads
    (GQA/MQA). See the module docstring; ``RuntimeError`` from ``TPLAYERS_NA_KERNEL=c`` or ``flex``
    where that kernel cannot run."""
    choice = na_cpu.kernel_choice()
    if choice == "flex":
        if rel_pos_bias is not None or na_flex.flex_module() is None:
            why = "it takes no relative-position bias" if rel_pos_bias is not None else "this torch has none"
            raise RuntimeError(f"TPLAYERS_NA_KERNEL=flex: the flex_attention kernel cannot run this call: {why}")
        return "flex"
    if (
        choice == "auto"
        and v is not None
        and q.device.type == "cuda"  # the flex default's first condition, without its message
        and na_flex.flex_applies(q, v, compute_dtype(q.dtype), rel_pos_bias is not None, math.prod(kernel)) is None
    ):
        return "flex"
    merged = (math.prod(kernel[:-1]), kernel[-1])
    if na_cpu.use_c_kernel(q, merged, compute_dtype(q.dtype)):
        return "c"
    if choice in ("gemm", "torch"):
        return choice
    return "gemm" if grouped else "torch"


def default_tile(kernel: Sequence[int]) -> Tuple[int, ...]:
    """Queries per tile per axis, for the GEMM kernel and the tile kernel alike (the C kernel
    ignores them, but its backward may run the GEMM kernel), chosen by measurement
    (``benchmarks/na.py`` and a sweep of both torch kernels, one core, AVX-512 EPYC).

    A tile of ``t`` queries along an axis scores ``t + k - 1`` keys where each query needs ``k``:
    small tiles waste fewer scores, large ones make larger matmuls. For 2-D kernel 7, head_dim
    16-64, 4x4 measured fastest (2x8 and 4x8 close, 8x8 slower); kernels below 5 get 8. In 3-D the
    leading axis takes 1 (a 4x4 tile of one depth slice already scores ``kD x 10 x 10`` keys at
    k7; 2x4x4 measured the same). Where every leading kernel is 1 (1-D calls) the column axis takes
    ``k + 1`` clamped to [16, 32]: at k7 16 measured 1.7x faster than 8 and the tile kernel's former
    4, at k33 16 and 32 equal (the tile kernel's 1-D forward: 1.7x at k7, 1.5x at k33).
    """
    return _default_tile(tuple(kernel))


@eager_cached(64)
def _default_tile(kernel: Tuple[int, ...]) -> Tuple[int, ...]:
    lead = math.prod(kernel[:-1])
    per_axis = [4 if k >= 5 else na_layout.DEFAULT_TILE for k in kernel]
    if len(kernel) >= 3:
        per_axis[: len(kernel) - 2] = [1] * (len(kernel) - 2)
    if lead == 1:
        per_axis[-1] = max(16, min(32, kernel[-1] + 1))
    return tuple(per_axis)
