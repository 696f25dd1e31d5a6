"""Region-guard rules for ViT-style token layouts: prefix tokens before sharded pixel tokens (issue 31).

A ViT embeds the pixels as tokens (``conv(x).flatten(2).transpose(1, 2)``: the token dim holds the
sharded rows, :mod:`tplayers.domain.layout`), puts a replicated CLS token (DeiT: and a distillation
token; registers) before them, runs attention over all tokens and pools with ``x[:, 0]``. Here:

* ``torch.cat((cls, tokens), dim=1)`` of replicated tensors before one tensor sharded along that dim
  (and whole elsewhere) gives the *prefix layout* (:func:`~tplayers.domain.layout.add_prefix`): the
  ``k`` prefix tokens live on the entry's first rank (coordinate 0 along its mesh dims), before its
  own pixel tokens; the other ranks hold their pixel tokens only (they keep an empty slice of the
  prefix in the graph, so the prefix's gradient is summed over the mesh on every rank:
  :meth:`~tplayers.region.guard.RegionGuard.bound`). Pointwise ops between tensors of the same
  prefix layout, channel ops, views keeping the token dim whole, and attention without a mask
  (``F.scaled_dot_product_attention``, routed to the full-attention core: every token on exactly
  one rank) then run as for any sharded layout;
* ``x[:, i]`` for a prefix token ``i < k`` (``x[:, 0]``: the CLS token, ``x[:, 0, :]``) and
  ``x[:, a:b]`` inside the prefix are replicated: the first rank's rows, summed over the mesh with
  zeros from the others (:class:`~tplayers.domain.boundary.ShardedToReplicated`: the gradient
  reaches the first rank's tokens once; the others' zeros are made from their slice, so their
  backward runs too and receives what attention sends them); ``x[:, k:]`` drops the prefix (the
  pixel tokens, sharded);
* a replicated operand of a pointwise op spanning a sharded dim at its *global* length (learned
  position embeddings ``(1, 1 + N, D)`` added after the CLS ``cat``, as timm's ViT does, or
  ``(1, N, D)`` added to the patch tokens, as MONAI's ``PatchEmbeddingBlock`` does) is sliced to this
  rank's elements first (:func:`pointwise`);
* anything else indexing a prefixed dim, a mask or ``is_causal`` over prefixed tokens, and a view
  merging the token dim with others are refused on every rank (decided from layouts alone).

The other indexing and ``cat`` calls go to :mod:`tplayers.region.rules_views` (looked up per call).
"""

from __future__ import annotations

import torch

from tplayers.attention.sdpa import token_positions
from tplayers.domain.boundary import ShardedToReplicated
from tplayers.domain.layout import add_prefix, drop_prefix, mesh_dims_of, prefix_of, sharded_dims
from tplayers.region import rules_views
from tplayers.region.rules import op_name, run_pointwise
from tplayers.region.rules_broadcast import either_of

__all__ = ["TABLE", "LOCAL", "pointwise"]


def _first(g, axes) -> bool:
    """Whether this rank holds an entry's prefix: coordinate 0 along every mesh dim it is sharded over."""
    return all(g.mesh.get_local_rank(a) == 0 for a in axes)


def _groups(g, axes):
    return [g.groups[a] for a in axes if g.groups[a].size() > 1]


def _decided(g, args, kwargs):
    """``args`` / ``kwargs`` with every undecided broadcast map (``F.interpolate`` of a pooled map to equal
    local shares, :func:`~tplayers.region.rules_broadcast.either_of`) replaced by its shares reading."""
    if not g.either:
        return args, kwargs
    pick = lambda t: either_of(g, t) if either_of(g, t) is not None else t  # noqa: E731
    swap = lambda v: type(v)(pick(t) for t in v) if isinstance(v, (list, tuple)) else pick(v)  # noqa: E731
    return tuple(swap(v) for v in args), {k: swap(v) for k, v in kwargs.items()}


def _cat(g, func, args, kwargs):
    args, kwargs = _decided(g, args, kwargs)
    tensors = list(args[0]) if args else list(kwargs.get("tensors"))
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    lays = [g.layout(t) for t in tensors]
    last = lays[-1]
    d = dim % tensors[-1].dim() if tensors and tensors[-1].dim() else 0
    prefix_case = (
        func.__name__ != "stack"
        and len(tensors) > 1
        and last is not None
        and all(la is None for la in lays[:-1])
        and d in sharded_dims(last)
        and not prefix_of(last[d])
    )
    if not prefix_case:
        return rules_views.VIEWS[func.__name__](g, func, args, kwargs)
    if [e for i, e in enumerate(last) if i != d and e is not None]:
        raise g.error(f"{op_name(func)} of prefix tokens before tokens sharded along other dims too", last)
    axes = mesh_dims_of(last, (d,))
    k = sum(int(t.shape[d]) for t in tensors[:-1])
    reps = [g.bound(t, axes) for t in tensors[:-1]]
    if not _first(g, axes):  # an empty slice keeps the prefix in the graph (its gradient sum runs on every rank)
        reps = [t.narrow(d, 0, 0) for t in reps]
    g.acted = True
    out = torch.cat(reps + [tensors[-1]], dim=d)
    layout = tuple(add_prefix(e, k) if i == d else e for i, e in enumerate(last))
    return g.mark(out, layout)


def _items_by_dim(x, idx):
    """``{tensor dim: item}`` for an index of plain items (ints, slices, ``None``, one ``...``); ``None``
    for advanced indexing (tensors, lists, bools)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(i, (torch.Tensor, list, bool)) for i in items):
        return None
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, d = {}, 0
    for item in items:
        if item is None:
            continue
        if item is Ellipsis:
            d += x.dim() - used
            continue
        out[d] = item
        d += 1
    return out


def _idx_items(idx) -> tuple:
    return idx if isinstance(idx, tuple) else (idx,)


def _getitem(g, func, args, kwargs):
    x, idx = args[0], args[1]
    lay = g.layout(x)
    if lay is None or not any(prefix_of(e) for e in lay):
        return rules_views.VIEWS["__getitem__"](g, func, args, kwargs)
    d = next(i for i, e in enumerate(lay) if prefix_of(e))
    by_dim = _items_by_dim(x, idx)
    full = lambda i: isinstance(i, slice) and i == slice(None)  # noqa: E731
    if by_dim is not None and full(by_dim.get(d, slice(None))):  # the token dim untouched: as any layout
        return rules_views.VIEWS["__getitem__"](g, func, args, kwargs)
    plain = by_dim is not None and all(full(i) for j, i in by_dim.items() if j != d) and None not in _idx_items(idx)
    hit = (d, by_dim[d]) if plain else None
    k = prefix_of(lay[d])
    axes = mesh_dims_of(lay, (d,))
    first = _first(g, axes)
    if hit is not None and isinstance(hit[1], int) and not isinstance(hit[1], bool) and 0 <= hit[1] < k:
        start, stop, keep = hit[1], hit[1] + 1, False
    elif hit is not None and isinstance(hit[1], slice) and hit[1].step in (None, 1):
        start, stop = hit[1].start or 0, hit[1].stop
        if start == k and stop is None:  # the pixel tokens: the prefix dropped
            out = x.narrow(d, k, x.shape[d] - k) if first else x.narrow(d, 0, x.shape[d])
            return g.mark(out, tuple(drop_prefix(e) if i == d else e for i, e in enumerate(lay)))
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= k):
            start = None
        keep = True
    else:
        start = None
    if start is None:
        raise g.error(
            f"indexing the token dim {d}, which holds {k} prefix token(s) (a CLS token) before sharded pixel "
            f"tokens, with {idx!r}",
            lay,
            f"Supported: x[:, i] for a prefix token (i < {k}), x[:, a:b] inside the prefix, x[:, {k}:] for the "
            "pixel tokens.",
        )
    if [e for i, e in enumerate(lay) if i != d and e is not None]:
        raise g.error("a prefix token of a tensor sharded along other dims too", lay)
    g.acted = True
    g.settle()  # before the all-reduce (this rule is listed as local: its other paths never communicate)
    shape = list(x.shape)
    shape[d] = stop - start
    if first:
        part = x.narrow(d, start, stop - start)
    else:  # zeros that stay in x's graph: this rank's backward still runs (the attention's K/V gradients)
        part = x.narrow(d, 0, 0).sum(d, keepdim=True).expand(shape)
    out = ShardedToReplicated.apply(part, _groups(g, axes)) if _groups(g, axes) else part
    return out if keep else out.squeeze(d)


def _entry_positions(g, entry):
    """Global indices of this rank's elements along a dim with layout ``entry`` and the global length
    (one small all-gather: :func:`~tplayers.attention.sdpa.token_positions`)."""
    k = prefix_of(entry)
    plain = drop_prefix(entry)
    pos, total = token_positions([s for s, _ in plain], [a for _, a in plain], g.mesh)
    if k:
        pos = pos + k
        if _first(g, mesh_dims_of((plain,))):
            pos = torch.cat((torch.arange(k, dtype=pos.dtype, device=pos.device), pos))
    return pos, total + k


def pointwise(g, func, args, kwargs):
    """A pointwise op (:func:`~tplayers.region.rules.run_pointwise`) whose replicated operands may span a
    sharded dim at its *global* length (learned position embeddings ``(1, N, D)`` added to tokens
    sharded along the flattened pixels, timm's ``x + pos_embed`` after the CLS ``cat``, a full-size
    bias map): each rank takes its rows of such an operand (``index_select`` by the global positions
    of its elements, the operand's gradient summed over the mesh), so the serial pairing is kept.
    Which operands are looked at is read from shapes of replicated tensors and from layouts (the same
    on every rank); their global lengths are exchanged (one small all-gather per such dim and call).
    An operand whose length is neither 1 nor the global one is refused as before."""
    args, kwargs = _decided(g, args, kwargs)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    lays = [g.layout(t) for t in tensors]
    reps = [t for t, la in zip(tensors, lays) if la is None and t.dim() and max(t.shape) > 1]
    if not reps:  # the common case: replicated operands of size 1 along every dim that could matter
        return run_pointwise(g, func, args, kwargs, tensors)
    sharded = [(t, la) for t, la in zip(tensors, lays) if la is not None]
    written = args[0] if args and getattr(func, "__name__", "").endswith("_") else None
    todo = []
    for t in reps:
        if t is written or g.uniform(t):
            continue
        dims = {}
        for ref, lay in sharded:
            for d in sharded_dims(lay):
                k = d - (ref.dim() - t.dim())
                if k >= 0 and int(t.shape[k]) != 1:
                    dims.setdefault(k, lay[d])
        if dims:
            todo.append((t, dims))
    if not todo:
        return run_pointwise(g, func, args, kwargs)
    g.settle()  # before the exchanges (this rule is listed as local otherwise)
    g.arm()  # a "replicated" operand of a local shape (a written constant) may match on some ranks only
    swap = {}
    for t, dims in todo:
        picked, layout = t, [None] * t.dim()
        for k, entry in sorted(dims.items()):
            pos, total = _entry_positions(g, entry)
            if int(t.shape[k]) != total:
                picked = None  # neither 1 nor the global length: refused by the usual check
                break
            if picked is t:
                picked = g.bound(t, mesh_dims_of(tuple(dims.values())))
            picked = picked.index_select(k, pos.to(t.device))
            layout[k] = entry
        if picked is not None:
            g.acted = True
            swap[id(t)] = g.mark(picked, tuple(layout))
    args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {n: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}
    return run_pointwise(g, func, args, kwargs)


TABLE = {"cat": _cat, "concat": _cat, "concatenate": _cat, "__getitem__": _getitem}

#: rules the dispatch treats as local (``_getitem`` and ``pointwise`` settle themselves before communicating)
LOCAL = (_cat, _getitem, pointwise)
