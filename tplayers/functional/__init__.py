"""Functional twins for hand-written code: ``torch.nn.functional`` calls on domain-sharded data.

Each function takes local tensors (this rank's slice along the sharded dims) plus the mesh and the
sharded dims (``shard_dims[i]`` is the tensor dim sharded over mesh dim ``i``), and returns exactly
this rank's slice of what the serial function returns on the gathered input, values and gradients.
Inside a domain region the region guard routes the plain ``torch`` / ``F`` calls here by itself.

- reductions: :func:`sum`, :func:`mean`, :func:`amax`, :func:`amin`, :func:`var`, :func:`std`, :func:`norm`;
- window ops: :func:`interpolate`, max / avg / adaptive pools, :func:`pad`;
- :func:`scaled_dot_product_attention`: ``F.scaled_dot_product_attention`` over tokens sharded on
  all ranks of a mesh (ring or all-gather of K/V, online-softmax merge); :func:`token_positions`
  gives the global indices of the local tokens of a sharded image for causal / masked attention;
- :func:`multi_head_attention_forward`: ``F.multi_head_attention_forward`` with the sequence sharded;
- :mod:`tplayers.functional.fft`: ``torch.fft`` transforms over sharded dims (``fft``, ``rfft2``, ``irfftn``, ...);
  :func:`spectral_conv2d`: a Fourier neural operator's spectral convolution, only the kept modes moving.

Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

    import torch, torch.nn.functional as F, tplayers
    import tplayers.functional as TF
    mesh = tplayers.init_mesh()
    full = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    x = tplayers.shard(full, 2, mesh)
    y = TF.max_pool2d(TF.interpolate(x, scale_factor=2, mode="bilinear", mesh=mesh), 2, mesh=mesh)
    m = TF.mean(y, dim=(2, 3), mesh=mesh)         # (2, 3), the same on every rank
    torch.testing.assert_close(m, F.max_pool2d(F.interpolate(full, scale_factor=2, mode="bilinear"), 2).mean((2, 3)))

Each function's docstring gives its arguments and a runnable example; the design is in
docs/design.md (domain parallelism, the region guard, full attention).
"""

from tplayers.attention.mha import multi_head_attention_forward
from tplayers.attention.sdpa import scaled_dot_product_attention, token_positions
from tplayers.domain.reductions import amax, amin, mean, norm, std, sum, var  # noqa: A004
from tplayers.functional import fft
from tplayers.functional.spectral import spectral_conv2d
from tplayers.functional.window import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool1d,
    adaptive_max_pool2d,
    adaptive_max_pool3d,
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    interpolate,
    max_pool1d,
    max_pool2d,
    max_pool3d,
    pad,
)

__all__ = [
    "fft",
    "spectral_conv2d",
    "sum",
    "mean",
    "amax",
    "amin",
    "var",
    "std",
    "norm",
    "interpolate",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "pad",
    "scaled_dot_product_attention",
    "token_positions",
    "multi_head_attention_forward",
]
