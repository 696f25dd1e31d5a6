"""Pure arithmetic of a domain-parallel convolution along one sharded dim (no torch.distributed).

Given every shard's length along the dim (any partition, empty shards
allowed), the kernel, stride, dilation and the two padding widths, it decides
which output rows each shard owns and which halo rows travel where.

Ownership: output row ``o`` reads input rows ``o*s - pl + [0, d(k-1)]``; it lives
on the shard holding the centre row ``o*s - pl + d(k-1)//2`` (clamped into
``[0, L)``), so with stride 1 and "same" padding every shard owns exactly its
own rows. A shard then needs input rows ``[need_lo, need_hi]``; what lies
before its first row arrives from the low neighbour (``recv.lo``), what lies
after its last from the high one; unneeded own rows are trimmed.

>>> p = plan_axis([5, 5], kernel=3, stride=1, dilation=1, pad=(1, 1), mode="zeros", what="H")
>>> [(a.recv, a.send, a.out_rows) for a in p]
[((1, 1), (0, 1), 5), ((1, 1), (1, 0), 5)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from tplayers.sharding import offsets_from_sizes

__all__ = ["AxisPlan", "plan_axis", "conv_out_len", "PADDING_MODES"]

PADDING_MODES = ("zeros", "circular", "reflect", "replicate")


@dataclass(frozen=True)
class AxisPlan:
    """One shard's part of a sharded conv dim.

    ``recv``/``send``: halo rows (lo, hi) exchanged with neighbours; ``boundary``:
    (lo, hi) rows this shard pads locally with ``mode`` (reflect / replicate at the
    global edge); ``trim``: (lo, hi) own rows it does not need; ``out_rows``:
    output rows it owns, starting at global output row ``out_start``.
    """

    recv: Tuple[int, int]
    send: Tuple[int, int]
    boundary: Tuple[int, int]
    trim: Tuple[int, int]
    out_start: int
    out_rows: int


def conv_out_len(length: int, kernel: int, stride: int, dilation: int, pad: Tuple[int, int]) -> int:
    """``nn.Conv2d``'s output length along one dim."""
    return (length + pad[0] + pad[1] - dilation * (kernel - 1) - 1) // stride + 1


def plan_axis(sizes: Sequence[int], *, kernel: int, stride: int, dilation: int, pad: Tuple[int, int],
              mode: str, what: str) -> List[AxisPlan]:
    """Plans for every shard of one dim, or ``ValueError`` when a shard cannot supply a halo.

    ``sizes`` are the shard lengths in mesh order; ``what`` names the dim in messages.
    """
    sizes = [int(s) for s in sizes]
    parts, length = len(sizes), sum(sizes)
    starts = offsets_from_sizes(sizes)
    span = dilation * (kernel - 1)
    out_len = conv_out_len(length, kernel, stride, dilation, pad)
    if out_len <= 0:
        raise ValueError(f"input {what} of {length} rows is smaller than the (dilated) kernel "
                         f"extent {span + 1} with padding {pad}")
    if mode != "zeros" and max(pad) > length - (mode == "reflect"):
        raise ValueError(f"padding {pad} along {what} is too large for {mode!r} padding of {length} rows")
    half = span // 2

    def first_output_at(t: int) -> int:
        """Smallest output row whose clamped centre is >= input row ``t``."""
        if t <= 0:
            return 0
        if t >= length:
            return out_len
        return min(out_len, max(0, -(-(t + pad[0] - half) // stride)))

    periodic = mode == "circular"
    raw = []
    for c in range(parts):
        oa, ob = first_output_at(starts[c]), first_output_at(starts[c] + sizes[c])
        if ob <= oa:
            raw.append((0, 0, 0, sizes[c], oa, 0))
            continue
        need_lo, need_hi = oa * stride - pad[0], (ob - 1) * stride - pad[0] + span  # inclusive
        stop = starts[c] + sizes[c]
        r_lo, r_hi = max(0, starts[c] - need_lo), max(0, need_hi + 1 - stop)
        t_lo, t_hi = max(0, need_lo - starts[c]), max(0, stop - 1 - need_hi)
        raw.append((r_lo, r_hi, t_lo, t_hi, oa, ob - oa))
    plans = []
    for c, (r_lo, r_hi, t_lo, t_hi, oa, rows) in enumerate(raw):
        has_lo, has_hi = periodic or c > 0, periodic or c < parts - 1
        for side, width, has, nb in (("low", r_lo, has_lo, c - 1), ("high", r_hi, has_hi, (c + 1) % parts)):
            if has and width > sizes[nb]:
                raise ValueError(
                    f"shard {nb} along {what} holds {sizes[nb]} rows but its neighbour, shard {c} "
                    f"({sizes[c]} rows), needs a {side} halo of {width} rows (shard sizes {sizes}); "
                    "use fewer ranks or a larger input"
                )
        boundary = (0 if has_lo or mode == "zeros" else r_lo, 0 if has_hi or mode == "zeros" else r_hi)
        if max(boundary) and sizes[c] < (max(boundary) + 1 if mode == "reflect" else 1):
            raise ValueError(f"edge shard {c} along {what} holds {sizes[c]} rows, too few to pad "
                             f"{boundary} rows with {mode!r} locally")
        send_lo = raw[c - 1][1] if has_lo else 0
        send_hi = raw[(c + 1) % parts][0] if has_hi else 0
        recv = (r_lo - boundary[0], r_hi - boundary[1])
        plans.append(AxisPlan(recv, (send_lo, send_hi), boundary, (t_lo, t_hi), oa, rows))
    return plans
