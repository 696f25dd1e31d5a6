"""A replicated map of size 1 along the sharded dims interpolated back to a local size (issue 31).

DeepLabV3's ASPP pooling branch (segmentation_models_pytorch, torchvision), PSPNet's pyramid level 1
and squeeze-style global-context blocks pool the whole domain to ``1 x 1`` (a global reduction: the
result is replicated), transform it, and broadcast it back with ``F.interpolate(x, size=feat.shape[-2:])``
before a ``cat`` or a sum with the sharded features. Interpolating from length 1 gives the input
value at every output row, whatever the mode (nearest, linear, bilinear, bicubic, trilinear, area;
``align_corners`` either way), so the serial result is a per-channel constant over the global rows,
and this rank's slice of it is the same constant over its own rows.

The op itself touches no sharded tensor (its input is replicated and its size is a tuple), so the
guard's ``__torch_function__`` hands every ``F.interpolate`` of a replicated input of size 1 along
each of the region's sharded dims to :func:`broadcast_interpolate` (a decision read from the
replicated input alone: the same on every rank). Which size is meant is decided as
:mod:`tplayers.region.sizes` decides it for a sharded input, from every rank's requested length and
whether it is a local length the region's code read (``x.shape``), in one small all-gather per mesh
dim (after settling the armed decisions):

* the ranks ask for different lengths: their shares of the global rows (any partition): the result
  is sharded along that dim with this rank's length, and the input's gradient is summed over the
  mesh (every rank's rows add theirs, as the serial backward sums all rows);
* the same length on every rank, and on some rank not a local length the code read: the global
  size, the plain call (a replicated map of the global length, as in the serial model);
* the same length on every rank that is a local length the code read on every rank (an even
  partition: ``size=x.shape[-2:]`` with equal shares): the two readings cannot be told apart, so it
  is a ``ValueError`` on every rank naming the fixes (as for a sharded input);
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
    """The bound arguments when ``F.interpolate(args, kwargs)`` broadcasts a replicated map of size 1
    along every sharded dim of the region to a given size; else ``None`` (decided from the replicated
    input and the presence of ``size``: the same on every rank)."""
    a = _bind(args, kwargs, _ARGS, {"size": None, "scale_factor": None})
    x, dims = a.get("input"), g.shard_dims
    if not isinstance(x, torch.Tensor) or a["size"] is None or min(dims) < 2 or x.dim() <= max(dims):
        return None
    if any(int(x.shape[d]) != 1 for d in dims):
        return None
    return a


def broadcast_interpolate(g, func, args, kwargs):
    """``F.interpolate`` of a replicated ``(N, C, 1, ...)`` map to a size inside a region (see the module
    docstring): the routed result, or ``None`` when the call is not such a broadcast (run it plainly)."""
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
    for axis, d in enumerate(g.shard_dims):
        wants = {r[2 * axis] for r in cells}
        read_everywhere = all(r[2 * axis + 1] for r in cells)
        if len(wants) > 1 or g.groups[axis].size() == 1:
            shares.append(True)
        elif read_everywhere:
            raise g.error(
                f"F.interpolate of a replicated map of length 1 along sharded dim {d} to size {tuple(per)}: "
                f"{per[d - 2]} is the same on every rank and a local length along that dim that this region's "
                f"code read (x.shape) on every rank, so it may mean this rank's rows (a per-channel constant "
                f"broadcast back onto the local features) or the global size; the two cannot be told apart",
                advice="Give that dim shares that differ between ranks at this resolution (read as shares), or "
                "in your own code add the (N, C, 1, 1) map to the features directly (a size-1 operand "
                "broadcasts against sharded data) instead of interpolating it.",
            )
        else:
            shares.append(False)
    if not any(shares):
        with stepped_aside(g, settle=False):
            return func(*args, **kwargs)
    if not all(shares):
        raise g.error(
            f"F.interpolate of a replicated map of length 1 to size {tuple(per)}: the ranks' shares along "
            "some sharded dims and a global size along others"
        )
    g.acted = True
    axes = tuple(range(len(g.groups)))
    call = dict(a)
    call["input"] = g.bound(x, axes)
    with stepped_aside(g, settle=False):
        out = func(**call)
    layout = [None] * out.dim()
    for axis, d in enumerate(g.shard_dims):
        layout[d] = ((int(out.shape[d]), axis),)
    return g.mark(out, tuple(layout))
