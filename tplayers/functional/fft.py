"""``torch.fft`` over domain-sharded dims: a slab / pencil decomposition with :func:`tplayers.repartition`.

Each function takes this rank's slice of a tensor sharded along ``shard_dims`` (one tensor dim per
mesh dim) and returns this rank's slice of what the serial ``torch.fft`` function returns on the
gathered tensor, values and gradients (complex autograd included). The transform is separable: the
dims that are whole on this rank are transformed locally; a transformed dim that is sharded first
hands its sharding to a dim already transformed (or, when there is none, to a dim outside the
transform) with one all-to-all over that mesh dim, then is transformed locally.

**The spectrum's sharding.** By default the result is sharded like the input: the same tensor dim
over the same mesh dim (``out_shard_dims=None``), so an H-sharded image gives an H-sharded spectrum,
and ``irfft2`` of that spectrum gives back the H-sharded image; a sharded dim keeps the input's
partition when its length is unchanged and is cut by :func:`tplayers.shard_sizes` otherwise (the
``W // 2 + 1`` modes of an ``rfft`` along a sharded W). That costs a second all-to-all per moved
mesh dim (the sharding returns). Pass ``out_shard_dims`` to keep the spectrum where the transform
left it: ``rfft2(x, shard_dims=(2,), out_shard_dims=(3,))`` of an H-sharded ``(N, C, H, W)`` is
sharded along the ``W // 2 + 1`` modes with one all-to-all, and
``irfft2(y, s=(H, W), shard_dims=(3,), out_shard_dims=(2,))`` returns the H-sharded image with one.
``out_shard_dims="leave"`` (and for the shifts) keeps the result where the steps left it on a 1-D mesh
(:func:`transform_landed` / :func:`shift_landed` say where): what the region guard does for forward
transforms.

Every call first compares every rank's arguments and local sizes in one small exchange (a
``ValueError`` on every rank when they differ). ``norm`` is applied per transformed dim, as the
serial transforms do (``"backward"``, ``"ortho"``, ``"forward"``). A transform over every dim of a
tensor whose every dim is sharded (a sharded 1-D signal) is refused: no dim is left to pass the
sharding through. ``fftshift`` / ``ifftshift`` along a sharded dim move its sharding to another
dim, shift locally and move it back (two all-to-alls).

Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

    import torch, tplayers
    from tplayers.functional import fft as dfft
    mesh = tplayers.init_mesh()
    full = torch.randn(2, 3, 9, 7, dtype=torch.float64)
    x = tplayers.shard(full, 2, mesh)                          # H-sharded
    y = dfft.rfft2(x, norm="ortho", mesh=mesh)                 # H-sharded spectrum (2, 3, 9, 4)
    torch.testing.assert_close(tplayers.gather(y, 2, mesh), torch.fft.rfft2(full, norm="ortho"))
    back = dfft.irfft2(y, s=(9, 7), norm="ortho", mesh=mesh)   # H-sharded again
    torch.testing.assert_close(back, x)
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tplayers.comm.agree import exchange_agreed
from tplayers.comm.all_to_all import AllToAllDim, grid_sizes, plan_moves
from tplayers.domain.active import active_guard, stepped_aside
from tplayers.domain.layout import region_layout
from tplayers.functional.fft_common import _NORMS, LEAVE, _mesh_dims, _norm_dims
from tplayers.functional.fft_shift import fftshift, ifftshift, shift_landed
from tplayers.mesh import resolve_mesh
from tplayers.sharding import shard_sizes
from tplayers.window_plan import out_partition

__all__ = [
    "fft",
    "ifft",
    "rfft",
    "irfft",
    "fft2",
    "ifft2",
    "rfft2",
    "irfft2",
    "fftn",
    "ifftn",
    "rfftn",
    "irfftn",
    "fftshift",
    "ifftshift",
    "transform",
    "transform_landed",
    "shift_landed",
    "LEAVE",
]

# kind -> (the one-dim torch transform of each dim, the transform of the halving dim or None)
_KINDS = {
    "c2c": (torch.fft.fft, None),
    "ic2c": (torch.fft.ifft, None),
    "r2c": (torch.fft.fft, torch.fft.rfft),
    "c2r": (torch.fft.ifft, torch.fft.irfft),
}

Step = Tuple  # ("move", mesh dim, from dim, to dim) or ("fft", dim, last)


def plan(kind: str, shape: Sequence[int], dims: Sequence[int], shard_dims: Sequence[int], out_dims) -> List[Step]:
    """The steps of a transform: local one-dim transforms and the all-to-alls between them.

    ``("fft", d, last)``: transform dim ``d`` (``last``: the halving dim of an r2c / c2r transform);
    ``("move", i, a, b)``: mesh dim ``i``'s sharding from dim ``a`` to dim ``b``. The halving dim of
    an r2c transform goes first and that of a c2r transform last, as in ``torch.fft``. Pure
    arithmetic on the shape; ``ValueError`` when a sharded dim has nowhere to go.

    >>> plan("r2c", (2, 3, 8, 8), (2, 3), (2,), (2,))
    [('fft', 3, True), ('move', 0, 2, 3), ('fft', 2, False), ('move', 0, 3, 2)]
    """
    last = dims[-1] if kind in ("r2c", "c2r") else None
    cur, pending, done, steps = list(shard_dims), list(dims), [], []
    outside = sorted((d for d in range(len(shape)) if d not in dims), key=lambda d: -shape[d])
    while pending:
        if kind == "r2c" and last in pending:
            allowed = [last]
        elif kind == "c2r" and len(pending) > 1:
            allowed = [d for d in pending if d != last]
        else:
            allowed = list(pending)
        local = [d for d in allowed if d not in cur]
        if local:
            for d in local:
                steps.append(("fft", d, d == last))
                pending.remove(d)
                done.append(d)
            continue
        d = allowed[0]
        i = cur.index(d)
        targets = [t for t in done[::-1] + [p for p in pending if p not in allowed] + outside if t not in cur]
        if not targets:
            raise ValueError(
                f"the transform over dims {tuple(dims)} of a tensor sharded along {tuple(shard_dims)} leaves no "
                f"dim to pass the sharding of dim {d} through (every dim is transformed or sharded)"
            )
        steps.append(("move", i, d, targets[0]))
        cur[i] = targets[0]
    spare = sorted((d for d in range(len(shape))), key=lambda d: -shape[d])
    if out_dims == LEAVE and len(shard_dims) > 1:
        out_dims = list(shard_dims)  # a 2-D mesh: back where it was (two mesh dims could end up swapped)
    if out_dims == LEAVE:  # keep each mesh dim's sharding on a transformed dim where the steps left it
        out_dims = list(cur)
        for i, d in enumerate(cur):
            if d not in dims and d != shard_dims[i]:  # parked outside the transform: back to a transformed dim
                others = out_dims[:i] + out_dims[i + 1 :]
                out_dims[i] = next((t for t in [shard_dims[i], *dims] if t not in others), shard_dims[i])
    steps += [("move", i, a, b) for i, a, b in plan_moves(cur, out_dims, spare)]
    return steps


def landed(src: Sequence[int], steps: Sequence[Step]) -> Tuple[int, ...]:
    """The sharded dims after ``steps`` (from ``src``)."""
    cur = list(src)
    for step in steps:
        if step[0] == "move":
            cur[step[1]] = step[3]
    return tuple(cur)


def transform(
    x: torch.Tensor,
    kind: str,
    s=None,
    dim=None,
    norm: Optional[str] = None,
    *,
    mesh=None,
    shard_dims=(2,),
    out_shard_dims=None,
    name: str = "fftn",
    out_sizes: Optional[Dict[int, Sequence[int]]] = None,
) -> torch.Tensor:
    """The engine of every function here: ``kind`` is ``"c2c"`` (fft), ``"ic2c"`` (ifft), ``"r2c"``
    (rfft) or ``"c2r"`` (irfft) over ``dim`` with signal sizes ``s`` (see the module docstring).
    ``out_sizes``: ``{mesh dim: partition}`` of the result's sharded dims where known (the region
    guard passes the partition of the tensor a signal size was read from); default as documented."""
    return transform_landed(x, kind, s, dim, norm, mesh, shard_dims, out_shard_dims, name, out_sizes)[0]


def transform_landed(x, kind, s, dim, norm, mesh, shard_dims, out_shard_dims, name, out_sizes=None):
    """:func:`transform` and the result's sharded dims (where ``out_shard_dims="leave"`` left them)."""
    guard = active_guard()  # called by hand inside a region: run unguarded, tag the result
    with stepped_aside(guard) if guard is not None else contextlib.nullcontext():
        out, dst = _transform(
            x, kind, s, dim, norm, mesh, shard_dims, out_shard_dims, f"tplayers.functional.fft.{name}", out_sizes
        )
    if guard is not None and hasattr(guard, "mark"):
        guard.mark(out, region_layout(out.shape, dst))
    return out, dst


def _transform(x, kind, s, dim, norm, mesh, shard_dims, out_shard_dims, name, out_sizes=None):
    mesh = resolve_mesh(mesh, (1, 2))
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    error, src, dst, dims, sizes_s, steps, ndim = None, (), (), (), None, [], -1
    try:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if norm not in _NORMS:
            raise ValueError(f"{name}: norm must be one of {_NORMS}, got {norm!r}")
        if kind == "r2c" and x.is_complex():
            raise TypeError(f"{name}: expects a real input tensor, got {x.dtype}")
        ndim = x.dim()
        src = _mesh_dims(shard_dims, mesh.ndim, ndim, name, "shard_dims")
        if out_shard_dims == LEAVE:
            dst = LEAVE
        else:
            dst = src if out_shard_dims is None else _mesh_dims(out_shard_dims, mesh.ndim, ndim, name, "out_shard_dims")
        dims, sizes_s = _norm_dims(dim, s, ndim, name)
        try:
            steps = plan(kind, tuple(x.shape), dims, src, dst)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        dst = landed(src, steps)
    except (TypeError, ValueError) as e:
        error = e
    row = [int(x.size(d)) for d in src] if error is None else [0] * mesh.ndim
    row += [0] * (2 - len(row))
    rest = tuple(-1 if d in src else int(v) for d, v in enumerate(x.shape)) if error is None else ()
    config = {
        "shard_dims": src,
        "out_shard_dims": dst,
        "dim": dims,
        "s": sizes_s,
        "norm": norm,
        "dtype": str(getattr(x, "dtype", None)),
        "other dims": rest,
    }
    table = exchange_agreed(row, config, groups, name, "fft.layout", error=error)
    sizes = grid_sizes(table, mesh, name)
    return _run(x, kind, steps, dims, sizes_s, norm, mesh, src, sizes, dst, out_sizes or {}), dst


def _run(x, kind, steps, dims, s, norm, mesh, src, sizes, dst=(), out_sizes=None) -> torch.Tensor:
    one, halving = _KINDS[kind]
    ns = dict(zip(dims, s)) if s is not None else {}
    given = [list(v) for v in sizes]  # the input's partition, restored where a dim's sharding returns unchanged
    sizes = [list(v) for v in sizes]
    for step in steps:
        if step[0] == "fft":
            _, d, last = step
            n = ns.get(d)
            x = _one_dim(x, halving if last else one, None if n == -1 else n, d, norm)
            continue
        _, i, a, b = step
        group = mesh.get_group(i)
        if group.size() == 1:
            sizes[i] = [x.size(b)]
            continue
        want = (out_sizes or {}).get(i)
        if want is not None and b == dst[i] and sum(want) == x.size(b) and len(want) == group.size():
            new = list(want)
        elif b == src[i]:
            new = out_partition(given[i], x.size(b))
        else:
            new = shard_sizes(x.size(b), group.size())
        x = AllToAllDim.apply(x, a, b, sizes[i], new, group)
        sizes[i] = new
    return x


def _one_dim(x: torch.Tensor, fn, n: Optional[int], d: int, norm) -> torch.Tensor:
    """``fn(x, n, d, norm)``; an empty shard (a rank holding no rows of another dim) gets the empty
    result, connected to ``x`` for autograd (the FFT backends reject empty batches)."""
    if x.numel():
        return fn(x, n=n, dim=d, norm=norm)
    m = x.size(d)
    length = {torch.fft.rfft: (n or m) // 2 + 1, torch.fft.irfft: n or 2 * (m - 1)}.get(fn, n or m)
    real = fn is torch.fft.irfft
    base = x.real if real and x.is_complex() else x if real else x.to(torch.promote_types(x.dtype, torch.complex64))
    shape = list(x.shape)
    shape[d] = length
    return torch.cat([base.narrow(d, 0, 0), base.new_zeros(shape)], d)


def _family(kind: str, name: str, default_dim, n_arg: bool):
    def fn(input, s=None, dim=default_dim, norm=None, *, mesh=None, shard_dims=(2,), out_shard_dims=None):
        return transform(
            input, kind, s, dim, norm, mesh=mesh, shard_dims=shard_dims, out_shard_dims=out_shard_dims, name=name
        )

    def fn1(input, n=None, dim=-1, norm=None, *, mesh=None, shard_dims=(2,), out_shard_dims=None):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"tplayers.functional.fft.{name}: dim must be an int, got {dim!r}")
        return transform(
            input,
            kind,
            None if n is None else (n,),
            (dim,),
            norm,
            mesh=mesh,
            shard_dims=shard_dims,
            out_shard_dims=out_shard_dims,
            name=name,
        )

    fn = fn1 if n_arg else fn

    serial = f"torch.fft.{name}"
    first = "n" if n_arg else "s"
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"""``{serial}`` over domain-sharded dims (see the module docstring for the decomposition).

    Args:
        input: this rank's slice, sharded along ``shard_dims``.
        {first}, dim, norm: as ``{serial}`` (``{first}`` global sizes; ``dim`` default ``{default_dim!r}``).
        mesh: a 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).
        shard_dims: the tensor dim sharded over each mesh dim (an int for a 1-D mesh).
        out_shard_dims: the result's sharded dims (default ``shard_dims``: the input's sharding).

    Returns:
        This rank's slice of ``{serial}`` of the gathered input, sharded along ``out_shard_dims``.

    Raises:
        TypeError: a non-tensor input, dims that are not ints{", a complex input" if kind == "r2c" else ""}.
        ValueError: on every rank, when ranks disagree on the arguments or the unsharded sizes, a bad
            ``norm`` / ``dim`` / ``{first}``, or no dim is left to pass a sharded transformed dim through.
    """
    return fn


fft = _family("c2c", "fft", -1, True)
ifft = _family("ic2c", "ifft", -1, True)
rfft = _family("r2c", "rfft", -1, True)
irfft = _family("c2r", "irfft", -1, True)
fft2 = _family("c2c", "fft2", (-2, -1), False)
ifft2 = _family("ic2c", "ifft2", (-2, -1), False)
rfft2 = _family("r2c", "rfft2", (-2, -1), False)
irfft2 = _family("c2r", "irfft2", (-2, -1), False)
fftn = _family("c2c", "fftn", None, False)
ifftn = _family("ic2c", "ifftn", None, False)
rfftn = _family("r2c", "rfftn", None, False)
irfftn = _family("c2r", "irfftn", None, False)
