"""The spectral convolution of a Fourier neural operator on a domain-sharded image, moving only the kept modes.

``spectral_conv2d(x, weights1, weights2, modes1, modes2)`` is the forward of the FNO paper's
``SpectralConv2d`` (Li et al. 2021; neuraloperator's ``SpectralConv`` on 2-D data does the same with
one weight)::

    x_ft = torch.fft.rfft2(x)                                       # (N, Ci, H, W // 2 + 1)
    out_ft = zeros(N, Co, H, W // 2 + 1)
    out_ft[:, :, :modes1, :modes2] = einsum("bixy,ioxy->boxy", x_ft[:, :, :modes1, :modes2], weights1)
    out_ft[:, :, -modes1:, :modes2] = einsum("bixy,ioxy->boxy", x_ft[:, :, -modes1:, :modes2], weights2)
    return torch.fft.irfft2(out_ft, s=(H, W))

on this rank's rows of an H-sharded ``x`` (a W-sharded one is first repartitioned to H). The
decomposition: ``rfft`` along the whole W, keep the first ``modes2`` columns, one all-to-all from
H-sharded to sharded along those columns, ``fft`` along the now whole H, the per-mode products of
the kept rows with this rank's columns of the weights, ``ifft`` along H, one all-to-all back to the
input's rows, zero columns up to ``W // 2 + 1`` and ``irfft`` along W. Only the ``modes2`` kept
columns travel (``N * C * H * modes2`` complex values, each crossing once, each way), not the whole
``W // 2 + 1`` of a distributed ``rfft2``. The weights are replicated: their gradients are summed
over the mesh (every rank holds the serial gradient).

Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

    import torch, tplayers
    import tplayers.functional as TF
    mesh = tplayers.init_mesh()
    torch.manual_seed(0)
    full = torch.randn(2, 3, 12, 10, dtype=torch.float64)
    w1, w2 = (torch.randn(3, 4, 4, 3, dtype=torch.complex128) for _ in range(2))
    y = TF.spectral_conv2d(tplayers.shard(full, 2, mesh), w1, w2, 4, 3, mesh=mesh)
    ft = torch.fft.rfft2(full)
    out = torch.zeros(2, 4, 12, 6, dtype=torch.complex128)
    out[:, :, :4, :3] = torch.einsum("bixy,ioxy->boxy", ft[:, :, :4, :3], w1)
    out[:, :, -4:, :3] = torch.einsum("bixy,ioxy->boxy", ft[:, :, -4:, :3], w2)
    torch.testing.assert_close(tplayers.gather(y, 2, mesh), torch.fft.irfft2(out, s=(12, 10)))
"""

from __future__ import annotations

import contextlib

import torch

from tplayers.comm.agree import exchange_agreed
from tplayers.comm.all_to_all import AllToAllDim, grid_sizes
from tplayers.domain.active import active_guard, stepped_aside
from tplayers.domain.boundary import ReplicatedToSharded
from tplayers.domain.layout import region_layout
from tplayers.functional.fft import _NORMS, _one_dim
from tplayers.mesh import resolve_mesh
from tplayers.sharding import offsets_from_sizes, shard_sizes

__all__ = ["spectral_conv2d"]


def _check(x, weights1, weights2, modes1, modes2, shard_dims, norm, mesh_ndim):
    name = "tplayers.functional.spectral_conv2d"
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.is_complex():
        raise TypeError(f"{name}: x must be a real (N, C, H, W) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    for label, m in (("modes1", modes1), ("modes2", modes2)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{name}: {label} must be a positive int, got {m!r}")
    want = (x.size(1), None, modes1, modes2)
    for label, w in (("weights1", weights1), ("weights2", weights2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or not w.is_complex():
            raise TypeError(f"{name}: {label} must be a complex (C_in, C_out, modes1, modes2) tensor")
        if any(a is not None and a != b for a, b in zip(want, w.shape)) or w.shape != weights1.shape:
            raise ValueError(
                f"{name}: {label} must have shape ({x.size(1)}, C_out, {modes1}, {modes2}) like weights1, "
                f"got {tuple(w.shape)}"
            )
    dims = (shard_dims,) if isinstance(shard_dims, int) and not isinstance(shard_dims, bool) else tuple(shard_dims)
    dims = tuple(d % 4 if isinstance(d, int) else d for d in dims)
    if dims not in (((2,), (3,)) if mesh_ndim == 1 else ((2, 3),)):
        raise ValueError(
            f"{name}: shard_dims must be 2 (H) or 3 (W) on a 1-D mesh, (2, 3) on a 2-D mesh; got {shard_dims!r} "
            f"on a {mesh_ndim}-D mesh"
        )
    if modes2 > x.size(3) // 2 + 1 and dims == (2,):
        raise ValueError(f"{name}: modes2={modes2} exceeds W // 2 + 1 = {x.size(3) // 2 + 1}")
    if norm not in _NORMS:
        raise ValueError(f"{name}: norm must be one of {_NORMS}, got {norm!r}")
    return dims


def spectral_conv2d(x, weights1, weights2, modes1, modes2, *, mesh=None, shard_dims=(2,), norm=None):
    """The FNO ``SpectralConv2d`` forward on this rank's slice of ``x`` (see the module docstring).

    Args:
        x: this rank's rows of a real ``(N, C_in, H, W)`` tensor, sharded along H (``shard_dims=2``,
            any partition) or W (``3``) on a 1-D mesh, or along both (``(2, 3)``) on a 2-D mesh
            (the batch then takes mesh dim 1's sharding while the 1-D form runs over mesh dim 0).
        weights1, weights2: complex ``(C_in, C_out, modes1, modes2)``, replicated (the same on every rank).
        modes1, modes2: the kept modes along H (the first and the last ``modes1`` rows) and W.
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).
        norm: ``torch.fft``'s ``norm`` for both transforms.

    Returns:
        This rank's rows of the serial result ``(N, C_out, H, W)``, sharded like ``x`` (its partition).

    Raises:
        TypeError: ``x`` not a real 4-D tensor, a weight not complex 4-D.
        ValueError: on every rank, bad modes, weight shapes, ``norm`` or ``shard_dims``, ``modes1`` over
            H, or ranks that disagree on any of them or on the unsharded sizes.
    """
    guard = active_guard()  # called inside a region: run unguarded, tag the result
    with stepped_aside(guard) if guard is not None else contextlib.nullcontext():
        y, dims = _agreed(x, weights1, weights2, modes1, modes2, mesh, shard_dims, norm)
    if guard is not None and hasattr(guard, "mark"):
        guard.mark(y, region_layout(y.shape, dims))
    return y


def _agreed(x, weights1, weights2, modes1, modes2, mesh, shard_dims, norm):
    mesh = resolve_mesh(mesh, (1, 2))
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    error, dims = None, (2, 3)[: mesh.ndim]
    try:
        dims = _check(x, weights1, weights2, modes1, modes2, shard_dims, norm, mesh.ndim)
    except (TypeError, ValueError) as e:
        error = e
    ok = error is None
    config = {
        "shard_dims": dims,
        "modes": (modes1, modes2),
        "norm": norm,
        "weights": tuple(weights1.shape) if ok else None,
        "dtype": (str(x.dtype), str(weights1.dtype)) if ok else None,
        "other dims": tuple(-1 if d in dims else int(s) for d, s in enumerate(x.shape)) if ok else (),
    }
    row = [int(x.size(d)) if ok else 0 for d in dims] + [0] * (2 - len(dims))
    name = "tplayers.functional.spectral_conv2d"
    sizes = grid_sizes(exchange_agreed(row, config, groups, name, "spectral.layout", error=error), mesh, name)
    if mesh.ndim == 1:
        return _spectral(x, weights1, weights2, modes1, modes2, dims[0], sizes[0], groups[0], norm), dims
    # H over mesh dim 0, W over mesh dim 1: the batch takes mesh dim 1's sharding (W whole), the 1-D
    # form runs over mesh dim 0, and W's sharding comes back. The weights' gradients are summed over
    # mesh dim 1 here, over mesh dim 0 in the 1-D form.
    g1 = groups[1]
    if g1.size() == 1:
        return _spectral(x, weights1, weights2, modes1, modes2, 2, sizes[0], groups[0], norm), dims
    batch = shard_sizes(x.size(0), g1.size())
    w1, w2 = (ReplicatedToSharded.apply(w, [g1]) if w.requires_grad else w for w in (weights1, weights2))
    y = _spectral(AllToAllDim.apply(x, 3, 0, sizes[1], batch, g1), w1, w2, modes1, modes2, 2, sizes[0], groups[0], norm)
    return AllToAllDim.apply(y, 0, 3, batch, sizes[1], g1), dims


def _spectral(x, w1, w2, m1, m2, dim, sizes, group, norm):
    p, me = group.size(), group.rank()
    if dim == 3 and p > 1:  # W-sharded: to H-sharded first (the whole tensor moves), back at the end
        hs = shard_sizes(x.size(2), p)
        y = _spectral(AllToAllDim.apply(x, 3, 2, sizes, hs, group), w1, w2, m1, m2, 2, hs, group, norm)
        return AllToAllDim.apply(y, 2, 3, hs, sizes, group)
    n, _, hl, width = x.shape
    h = sum(sizes) if p > 1 else hl
    if m1 > h or m2 > width // 2 + 1:
        raise ValueError(
            f"tplayers.functional.spectral_conv2d: modes ({m1}, {m2}) exceed the spectrum ({h}, {width // 2 + 1})"
        )
    if p > 1:
        w1, w2 = (ReplicatedToSharded.apply(w, [group]) if w.requires_grad else w for w in (w1, w2))
    cols = shard_sizes(m2, p)
    c0, cl = offsets_from_sizes(cols)[me], cols[me]
    t = _one_dim(x, torch.fft.rfft, None, 3, norm)[..., :m2]  # (N, Ci, H_local, modes2)
    if p > 1:
        t = AllToAllDim.apply(t, 2, 3, sizes, cols, group)  # (N, Ci, H, my columns)
    t = _one_dim(t, torch.fft.fft, None, 2, norm)
    a = w1.narrow(3, c0, cl)
    b = w2.narrow(3, c0, cl)
    out = t.new_zeros((n, w1.size(1), h, cl), dtype=torch.promote_types(t.dtype, w1.dtype))
    out[:, :, :m1] = torch.einsum("bixy,ioxy->boxy", t[:, :, :m1], a)
    out[:, :, h - m1 :] = torch.einsum("bixy,ioxy->boxy", t[:, :, h - m1 :], b)
    out = _one_dim(out, torch.fft.ifft, None, 2, norm)
    if p > 1:
        out = AllToAllDim.apply(out, 3, 2, cols, sizes, group)  # (N, Co, H_local, modes2)
    out = torch.cat([out, out.new_zeros(out.shape[:3] + (width // 2 + 1 - m2,))], 3)
    return _one_dim(out, torch.fft.irfft, width, 3, norm)
