"""Which rule handles an op on domain-sharded data: the guard's dispatch table.

The table joins the generic rules (:mod:`tplayers.region.rules`: pointwise, views, reductions
along dims, values), the op rules (:mod:`tplayers.region.rules_ops`: reductions, norms, cat, ...),
linear algebra (:mod:`tplayers.region.rules_linalg`: products, hand-written attention gathered), the routes (:mod:`tplayers.region.rules_route`: interpolate, pools, pads, attention) and the
vision rules (:mod:`tplayers.region.rules_vision`: channel dropout, pixel shuffle, mirrored pads), ``torch.roll``
(:mod:`tplayers.region.rules_roll`), the per-pixel rules (:mod:`tplayers.region.rules_pixels`: ``cdist``
against a codebook, embedding lookups), functional convolutions routed to the window core
(:mod:`tplayers.region.rules_conv`) and prefix tokens before sharded pixel tokens
(:mod:`tplayers.region.rules_tokens`: a ViT's CLS token). An op with
no rule is refused (deny by default). See ``docs/design.md`` (the region guard).
"""

from __future__ import annotations

import functools
from typing import Any, Dict

from tplayers.domain.layout import LayoutError
from tplayers.region import (
    rules_conv,
    rules_fft,
    rules_linalg,
    rules_ops,
    rules_pixels,
    rules_roll,
    rules_route,
    rules_tokens,
    rules_vision,
)
from tplayers.region.rules import (
    _PASS,
    _PRESERVE,
    _VALUES,
    _getter,
    _passthrough,
    _pointwise_names,
    _preserve,
    _refuse_value,
    first_sharded,
    op_name,
    run_pointwise,
)
from tplayers.region.rules_views import ALONG, VIEWS

__all__ = ["handle"]


@functools.lru_cache(maxsize=None)
def _table() -> Dict[str, Any]:
    table: Dict[str, Any] = {n: _preserve for n in _PRESERVE}
    table.update({n: _passthrough for n in _PASS})
    table.update({n: _refuse_value for n in _VALUES})
    table.update(VIEWS)
    table.update(ALONG)
    table.update(rules_ops.TABLE)
    table.update(rules_linalg.TABLE)
    table.update(rules_route.TABLE)
    table.update(rules_fft.TABLE)
    table.update(rules_vision.TABLE)
    table.update(rules_roll.TABLE)
    table.update(rules_pixels.TABLE)
    table.update(rules_conv.TABLE)
    table.update(rules_tokens.TABLE)  # prefix tokens first; the rest goes on to rules_views
    return table


@functools.lru_cache(maxsize=None)
def _local() -> frozenset:
    """The rules that never communicate: a guard settles its armed decisions before any other
    (see :meth:`~tplayers.region.guard.RegionGuard.settle`; an unlisted rule counts as communicating)."""
    return frozenset(
        [
            _preserve,
            _passthrough,
            _refuse_value,
            _getter,
            run_pointwise,
            *VIEWS.values(),
            *ALONG.values(),
            *rules_ops.LOCAL,
            *rules_linalg.LOCAL,
            *rules_vision.LOCAL,
            *rules_pixels.LOCAL,
            *rules_tokens.LOCAL,
        ]
    )


def handle(g, func, args, kwargs):
    """Apply the guard's rule for ``func`` to a call touching sharded data."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        if getattr(func.__self__, "__name__", "") == "shape":
            g.note_read(args[0])
            return g.lengths(args[0], _getter(g, func, args, kwargs))
        return _getter(g, func, args, kwargs)
    if name in ("size", "__len__"):
        dim = 0 if name == "__len__" else kwargs.get("dim", args[1] if len(args) > 1 else None)
        g.note_read(args[0], dim if isinstance(dim, int) else None)
        if name == "size":
            return g.lengths(args[0], func(*args, **kwargs), dim)
    handler = _table().get(name)
    if handler is None and name in _pointwise_names():
        handler = rules_tokens.pointwise  # run_pointwise, full-size replicated operands sliced first
    if handler is None:
        t, lay = first_sharded(g, args, kwargs)
        raise g.refuse(
            g.error(
                f"{op_name(func)} is not known to be exact on sharded data",
                lay,
                "Use a tplayers twin or tplayers.functional for it, or move it outside the domain region.",
            )
        )
    if g.pending and handler not in _local():
        g.settle()  # before the rule's collectives
    try:
        return handler(g, func, args, kwargs)
    except LayoutError as e:
        t, lay = first_sharded(g, args, kwargs)
        raise g.refuse(g.error(f"{op_name(func)}: {e}", lay)) from None
    except Exception as e:
        if not g.pending:
            raise
        raise g.refuse(e) from e
