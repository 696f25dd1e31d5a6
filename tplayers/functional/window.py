"""Window ops on domain-sharded data: ``interpolate``, max / avg / adaptive pools, ``pad``.

Each runs the same window-op core as the twins (:mod:`tplayers.window_plan`, halo exchange)
and returns exactly this rank's slice of the serial ``torch.nn.functional`` result, values and
gradients. ``shard_dims[i]`` is the tensor dim sharded over mesh dim ``i``; sizes (``size``,
``output_size``) are global. ``cache``: a dict kept by the caller (the region guard keeps one per
region) so the twin behind a call site, and its cached layout, are built once; without it each call
builds a fresh twin and exchanges its layout again.

Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

    import torch, torch.nn.functional as F, tplayers
    import tplayers.functional as TF
    mesh = tplayers.init_mesh()
    full = torch.randn(1, 2, 9, 7, dtype=torch.float64)
    y = TF.interpolate(tplayers.shard(full, 2, mesh), scale_factor=2, mode="bilinear", mesh=mesh)
    torch.testing.assert_close(tplayers.gather(y, 2, mesh), F.interpolate(full, scale_factor=2, mode="bilinear"))
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import tplayers.layers as L
from tplayers.mesh import resolve_mesh

__all__ = [
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
    "twin_for",
]


def twin_for(cls, args: tuple, mesh, shard_dims: Sequence[int], cache: Optional[dict]):
    """The twin ``cls(*args, mesh=mesh, shard_dims=shard_dims)``, from ``cache`` when given."""
    key = (cls, repr(args), tuple(shard_dims), id(mesh))
    if cache is not None and key in cache:
        return cache[key]
    twin = cls(*args, mesh=mesh, shard_dims=tuple(shard_dims))
    if cache is not None:
        cache[key] = twin
    return twin


def interpolate(
    x,
    size=None,
    scale_factor=None,
    mode="nearest",
    align_corners=None,
    recompute_scale_factor=None,
    antialias=False,
    *,
    mesh=None,
    shard_dims=(2,),
    cache=None,
):
    """Serial ``F.interpolate`` on domain-sharded data (every mode of :class:`~tplayers.DistributedUpsample`).

    Args:
        x: this rank's slice of ``(N, C, *spatial)``, sharded along ``shard_dims``.
        size, scale_factor, mode, align_corners, recompute_scale_factor: as ``F.interpolate``
            (``size`` global).
        antialias: must be ``False``.
        mesh, shard_dims, cache: see the module docstring.

    Returns:
        This rank's rows of the serial result (balanced unless the length is kept).

    Raises:
        ValueError: ``antialias=True``, the argument errors of ``DistributedUpsample``, or (on
            every rank) a partition whose shards cannot supply the taps.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers, tplayers.functional as TF
        mesh = tplayers.init_mesh()
        full = torch.randn(1, 2, 9, 7, dtype=torch.float64)
        y = TF.interpolate(tplayers.shard(full, 2, mesh), size=(20, 7), mode="bicubic", mesh=mesh)
        torch.testing.assert_close(tplayers.gather(y, 2, mesh), F.interpolate(full, size=(20, 7), mode="bicubic"))
    """
    if antialias:
        raise ValueError(
            "tplayers.functional.interpolate: antialias=True is not supported on sharded dims, got antialias=True"
        )
    size = tuple(size) if isinstance(size, (list, tuple, torch.Size)) else size
    scale = tuple(scale_factor) if isinstance(scale_factor, (list, tuple)) else scale_factor
    twin = twin_for(
        L.DistributedUpsample, (size, scale, mode, align_corners, recompute_scale_factor), mesh, shard_dims, cache
    )
    return twin(x)


def _pool(kind: str, n: int):
    def max_pool(
        x,
        kernel_size,
        stride=None,
        padding=0,
        dilation=1,
        ceil_mode=False,
        return_indices=False,
        *,
        mesh=None,
        shard_dims=(2,),
        cache=None,
    ):
        if return_indices:
            raise ValueError(
                f"tplayers.functional.max_pool{n}d: return_indices=True is not supported on sharded "
                "dims (indices would be positions in the local slab), got return_indices=True"
            )
        twin = twin_for(
            getattr(L, f"DistributedMaxPool{n}d"),
            (kernel_size, stride, padding, dilation, False, ceil_mode),
            mesh,
            shard_dims,
            cache,
        )
        return twin(x)

    def avg_pool(
        x,
        kernel_size,
        stride=None,
        padding=0,
        ceil_mode=False,
        count_include_pad=True,
        divisor_override=None,
        *,
        mesh=None,
        shard_dims=(2,),
        cache=None,
    ):
        twin = twin_for(
            getattr(L, f"DistributedAvgPool{n}d"),
            (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override),
            mesh,
            shard_dims,
            cache,
        )
        return twin(x)

    def adaptive(x, output_size, *, mesh=None, shard_dims=(2,), cache=None, return_indices=False):
        if return_indices:
            raise ValueError(f"tplayers.functional.adaptive_max_pool{n}d: return_indices=True is not supported")
        cls = getattr(L, f"DistributedAdaptive{'Avg' if kind == 'adaptive_avg' else 'Max'}Pool{n}d")
        size = tuple(output_size) if isinstance(output_size, (list, tuple)) else output_size
        return twin_for(cls, (size,), mesh, shard_dims, cache)(x)

    fn = {"max": max_pool, "avg": avg_pool}.get(kind, adaptive)
    fn.__name__ = f"{kind}_pool{n}d"
    args = {"max": "3, stride=2, padding=1", "avg": "3, 2, 1, count_include_pad=False"}.get(kind, "3")
    extra = "; no ``return_indices=True``" if "max" in kind else ""
    fn.__doc__ = f"""Serial ``F.{kind}_pool{n}d`` on domain-sharded data (see the module docstring).

    Args:
        x: this rank's slice of ``(N, C, *spatial)``, sharded along ``shard_dims``.
        ...: ``F.{kind}_pool{n}d``'s arguments (kernel, stride, output sizes global){extra}.
        mesh, shard_dims, cache: see the module docstring.

    Returns:
        This rank's rows of the serial result (balanced unless the length is kept).

    Raises:
        ValueError: bad arguments, or (on every rank) a partition whose shards cannot supply the windows.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers, tplayers.functional as TF
        mesh = tplayers.init_mesh()
        full = torch.randn(1, 2, {", ".join(["10"] * n)}, dtype=torch.float64)
        y = TF.{kind}_pool{n}d(tplayers.shard(full, 2, mesh), {args}, mesh=mesh)
        torch.testing.assert_close(tplayers.gather(y, 2, mesh), F.{kind}_pool{n}d(full, {args}))
    """
    return fn


max_pool1d, max_pool2d, max_pool3d = (_pool("max", n) for n in (1, 2, 3))
avg_pool1d, avg_pool2d, avg_pool3d = (_pool("avg", n) for n in (1, 2, 3))
adaptive_avg_pool1d, adaptive_avg_pool2d, adaptive_avg_pool3d = (_pool("adaptive_avg", n) for n in (1, 2, 3))
adaptive_max_pool1d, adaptive_max_pool2d, adaptive_max_pool3d = (_pool("adaptive_max", n) for n in (1, 2, 3))


def pad(x, pad, mode="constant", value=None, *, mesh=None, shard_dims=(2,)):
    """Serial ``F.pad`` in ``constant`` mode: the rows before a sharded dim go to its first rank, the rows
    after it to its last; other dims pad locally. No communication.

    Args:
        x: this rank's slice, sharded along ``shard_dims``.
        pad, mode, value: as ``F.pad`` (``mode="constant"`` along sharded dims).
        mesh, shard_dims: see the module docstring (a negative entry: that mesh dim shards no dim).

    Returns:
        This rank's slice of the padded serial tensor.

    Raises:
        ValueError: another mode along a sharded dim (pad inside a convolution twin with
            ``padding_mode`` instead).

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import torch, torch.nn.functional as F, tplayers, tplayers.functional as TF
        mesh = tplayers.init_mesh()
        full = torch.randn(1, 2, 8, 5)
        y = TF.pad(tplayers.shard(full, 2, mesh), (1, 1, 2, 3), value=-1.0, mesh=mesh)
        torch.testing.assert_close(tplayers.gather(y, 2, mesh), F.pad(full, (1, 1, 2, 3), value=-1.0))
    """
    mesh = resolve_mesh(mesh, (1, 2))
    pad = [int(p) for p in pad]
    n = x.dim()
    local = list(pad)
    for i, d in enumerate(shard_dims):
        if d < 0:  # this mesh dim shards no dim of x
            continue
        k = n - 1 - d  # F.pad lists the last dim first
        if 2 * k + 1 >= len(pad) or not (pad[2 * k] or pad[2 * k + 1]):
            continue
        if mode != "constant":
            raise ValueError(
                f"tplayers.functional.pad: mode {mode!r} along sharded dim {d} is not supported "
                "(constant padding is); use a twin's padding_mode, or pad outside the region"
            )
        coord, size = mesh.get_local_rank(i), mesh.size(i)
        local[2 * k] = pad[2 * k] if coord == 0 else 0
        local[2 * k + 1] = pad[2 * k + 1] if coord == size - 1 else 0
    return torch.nn.functional.pad(x, local, mode=mode, value=value)
