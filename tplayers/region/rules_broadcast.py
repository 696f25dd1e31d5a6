"""A replicated map interpolated to the ranks' shares of a sharded size (issue 31): DeepLab's ASPP
pooled branch, a ViT's ``interpolate_pos_encoding``.

DeepLabV3's ASPP pooling branch (segmentation_models_pytorch, torchvision), PSPNet's pyramid level 1
and squeeze-style global-context blocks pool the whole domain to ``1 x 1`` (a global reduction: the
result is replicated), transform it, and broadcast it back with ``F.interpolate(x, size=feat.shape[-2:])``
before a ``cat`` or a sum with the sharded features. Interpolating from length 1 gives the input
value at every output row, whatever the mode (nearest, linear, bilinear, bicubic, trilinear, area;
``align_corners`` either way), so the serial result is a per-channel constant over the global rows,
and this rank's slice of it is the same constant over its own rows.

A ViT's ``interpolate_pos_encoding`` (transformers' ViT, DeiT, DINOv2, ...) resizes its replicated
grid of learned position embeddings, ``(1, D, sqrt(N), sqrt(N))``, to ``size=(height // patch, width
// patch)``, read from the pixels' shape: the local rows under sharding. The serial result's rows for
this rank are those of the interpolation to the *global* size: every rank computes that (a small
replicated grid) and keeps its rows, sharded, the grid's gradient summed over the mesh.

The op itself touches no sharded tensor (its input is replicated and its size is a tuple), so the
guard's ``__torch_function__`` hands every ``F.interpolate`` of a replicated input with a ``size``
and the region's sharded dims (spatial) to :func:`broadcast_interpolate` (a decision read from the
replicated input and the call alone: the same on every rank). A map of length 1 along the sharded
dims is interpolated to the local size directly (a constant: no global map is made); any other is
interpolated to the global size and sliced. Which size is meant is decided as
:mod:`tplayers.region.sizes` decides it for a sharded input, from every rank's requested length and
whether it is a local length the region's code read (``x.shape``), in one small all-gather per mesh
dim (after settling the armed decisions):

* the ranks ask for different lengths: their shares of the global rows (any partition, the global
  length their sum): the result is this rank's rows of the serial one, sharded along that dim, and
  the input's gradient is summed over the mesh (every rank's rows add theirs, as the serial
  backward sums all rows);
* the same length on every rank, and on some rank not a local length the code read: the global
  size, the plain call (a replicated map of the global length, as in the serial model);
* the same length on every rank that is a local length the code read on every rank (an even
  partition: ``size=x.shape[-2:]`` with equal shares): for a map of length 1 both readings hold the
  same local values, so the plain result is returned carrying the shares reading, and the first op
  using it decides (:func:`_either`): a ``cat`` or a pointwise op with sharded data takes the
  shares reading, any other op is a ``ValueError`` on every rank; for a longer map (a position
  grid) the readings differ in value, so the call itself is a ``ValueError`` on every rank naming
  the fixes (as for a sharded input);
* shares along one sharded dim and a global size along another: ``ValueError`` on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from tplayers.comm.collectives import exchange_grid_table
from tplayers.domain.active import stepped_aside
from tplayers.region.rules_ops import _bind
from tplayers.region.sizes import _derived

__all__ = ["broadcast_interpolate"]

_ARGS = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")


def _candidate(g, args, kwargs) -> Optional[dict]:
    """The bound arguments when ``F.interpolate(args, kwargs)`` resizes a replicated map with the region's
    sharded dims to a given size; else ``None`` (decided from the replicated input and the presence of
    ``size``: the same on every rank)."""
    a = _bind(args, kwargs, _ARGS, {"size": None, "scale_factor": None})
    x, dims = a.get("input"), g.shard_dims
    if not isinstance(x, torch.Tensor) or a["size"] is None or min(dims) < 2 or x.dim() <= max(dims):
        return None
    return a


def broadcast_interpolate(g, func, args, kwargs):
    """``F.interpolate`` of a replicated ``(N, C, ...)`` map to a size inside a region (see the module
    docstring): the routed result, or ``None`` when the call is not such a resize (run it plainly)."""
    a = _candidate(g, args, kwargs)
    if a is None:
        return None
    x, n_sp = a["input"], a["input"].dim() - 2
    size = a["size"]
    per = [int(s) for s in size] if isinstance(size, (list, tuple, torch.Size)) else [int(size)] * n_sp
    if len(per) != n_sp:
        return None  # torch's own error, the same on every rank
    g.settle()  # before the exchange: a rank that refused earlier meets the others here
    row = []
    for axis, d in enumerate(g.shard_dims):
        s = per[d - 2]
        row += [s, int(any(_derived(s, r) for r in g.reads.get(axis, ())))]
    with stepped_aside(g, settle=False):
        table = exchange_grid_table(row, g.groups, "region.sizes")
    cells = [r for line in table for r in line]
    shares = []
    constant = all(int(x.shape[d]) == 1 for d in g.shard_dims)
    for axis, d in enumerate(g.shard_dims):
        wants = {r[2 * axis] for r in cells}
        read_everywhere = all(r[2 * axis + 1] for r in cells)
        if len(wants) > 1 or g.groups[axis].size() == 1:
            shares.append(True)
        elif read_everywhere and constant:
            shares.append(None)  # either: decided by the first op that uses it (see _either)
        elif read_everywhere:
            raise g.error(
                f"F.interpolate of a replicated map of length {x.shape[d]} along sharded dim {d} to size "
                f"{tuple(per)}: {per[d - 2]} is the same on every rank and a local length along that dim that "
                f"this region's code read (x.shape) on every rank, so it may mean this rank's rows (a pooled "
                f"map broadcast back onto the local features, position embeddings resized to the local "
                f"patches) or the global size; the two cannot be told apart",
                advice="Give that dim shares that differ between ranks at this resolution (read as shares: for "
                "a ViT, patch rows that do not split evenly over the ranks), or add the table at its full "
                "size (x + pos_embed: each rank takes its rows) instead of interpolating it.",
            )
        else:
            shares.append(False)
    if None in shares and False not in shares:
        return _either(g, func, a, args, kwargs, per)
    if not any(shares):
        with stepped_aside(g, settle=False):
            return func(*args, **kwargs)
    if not all(shares):
        raise g.error(
            f"F.interpolate of a replicated map to size {tuple(per)}: the ranks' shares along "
            "some sharded dims and a global size along others"
        )
    g.acted = True
    axes = tuple(range(len(g.groups)))
    call = dict(a)
    call["input"] = g.bound(x, axes)
    if not constant:  # the global size; this rank's rows are sliced below
        coords = [g.mesh.get_local_rank(i) for i in axes] + [0] * (2 - len(axes))
        spans = []
        for axis, d in enumerate(g.shard_dims):
            line = [table[c][coords[1]] if axis == 0 else table[coords[0]][c] for c in range(g.groups[axis].size())]
            shares = [r[2 * axis] for r in line]
            spans.append((d, sum(shares[: coords[axis]]), shares[coords[axis]], sum(shares)))
            per[d - 2] = sum(shares)
        call["size"] = tuple(per)
    with stepped_aside(g, settle=False):
        out = func(**call)
        if not constant:
            for d, start, length, _ in spans:
                out = out.narrow(d, start, length)
            out = out.contiguous()  # as the serial result is (a later .view of it must work alike)
    layout = [None] * out.dim()
    for axis, d in enumerate(g.shard_dims):
        layout[d] = ((int(out.shape[d]), axis),)
    return g.mark(out, tuple(layout))


_EITHER = "_tplayers_either"  # (guard token, the shares reading, the refusal message)


def _either(g, func, a, args, kwargs, per):
    """Equal shares of a constant broadcast: both readings hold the same local values (the map's value
    at every row) and differ only in what they are. Returned: the plain call (the global reading,
    replicated), carrying the shares reading (sharded, the map's gradient summed). The first op that
    uses it decides (:func:`either_use`): a ``cat`` or a pointwise op with sharded data takes the
    shares reading, which is then the only one under which the serial model runs (a map of the local
    length beside data of the global length, broadcast against it unless it is 1 row, where both
    readings agree); any other op on it is refused on every rank with the ambiguity."""
    g.acted = True
    call = dict(a)
    call["input"] = g.bound(a["input"], tuple(range(len(g.groups))))
    with stepped_aside(g, settle=False):
        plain = func(*args, **kwargs)
        sharded = func(**call)
    layout = [None] * sharded.dim()
    for axis, d in enumerate(g.shard_dims):
        layout[d] = ((int(sharded.shape[d]), axis),)
    g.mark(sharded, tuple(layout))
    message = (
        f"F.interpolate of a replicated map of length 1 along the sharded dims to size {tuple(per)}, the same "
        "on every rank and a local length the region's code read on every rank: a pooled map broadcast back "
        "onto this rank's rows, or a map of that global size. Concatenated with or added to sharded data it "
        "is the former; this op cannot tell"
    )
    setattr(plain, _EITHER, (g.token, sharded, message))
    g.either += 1
    return plain


def either_of(g, t):
    """The shares reading carried by ``t`` (:func:`_either`), or ``None``."""
    tag = getattr(t, _EITHER, None) if isinstance(t, torch.Tensor) else None
    return tag[1] if tag is not None and tag[0] is g.token else None


def either_use(g, name: str, args, kwargs, allowed: bool) -> None:
    """Refuse an op on a map whose reading is undecided (:func:`_either`) unless ``allowed`` (a ``cat`` or
    a pointwise op with sharded data, which takes the shares reading); metadata queries pass."""
    if allowed or name in _METADATA:
        return
    for v in (*args, *kwargs.values()):
        for t in v if isinstance(v, (list, tuple)) else (v,):
            tag = getattr(t, _EITHER, None) if isinstance(t, torch.Tensor) else None
            if tag is not None and tag[0] is g.token:
                raise g.error(
                    f"{tag[2]} ({name})",
                    advice="Use the map in a cat or a sum with the sharded features (read as this rank's "
                    "rows), or give that dim shares that differ between ranks.",
                )


_METADATA = frozenset(
    ["__get__", "size", "dim", "numel", "__len__", "is_floating_point", "is_contiguous", "stride", "__repr__",
     "__format__", "__str__", "data_ptr", "element_size", "get_device", "ndimension", "nelement"]
)  # fmt: skip
