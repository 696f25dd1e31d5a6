"""Window-op axis plans: which global input rows each owned output row reads (pure arithmetic).

Every domain-parallel spatial layer is a *window op* along each sharded dim:
output row ``o`` reads the (extended) input rows ``window(o)`` (convolution and
pooling: ``o*s - pl + [0, d(k-1)]``; interpolation: the rows its taps touch;
rows outside ``[0, L)`` are boundary rows: zeros, a constant, reflected,
replicated, or wrapped for a periodic domain). Windows are monotone in ``o``,
so the rows a shard's outputs ``[o0, o1)`` read form one range ``[a, b)``.

Partition rule (docs/design.md, the partition rule): a layer whose output length equals its input
length keeps the input's partition; any other layer gives the balanced
``shard_sizes(L_out, n)`` (:func:`out_partition`), so features at one
resolution share one partition whatever path produced them.

Given every shard's input length and its needed range, :func:`plan_ranges`
says which rows arrive from the low / high neighbour (``recv``), which of its
own edge rows each neighbour needs (``send``), which boundary rows it pads
locally (``boundary``) and which rows it drops (``trim``). Halos come from the
adjacent shards only; a shard too small to supply one is a ``ValueError``
naming the shard, its size and the halo (raised identically on every rank,
because every rank plans every shard). A transposed convolution uses the same
plan in the adjoint direction (its partial output rows are added into their
owners).

>>> p = plan_windows([5, 5], 10, conv_window(3, 1, 1, 1), mode="zeros", what="H")
>>> [(a.recv, a.send, a.boundary, a.out_rows) for a in p]
[((1, 1), (0, 1), (0, 0), 5), ((1, 1), (1, 0), (0, 0), 5)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from tplayers.sharding import offsets_from_sizes, shard_sizes

__all__ = [
    "AxisPlan",
    "EdgeGeometry",
    "PADDING_MODES",
    "edge_geometry",
    "uniform_geometry",
    "plan_ranges",
    "plan_windows",
    "out_partition",
    "conv_window",
    "conv_out_len",
    "pool_out_len",
    "transposed_out_len",
    "transposed_needs",
]

PADDING_MODES = ("zeros", "circular", "reflect", "replicate")
# Boundary modes of the plan: the conv padding modes plus "fill" (a constant, e.g. -inf for max pooling).
_MODES = PADDING_MODES + ("fill",)

Range = Tuple[int, int]
Window = Callable[[int, int], Range]


@dataclass(frozen=True)
class AxisPlan:
    """One shard's part of one sharded dim.

    ``recv`` / ``send``: halo rows (lo, hi) exchanged with the neighbours (a neighbour's
    ``send`` equals the facing ``recv``); ``boundary``: (lo, hi) rows padded locally outside
    the global ``[0, L)`` (zeros / fill / reflect / replicate); ``trim``: (lo, hi) rows dropped
    after that, so the result is exactly the needed range starting at global row ``in_start``;
    ``out_start`` / ``out_rows``: the output rows this shard owns.
    """

    recv: Range
    send: Range
    boundary: Range
    trim: Range
    in_start: int
    out_start: int
    out_rows: int

    @property
    def exchanges(self) -> bool:
        """Whether this shard sends or receives anything along this dim."""
        return bool(self.recv[0] or self.recv[1] or self.send[0] or self.send[1])


def out_partition(sizes: Sequence[int], out_len: int) -> List[int]:
    """The output partition: the input's when the length is kept, else balanced."""
    sizes = [int(s) for s in sizes]
    return sizes if out_len == sum(sizes) else shard_sizes(out_len, len(sizes))


def conv_out_len(length: int, kernel: int, stride: int, dilation: int, pad: Range) -> int:
    """``nn.ConvNd``'s output length along one dim."""
    return (length + pad[0] + pad[1] - dilation * (kernel - 1) - 1) // stride + 1


def pool_out_len(length: int, kernel: int, stride: int, dilation: int, pad: int, ceil_mode: bool) -> int:
    """``nn.MaxPoolNd`` / ``nn.AvgPoolNd``'s output length (PyTorch's ceil-mode rule included)."""
    span = dilation * (kernel - 1) + 1
    out = (length + 2 * pad - span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= length + pad:
        out -= 1  # the last window must start inside the input or the left padding
    return out


def transposed_out_len(length: int, kernel: int, stride: int, dilation: int, pad: int, output_padding: int) -> int:
    """``nn.ConvTransposeNd``'s output length along one dim."""
    return (length - 1) * stride - 2 * pad + dilation * (kernel - 1) + output_padding + 1


def conv_window(kernel: int, stride: int, dilation: int, pad_lo: int) -> Window:
    """Rows ``[a, b)`` read by output rows ``[o0, o1)`` of a convolution or pooling window."""
    span = dilation * (kernel - 1)

    def window(o0: int, o1: int) -> Range:
        return o0 * stride - pad_lo, (o1 - 1) * stride - pad_lo + span + 1

    return window


def transposed_needs(sizes: Sequence[int], kernel: int, stride: int, dilation: int, pad: int) -> List[Optional[Range]]:
    """Output rows ``[a, b)`` each shard's input rows reach in a transposed convolution (``None``: none)."""
    starts = offsets_from_sizes(sizes)
    span = dilation * (kernel - 1)
    return [(i0 * stride - pad, (i0 + n - 1) * stride - pad + span + 1) if n else None for i0, n in zip(starts, sizes)]


def plan_windows(sizes: Sequence[int], out_len: int, window: Window, *, mode: str, what: str) -> List[AxisPlan]:
    """Plans of every shard for a window op with ``out_len`` outputs (partition by :func:`out_partition`)."""
    if out_len <= 0:
        raise ValueError(f"the output along {what} would have {out_len} rows (input of {sum(sizes)} rows)")
    outs = out_partition(sizes, out_len)
    needs = [window(o0, o0 + n) if n else None for o0, n in zip(offsets_from_sizes(outs), outs)]
    return plan_ranges(sizes, needs, outs, mode=mode, what=what)


def plan_ranges(
    sizes: Sequence[int], needs: Sequence[Optional[Range]], outs: Sequence[int], *, mode: str, what: str
) -> List[AxisPlan]:
    """Plans for shards of lengths ``sizes`` that need the extended rows ``needs[c] = [a, b)``.

    ``outs`` are the output rows each shard owns (recorded in the plans). ``ValueError`` when an
    adjacent shard cannot supply a halo, or an edge shard cannot pad its boundary locally.
    """
    assert mode in _MODES, mode
    sizes = [int(s) for s in sizes]
    parts, length = len(sizes), sum(sizes)
    starts, out_starts = offsets_from_sizes(sizes), offsets_from_sizes(outs)
    periodic = mode == "circular"
    raw = []  # per shard: recv lo/hi, boundary lo/hi, trim lo/hi, in_start
    for c in range(parts):
        s, e = starts[c], starts[c] + sizes[c]
        if needs[c] is None or needs[c][1] <= needs[c][0]:
            raw.append((0, 0, 0, 0, 0, sizes[c], s))  # needs nothing: drop every own row
            continue
        a, b = needs[c]
        if periodic:  # rows beyond the ends come from the wrapped neighbours
            bl = bh = 0
            ca, cb = a, b
        else:  # rows beyond the ends are padded locally
            bl, bh = max(0, -a), max(0, b - length)
            ca, cb = min(max(a, 0), length), min(max(b, 0), length)
        r_lo, r_hi = max(0, s - ca), max(0, cb - e)
        p0, p1 = min(s, ca) - bl, max(e, cb) + bh  # rows held after exchange and boundary padding
        raw.append((r_lo, r_hi, bl, bh, a - p0, p1 - b, a))
    plans = []
    for c, (r_lo, r_hi, bl, bh, t_lo, t_hi, in_start) in enumerate(raw):
        has_lo, has_hi = periodic or c > 0, periodic or c < parts - 1
        for side, width, has, nb in (("low", r_lo, has_lo, (c - 1) % parts), ("high", r_hi, has_hi, (c + 1) % parts)):
            if width and (not has or width > sizes[nb]):
                raise ValueError(
                    f"shard {nb if has else '-'} along {what} holds {sizes[nb] if has else 0} rows but its "
                    f"neighbour, shard {c} ({sizes[c]} rows), needs a {side} halo of {width} rows (shard sizes "
                    f"{sizes}); use fewer ranks or a larger input"
                )
        held = sizes[c] + r_lo + r_hi
        if mode in ("reflect", "replicate") and max(bl, bh):
            need = max(bl, bh) + 1 if mode == "reflect" else 1
            if held < need:
                raise ValueError(
                    f"shard {c} along {what} holds {held} rows (with halos), too few to pad "
                    f"{(bl, bh)} boundary rows with {mode!r} locally (needs {need})"
                )
        send_lo = raw[(c - 1) % parts][1] if has_lo else 0
        send_hi = raw[(c + 1) % parts][0] if has_hi else 0
        # Zeros beyond the global edge of an edge shard: the exchange zero-fills them in its buffer
        # (no separate padding copy; the buffer keeps its memory format).
        zl = bl if mode == "zeros" and not has_lo else 0
        zh = bh if mode == "zeros" and not has_hi else 0
        plans.append(
            AxisPlan(
                (r_lo + zl, r_hi + zh),
                (send_lo, send_hi),
                (bl - zl, bh - zh),
                (t_lo, t_hi),
                in_start,
                out_starts[c],
                int(outs[c]),
            )
        )
    return plans


class EdgeGeometry(NamedTuple):
    """Where the halo rows meet the output along the exchanged dim of a main-plus-strips convolution
    (:func:`tplayers.layers._conv_run.halo_conv`; Python ints).

    ``pad``: the halo width ``r`` on each side (the main convolution's padding there);
    ``lo``: ``(strip rows,)`` of the low strip, whose outputs are rows ``[0, m)``, or ``None``;
    ``hi``: ``(first output row, strip rows, first halo row in the strip)`` of the high one, or ``None``.
    """

    pad: int
    lo: Optional[Tuple[int]]
    hi: Optional[Tuple[int, int, int]]


def edge_geometry(
    n: int, r: int, extent: int, stride: int, n_out: int, has_lo: bool, has_hi: bool
) -> Optional[EdgeGeometry]:
    """The strips of a window of ``extent`` rows (dilation included) and ``stride`` over ``n`` own rows
    padded by ``r`` on each side; ``None`` where that does not give ``n_out`` outputs, or a strip
    would not hold its whole halo (a padding wider than the window, a stride longer than it).

    >>> edge_geometry(8, 1, 3, 1, 8, True, True)      # 3x3 "same": one edge row each side
    EdgeGeometry(pad=1, lo=(3,), hi=(7, 3, 2))
    """
    total = n + 2 * r
    if n_out <= 0 or n_out != (total - extent) // stride + 1:
        return None
    lo = hi = None
    if has_lo and r:
        m = min(-(-r // stride), n_out)  # outputs whose window starts inside the low halo
        lo = ((m - 1) * stride + extent,)
        if lo[0] < r:
            return None
    if has_hi and r:
        first = max(0, (r + n - extent) // stride + 1)  # outputs whose window ends inside the high halo
        start = r + n - first * stride
        if start < 0:
            return None
        hi = (first, total - first * stride, start)
    return EdgeGeometry(r, lo, hi)


def uniform_geometry(
    plans: Sequence[AxisPlan], sizes: Sequence[int], coord: int, r: int, extent: int, stride: int, zero_padded: bool
) -> Optional[EdgeGeometry]:
    """Shard ``coord``'s :class:`EdgeGeometry` where every shard's plan (``plans`` of the dim's shards of
    ``sizes`` rows) follows the main-plus-strips rule: zero padding ``r`` on both sides
    (``zero_padded``), each side filled by exactly ``r`` halo rows or ``r`` boundary zeros, nothing
    trimmed, output rows everywhere; else ``None``. Decided from every shard's plan, so that every
    rank takes the same path (the same messages). ``r = 0`` (a one-pixel convolution, patches that stay
    inside every shard): no halo and no strips, the main convolution of the local input alone.

    >>> plans = plan_windows([5, 3], 8, conv_window(3, 1, 1, 1), mode="zeros", what="dim 2")
    >>> uniform_geometry(plans, [5, 3], 1, 1, 3, 1, True)
    EdgeGeometry(pad=1, lo=(3,), hi=None)
    """
    if not zero_padded or r < 0:
        return None
    out, last = [], len(plans) - 1
    for c, (p, n) in enumerate(zip(plans, sizes)):
        # each side: r rows, zeros at the domain's ends (a plan may count those as received), the
        # neighbour's face inside; nothing trimmed
        if p.trim != (0, 0) or any(p.recv[i] + p.boundary[i] != r for i in (0, 1)):
            return None
        if (c > 0 and plans[c - 1].send[1] != r) or (c < last and plans[c + 1].send[0] != r):
            return None
        g = edge_geometry(n, r, extent, stride, p.out_rows, c > 0, c < last)
        if g is None:
            return None
        out.append(g)
    return out[coord]
