"""Neighborhood attention on a query sub-window given only the keys it needs (test helper).

This is how the domain-parallel layer calls the op: a rank's queries, the key span they read,
and their offsets in the global image. Also the C kernel builds this host runs, for tests that
run each, and the random 1-D windows wider than a vector the line kernels' tests draw.
"""

from __future__ import annotations

from tplayers.ops import na_cpu
from tplayers.ops.na_engine import neighborhood_attention
from tplayers.ops.na_layout import key_span


def na_on_subwindow(ins, size, kernel, dilation, causal, box, **kw):
    """``neighborhood_attention`` of the queries ``box = (q0, q1, c0, c1)`` of an image of
    ``size = (h, w)``, with ``ins = (q, k, v, rel_pos_bias)`` the whole image's tensors: keys and
    values cut to the span those queries read. ``kw`` goes to the op (scale, tile, ...)."""
    (h, w), (q0, q1, c0, c1) = size, box
    kr = key_span(q0, q1, length=h, kernel=kernel[0], dilation=dilation[0], causal=causal[0])
    kc = key_span(c0, c1, length=w, kernel=kernel[1], dilation=dilation[1], causal=causal[1])
    return neighborhood_attention(
        ins[0][:, q0:q1, c0:c1],
        ins[1][:, kr[0] : kr[1], kc[0] : kc[1]],
        ins[2][:, kr[0] : kr[1], kc[0] : kc[1]],
        kernel,
        dilation,
        causal,
        global_size=(h, w),
        q_offset=(q0, c0),
        k_offset=(kr[0], kc[0]),
        rel_pos_bias=ins[3],
        **kw,
    )


def isas_this_host_runs() -> list:
    """The ISAs whose C kernel build this CPU runs (its own and every narrower one)."""
    order = list(na_cpu.ISAS)
    return order[order.index(na_cpu.host_isa()) :]


def wide_1d_window(rng, lanes: int) -> tuple:
    """A random 1-D call whose window is wider than ``lanes``: ``(kernel, stride, dilation, causal,
    length, heads, kv_heads, with_bias)`` (lengths from the window's span to 20 vectors past it; the
    bias only with stride 1), drawn from ``rng`` (a ``random.Random``)."""
    kernel = rng.randint(lanes + 1, 5 * lanes)
    stride = rng.choice([1, 1, 1, rng.randint(1, kernel)])
    dil = rng.choice([1, 1, 1, 2, 3])
    causal = rng.random() < 0.35
    size = kernel * dil + rng.choice([0, 3, 17, 2 * lanes + 5, 9 * lanes + 3, 20 * lanes + 1])
    heads = rng.choice([1, 2, 3])
    kv_heads = rng.choice([h for h in (1, 2, 3) if heads % h == 0])
    with_bias = stride == 1 and rng.random() < 0.5
    return kernel, stride, dil, causal, size, heads, kv_heads, with_bias
