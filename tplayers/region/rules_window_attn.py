"""Attention per window: ``F.scaled_dot_product_attention`` over windows folded into the batch
(:mod:`tplayers.region.rules_windows`) runs locally; a replicated mask of the serial window count is cut to
this rank's windows.
"""

from __future__ import annotations

import torch

from tplayers.attention.sdpa import token_positions
from tplayers.domain.layout import prefix_of

__all__ = ["window_sdpa"]


def window_sdpa(g, args, kwargs):
    """``F.scaled_dot_product_attention`` over windows folded into the batch (queries, keys and values of one
    layout, sharded along batch dims only, their token and channel dims whole): each window's attention is
    local. A replicated ``attn_mask`` of size 1 along the sharded dims broadcasts as is; one with a sharded
    dim's full serial length (the shift mask expanded over the serial windows, HF's and timm's fused path)
    is cut to this rank's windows; its gradient (a relative position bias) is summed over the mesh. ``None``
    when the call is not of that kind (the full-attention route decides)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    a = dict(zip(names, args))
    a.update(kwargs)
    q, k, v = a.get("query"), a.get("key"), a.get("value")
    lay = g.layout(q)
    if lay is None or g.layout(k) != lay or g.layout(v) != lay or lay[-1] is not None or lay[-2] is not None:
        return None
    if any(prefix_of(e) for e in lay):
        return None
    if a.get("dropout_p", 0.0):
        raise g.error("F.scaled_dot_product_attention with dropout_p > 0 over windows", lay)
    mask = a.get("attn_mask")
    axes = tuple(sorted({x for e in lay if e for _, x in e if x is not None}))
    if isinstance(mask, torch.Tensor) and g.layout(mask) is None:
        mask = g.bound(mask, axes) if mask.is_floating_point() else mask  # summed at its full size, then cut
        mask = _cut(g, mask, q, lay)
    elif isinstance(mask, torch.Tensor) and g.layout(mask)[:-2] != lay[len(lay) - mask.dim() : -2]:
        raise g.error("F.scaled_dot_product_attention with an attn_mask sharded unlike the windows", lay)
    g.acted = True
    kw = {n: a[n] for n in ("is_causal", "scale", "enable_gqa") if n in a}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    return g.mark(out, lay)


def _cut(g, mask, q, lay):
    """A replicated mask aligned right with ``q``'s scores, cut to this rank's rows along each sharded dim where
    it has the serial length (``index_select`` by the global positions of the rank's elements)."""
    out = mask
    for d, e in enumerate(lay[:-2]):
        k = d - (q.dim() - mask.dim())
        if e is None or k < 0 or int(mask.shape[k]) == 1:
            continue
        pos, total = token_positions([s for s, _ in e], [x for _, x in e], g.mesh)
        if int(mask.shape[k]) != total:
            raise g.error(
                f"F.scaled_dot_product_attention with a replicated attn_mask of length {mask.shape[k]} along a "
                f"sharded dim of serial length {total} (this rank's windows: {int(q.shape[d])})",
                lay,
            )
        out = out.index_select(k, pos.to(out.device))
    return out
