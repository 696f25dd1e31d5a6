"""Region-guard route for ``torch.roll`` along sharded dims: a circular exchange with the neighbours.

``torch.roll(x, s, d)`` is ``y[i] = x[(i - s) mod L]`` along ``d``. Along a sharded dim, rank ``k``'s
output rows ``[a_k, a_k + n_k)`` read input rows ``[a_k - s, a_k + n_k - s)``: for ``0 < s <= n_k``
the last ``s`` rows of the previous rank (the last rank's for the first: periodic) and the first
``n_k - s`` rows of its own slice; for ``s < 0`` its own last ``n_k - |s|`` rows and the first
``|s|`` of the next rank. So the roll is one periodic halo exchange of ``|s|`` rows in one direction
(:class:`~tplayers.comm.halo_grad.HaloExchange1d`, whose backward is its adjoint: each row's
gradient goes back to its owner) and a slice: exact on any partition (uneven included) where every
rank along the dim holds at least ``|s|`` rows. Swin's shifted windows roll by half a window, and
SwinUNETR's by a few rows: far less than a shard.

A shift larger than some rank's slice reads rows of ranks further away: refused on every rank (the
decision reads local lengths: agreed on a region's first call), naming the shift, the rank's length
and the fix (fewer ranks along the dim, or a shift in ``[-n, n]``: ``s - L`` rolls like ``s``).
Several dims roll one after the other (rolls along different dims commute); dims that are not
sharded, or sharded over a mesh dim of size 1, roll locally. ``torch.roll`` without ``dims``
(over the flattened tensor) and a roll along a dim that merges a sharded dim with others are refused.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from tplayers.comm.halo_grad import HaloExchange1d
from tplayers.domain.layout import sharded_dims
from tplayers.region.rules import op_name
from tplayers.region.rules_ops import _bind

__all__ = ["TABLE"]


def _pairs(shifts, dims, ndim: int) -> List[Tuple[int, int]]:
    shifts = (shifts,) if isinstance(shifts, int) else tuple(int(s) for s in shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(int(d) for d in dims)
    return [(int(s), d % ndim) for s, d in zip(shifts, dims)] if len(shifts) == len(dims) else []


def _roll(g, func, args, kwargs):
    """``torch.roll`` / ``Tensor.roll`` on sharded data (see the module docstring)."""
    a = _bind(args, kwargs, ("input", "shifts", "dims"), {"dims": None})
    x, lay = a["input"], g.layout(a["input"])
    sharded = set(sharded_dims(lay))
    what = f"{op_name(func)}(shifts={a['shifts']!r}, dims={a['dims']!r})"
    if a["dims"] is None or (isinstance(a["dims"], (tuple, list)) and len(a["dims"]) == 0):
        raise g.error(f"{what} over the flattened tensor", lay, "Pass dims= (one per shift).")
    pairs = _pairs(a["shifts"], a["dims"], x.dim())
    if not pairs:  # mismatched lengths: torch's own error, the same on every rank
        return func(*args, **kwargs)
    local = [(s, d) for s, d in pairs if d not in sharded or g.groups[lay[d][0][1]].size() == 1 or s == 0]
    routed = [(s, d) for s, d in pairs if (s, d) not in local]
    for s, d in routed:
        if len(lay[d]) != 1:
            raise g.error(f"{what} along dim {d}, which merges a sharded dim with others", lay)
    g.arm()  # whether this rank holds enough rows is read from its local length
    for s, d in routed:
        if x.shape[d] < abs(s):
            raise g.refuse(
                g.error(
                    f"{what} along sharded dim {d} by {s} rows, where this rank holds {x.shape[d]}: the rolled "
                    "rows would come from ranks beyond its neighbours",
                    lay,
                    f"Give every rank along dim {d} at least {abs(s)} rows (fewer ranks along it), or roll by "
                    f"a shift of at most a shard (s - L rolls like s along a dim of length L).",
                )
            )
    out = torch.roll(x, [s for s, _ in local], [d for _, d in local]) if local else x
    if routed:
        g.acted = True  # not the plain call's result: compiling refuses it
        g.settle()  # before the exchanges: a rank that refused above meets the others here
    for s, d in routed:
        n, k = out.shape[d], abs(s)
        group = g.groups[lay[d][0][1]]
        if s > 0:  # the previous rank's last s rows, then this rank's first n - s
            out = HaloExchange1d.apply(out, d, group, (k, 0), (0, k), True).narrow(d, 0, n)
        else:  # this rank's last n - |s| rows, then the next rank's first |s|
            out = HaloExchange1d.apply(out, d, group, (0, k), (k, 0), True).narrow(d, k, n)
    if out is x:
        out = x.clone()  # a new tensor, as torch.roll returns
    return g.mark(out.contiguous(), lay)  # contiguous, as torch.roll returns (code views it: HF's Swin)


TABLE = {"roll": _roll}
