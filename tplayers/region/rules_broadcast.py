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
* the same length on every rank: the plain call (the global reading, a replicated map), carrying
  the shares reading (made only when needed), and the op that uses it decides (:func:`_either`): a
  ``cat`` or a pointwise op with sharded data takes the shares reading (the only one under which
  the serial model runs: a map of that length beside data of the global length would not
  broadcast, unless 1 row, where the readings agree in value); views and a ``cat`` with replicated
  tensors (ViT's ``cat((class_pos, patch_pos))``) carry both readings along; any other op takes the
  plain result when the size is not a local length the code read on some rank (a global size, as
  :mod:`tplayers.region.sizes` reads it), and is a ``ValueError`` on every rank when it is one on
  every rank (an even partition: the readings cannot be told apart there);
* shares along one sharded dim and the same size everywhere along another: carried as above, and
  any use other than a ``cat`` / pointwise op with sharded data is refused.
"""

from __future__ import annotations

from typing import Optional

import torch

from tplayers.comm.collectives import exchange_grid_table
from tplayers.domain.active import stepped_aside
from tplayers.region.rules import _pointwise_names
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
    kinds = []  # per mesh dim: "shares" (differ), "ambiguous" (equal, read everywhere), "global" (equal)
    constant = all(int(x.shape[d]) == 1 for d in g.shard_dims)
    for axis, d in enumerate(g.shard_dims):
        wants = {r[2 * axis] for r in cells}
        if len(wants) > 1 or g.groups[axis].size() == 1:
            kinds.append("shares")
        elif all(r[2 * axis + 1] for r in cells):
            kinds.append("ambiguous")
        else:
            kinds.append("global")
    if all(k == "shares" for k in kinds):
        return _as_shares(g, func, a, table, list(per), constant)
    # a size the same on every rank along some dim: the plain call (the global reading), carrying the shares
    # reading for the op that uses it to decide (_either); with a size read from local lengths, or shares
    # along another dim (no global reading then), no other op may use it
    return _either(g, func, args, kwargs, lambda: _as_shares(g, func, a, table, list(per), constant), per,
                   "ambiguous" in kinds or "shares" in kinds)  # fmt: skip


def _as_shares(g, func, a, table, per, constant):
    """This rank's rows of the serial resize, reading each rank's size as its share (the global length
    their sum): a constant map is interpolated to the local size, any other to the global size and sliced."""
    x = a["input"]
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


_EITHER = "_tplayers_either"  # (guard token, [the shares reading or a maker of it], message, refuse other uses)

#: ops that carry an undecided reading along (both readings computed, the shares one lazily)
_CARRY = frozenset(
    ["permute", "view", "reshape", "flatten", "unflatten", "transpose", "contiguous", "clone", "to", "unsqueeze",
     "cat", "concat", "concatenate", "type_as", "double", "float", "movedim"]
)  # fmt: skip


def _either(g, func, args, kwargs, make, per, ambiguous: bool):
    """A replicated map resized to a size that is the same on every rank: the plain call's result (the
    global reading), carrying the shares reading (made when needed). The op that uses it decides
    (:func:`either_use`): a ``cat`` or a pointwise op with sharded data takes the shares reading, the
    only one under which the serial model runs (a map of this length beside data of the global length
    would not broadcast, unless 1 row, where both readings agree in value); views and ``cat`` of
    replicated tensors carry both readings along; any other op takes the plain result, or, when the
    size is a local length the code read on every rank (``ambiguous``), is refused on every rank."""
    with stepped_aside(g, settle=False):
        plain = func(*args, **kwargs)
    message = (
        f"F.interpolate of a replicated map to size {tuple(per)}, the same on every rank and a local length "
        "the region's code read on every rank: this rank's rows of a map broadcast onto the local features, "
        "or a map of that global size. Concatenated with or added to sharded data it is the former; this op "
        "cannot tell"
    )
    return _carry(g, plain, [make], message, ambiguous)


def _carry(g, out, box, message, ambiguous):
    if isinstance(out, torch.Tensor):
        setattr(out, _EITHER, (g.token, box, message, ambiguous))
        g.either += 1
    return out


def _tag(g, t):
    tag = getattr(t, _EITHER, None) if isinstance(t, torch.Tensor) else None
    return tag if tag is not None and tag[0] is g.token else None


def either_of(g, t):
    """The shares reading carried by ``t`` (made now if not yet), or ``None``."""
    tag = _tag(g, t)
    if tag is None:
        return None
    box = tag[1]
    if callable(box[0]):
        box[0] = box[0]()
    return box[0]


def _tags(g, args, kwargs):
    out = []
    for v in (*args, *kwargs.values()):
        for t in v if isinstance(v, (list, tuple)) else (v,):
            tag = _tag(g, t)
            if tag is not None:
                out.append(tag)
    return out


def either_use(g, func, name: str, args, kwargs, touching: bool, handle):
    """An op on maps whose reading is undecided (:func:`_either`): ``None`` to run it as usual (metadata, a
    ``cat`` / pointwise op with sharded data, which takes the shares reading, or an op on the plain result
    of an unambiguous size), the result of carrying both readings (views, ``cat`` of replicated tensors),
    or a ``ValueError`` on every rank (any other op on an ambiguous one)."""
    tags = _tags(g, args, kwargs)
    if not tags or name in _METADATA:
        return None
    if touching and (name in ("cat", "concat", "concatenate") or name in _pointwise_names()):
        return None  # rules_tokens swaps in the shares reading
    if not touching and name in _CARRY:
        with stepped_aside(g, settle=False):
            out = func(*args, **kwargs)
        if any(out is a for a in args):  # x.contiguous() of a contiguous map: itself, already carrying both
            return out

        def make():
            pick = lambda t: either_of(g, t) if _tag(g, t) is not None else t  # noqa: E731
            alt = tuple(type(v)(pick(t) for t in v) if isinstance(v, (list, tuple)) else pick(v) for v in args)
            return handle(g, func, alt, {k: pick(v) for k, v in kwargs.items()})

        return _carry(g, out, [make], tags[0][2], any(t[3] for t in tags))
    if any(t[3] for t in tags):
        raise g.error(
            f"{tags[0][2]} ({name})",
            advice="Use the map in a cat or a sum with the sharded features (read as this rank's rows), or give "
            "that dim shares that differ between ranks.",
        )
    return None


_METADATA = frozenset(
    ["__get__", "size", "dim", "numel", "__len__", "is_floating_point", "is_contiguous", "stride", "__repr__",
     "__format__", "__str__", "data_ptr", "element_size", "get_device", "ndimension", "nelement"]
)  # fmt: skip
