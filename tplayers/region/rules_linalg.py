"""Region-guard rules for linear algebra: ``F.linear``, ``matmul`` / ``bmm`` / ``mm`` / ``baddbmm`` /
``addmm``, ``torch.einsum``.

A product is local where every output element's sum stays on one rank: batch dims sharded alike, rows
of one operand sharded, the contracted dim whole. Attention written out by hand (``q @ k.transpose(-2,
-1)``, softmax, ``@ v``; einsum's ``'bhxd,bhyd->bhxy'`` then ``'bhxy,bhyd->bhxd'``; MONAI's
``WindowAttention`` and ``SABlock``, smp's position attention) pairs sharded tokens with sharded
tokens, or contracts tokens that one operand holds whole (the scores' key dim) and the other holds
sharded (the values). Such an operand is gathered whole along that dim, in the serial order
(:func:`gather_serial`: an all-gather per sharded factor of the dim; its gradient summed over the mesh
and cut back to this rank's rows), so each rank computes its rows of the serial product: exact, at the
memory of this rank's rows of the serial scores plus the whole keys and values. Where both operands
hold the same rows of a contracted dim (a Gram matrix over pixels, ``x.flatten(2) @ x.flatten(2).mT``),
each rank multiplies its own rows and the partial products are summed over the mesh (identity in
backward). Prefix tokens (a CLS token before sharded pixels, on the first rank) are gathered with them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from tplayers.comm.collectives import gather_along_dim, reduce_from_parallel_region
from tplayers.domain.layout import LayoutError, broadcast_layouts, mesh_dims_of, prefix_of, sharded_dims
from tplayers.region.lengths import Root
from tplayers.region.rules import first_sharded, op_name
from tplayers.region.rules_ops import _bind
from tplayers.region.rules_slices import fit

__all__ = ["TABLE", "LOCAL", "gather_serial"]


def gather_serial(g, t: torch.Tensor, dim: int) -> Tuple[torch.Tensor, Optional[tuple]]:
    """``t`` with its sharded dim ``dim`` gathered whole in the serial order, and the layout left (``None``:
    nothing sharded). A dim merging factors (flattened pixels ``H*W``, sharded over one or two mesh
    dims) is unflattened into its factors, each sharded factor all-gathered over its mesh dim, and
    flattened back: the serial row-major order. Prefix tokens (a CLS token), held by the first rank along
    the entry's mesh dims, are gathered from it and put first. The gradient keeps this rank's rows (sum it
    over the mesh first: :meth:`~tplayers.region.guard.RegionGuard.bound`)."""
    lay = g.layout(t)
    dim = dim % t.dim()
    entry = lay[dim]
    rest = lay[:dim] + (None,) + lay[dim + 1 :]
    k = prefix_of(entry)
    if k:
        pixels = entry[1:]
        axes = [a for _, a in pixels if a is not None]
        pre = k if all(g.mesh.get_local_rank(a) == 0 for a in axes) else 0  # the first rank holds the prefix
        head, body = t.narrow(dim, 0, pre), t.narrow(dim, pre, int(t.shape[dim]) - pre)
        for a in axes:  # from the first rank to every rank, one mesh dim at a time
            head = gather_along_dim(head, dim, g.groups[a], Root(int(head.shape[dim]), g.groups[a], a).sizes())
        x = torch.cat([head, _gather_grid(g, body, dim, pixels)], dim)
    else:
        x = _gather_grid(g, t, dim, entry)
    return x, (rest if sharded_dims(rest) else None)


def _gather_grid(g, t: torch.Tensor, dim: int, factors) -> torch.Tensor:
    """``t``'s dim ``dim`` (row-major ``factors``, each ``(local size, mesh dim or None)``) gathered whole."""
    x = t.unflatten(dim, [int(s) for s, _ in factors]) if len(factors) > 1 else t
    for i, (s, a) in enumerate(factors):
        if a is not None:
            x = gather_along_dim(x, dim + i, g.groups[a], Root(int(s), g.groups[a], a).sizes())
    return x.flatten(dim, dim + len(factors) - 1) if len(factors) > 1 else x


def _bind_gathered(g, gathered, out_layout) -> Dict[int, torch.Tensor]:
    """The gathered operands (``(tensor, layout left)``) with their gradients summed over the output's mesh
    dims that they are not sharded over (each rank's rows of the product use the whole of them)."""
    out = {}
    for t, rest in gathered:
        own = set(mesh_dims_of(rest)) if rest is not None else set()
        x = g.bound(t, sorted(set(mesh_dims_of(out_layout)) - own))
        out[id(t)] = g.mark(x, rest) if rest is not None else x
    return out


def _axes(entry) -> tuple:
    """A layout entry's structure: the mesh dim (or ``None``) of each factor, not its local sizes (which
    differ between ranks, so a decision read from them is not the same everywhere)."""
    return tuple(a for _, a in entry)


def _same_rows(g, func, ea, eb, lay) -> None:
    """Operands pairing a dim sharded alike must hold the same rows of it: decided from local sizes, so
    agreed on a region's first call (a rank whose sizes differ refuses, and every rank with it)."""
    g.arm()
    if ea != eb:
        name = func if isinstance(func, str) else op_name(func)
        raise g.refuse(g.error(f"{name} pairing a dim two operands hold different rows of ({ea} and {eb})", lay))


def _summed(g, out: torch.Tensor, axes) -> torch.Tensor:
    """Partial products over this rank's rows of a contracted dim, summed over mesh dims ``axes``."""
    for a in sorted(set(axes)):
        out = reduce_from_parallel_region(out, g.groups[a])
    return out


# ------------------------------------------------------------------ F.linear
def _linear(g, func, args, kwargs):
    a = _bind(args, kwargs, ("input", "weight", "bias"), {"bias": None})
    x, lay = a["input"], g.layout(a["input"])
    if lay is None or x.dim() - 1 in sharded_dims(lay) or g.layout(a["weight"]) is not None:
        raise g.error("F.linear contracting a sharded dim", lay or g.layout(a["weight"]))
    axes = mesh_dims_of(lay)
    w = g.bound(a["weight"], axes)
    b = None if a["bias"] is None else g.bound(a["bias"], axes)
    return g.mark(func(x, w, b), lay[:-1] + (None,))


# ------------------------------------------------------------------ matmul
def _matmul_layout(la, lb, sa, sb):
    if len(sa) < 2 or len(sb) < 2:
        raise LayoutError("a 1-D operand")
    if (la and la[-1]) or (lb and lb[-2]):
        raise LayoutError("it contracts a sharded dim")
    row = la[-2] if la else None
    col = lb[-1] if lb else None
    if row is not None and col is not None:
        raise LayoutError("both operands' sharded rows meet")
    batch = broadcast_layouts([sa[:-2], sb[:-2]], [la[:-2] if la else None, lb[:-2] if lb else None])
    return tuple(batch) + (row, col)


def _matmul(g, func, args, kwargs):
    name = func.__name__
    if name in ("baddbmm", "addmm", "addbmm"):
        inp, a, b = args[0], args[1], args[2]
    else:
        inp, (a, b) = None, args[:2]
    la, lb = g.layout(a), g.layout(b)
    gathered: List[tuple] = []
    if inp is None and a.dim() >= 2 and b.dim() >= 2 and (la or lb):
        ka, kb = la[-1] if la else None, lb[-2] if lb else None
        if ka is not None and kb is not None and _axes(ka) == _axes(kb):  # the same rows: partial products, summed
            _same_rows(g, func, ka, kb, la)
            lay = tuple(broadcast_layouts([a.shape[:-2], b.shape[:-2]], [la[:-2], lb[:-2]])) + (la[-2], lb[-1])
            if mesh_dims_of(lay):
                raise g.error(f"{op_name(func)} contracting a sharded dim of operands sharded along other dims", la)
            return _summed(g, func(a, b), [x for _, x in ka if x is not None])
        row, col = la[-2] if la else None, lb[-1] if lb else None
        meet = row is not None and col is not None and set(mesh_dims_of((row,))) & set(mesh_dims_of((col,)))
        if ka is not None:  # the values held sharded against the scores' whole key dim: gathered
            a, rest = gather_serial(g, a, -1)
            gathered.append((a, rest))
        if kb is not None or meet:  # the values (kb), or the keys paired with sharded queries (meet)
            b, rest = gather_serial(g, b, -2 if kb is not None else -1)
            gathered.append((b, rest))
        if gathered:
            la, lb = _left(g, a, gathered), _left(g, b, gathered)
            args = (a, b) + tuple(args[2:])
    out_layout = _matmul_layout(la, lb, a.shape, b.shape)
    if inp is not None:
        shape = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (a.shape[-2], b.shape[-1])
        out_layout = broadcast_layouts([inp.shape, shape], [g.layout(inp), out_layout])
    axes = mesh_dims_of(out_layout)
    swap = _bind_gathered(g, gathered, out_layout)
    for t in (inp, a, b):
        if isinstance(t, torch.Tensor) and g.layout(t) is None and id(t) not in swap:
            swap[id(t)] = g.bound(t, axes)
    args = tuple(swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in args)
    return g.mark(func(*args, **kwargs), out_layout)


def _left(g, t, gathered):
    """The layout of ``t``: the one left after its gather if it was gathered."""
    for x, rest in gathered:
        if x is t:
            return rest
    return g.layout(t)


# ------------------------------------------------------------------ einsum
def _einsum_gathers(g, specs, out, ops) -> List[Tuple[int, int]]:
    """The ``(operand, dim)`` pairs an einsum gathers whole: a letter sharded in one operand and held whole by
    another sharded operand, or sharded differently in two; an output letter sharded over a mesh dim an
    earlier output letter is sharded over (scores pairing sharded queries and keys); a contracted letter
    sharded over a mesh dim an output letter is sharded over."""
    lays = [g.layout(t) for t in ops]
    entry = {}  # (k, i) -> layout entry, of dims longer than 1
    for k, (spec, t) in enumerate(zip(specs, ops)):
        for i, c in enumerate(spec):
            if int(t.shape[i]) != 1:
                entry[(k, i)] = lays[k][i] if lays[k] is not None else None
    take: set = set()
    for c in set("".join(specs)):
        occ = [(k, i) for k, spec in enumerate(specs) for i, x in enumerate(spec) if x == c and (k, i) in entry]
        sharded = [p for p in occ if entry[p] is not None]
        whole_tagged = any(entry[p] is None and lays[p[0]] is not None for p in occ)
        if sharded and (whole_tagged or len({_axes(entry[p]) for p in sharded}) > 1):
            take.update(sharded)
        elif len({entry[p] for p in sharded}) > 1:  # one structure, other local sizes: decided from them
            _same_rows(g, "torch.einsum", entry[sharded[0]], entry[sharded[1]], lays[sharded[0][0]])

    def axes_of(c):
        return {
            a for p, e in entry.items() if p not in take and e and specs[p[0]][p[1]] == c for _, a in e if a is not None
        }

    seen: set = set()
    for c in out:
        mine = axes_of(c)
        if mine & seen:
            take.update(p for p, e in entry.items() if e and specs[p[0]][p[1]] == c)
        else:
            seen |= mine
    for c in set("".join(specs)) - set(out):
        if axes_of(c) & seen:
            take.update(p for p, e in entry.items() if e and specs[p[0]][p[1]] == c)
    return sorted(take)


def _einsum(g, func, args, kwargs):
    eq = args[0]
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    if "..." in eq or "->" not in eq:
        raise g.error("torch.einsum without an explicit '->' output (or with '...')", first_sharded(g, ops, {})[1])
    ins, out = eq.replace(" ", "").split("->")
    specs = ins.split(",")
    gathered: Dict[int, tuple] = {}  # operand -> (tensor, layout left)
    for k, i in _einsum_gathers(g, specs, out, ops):
        ops[k], rest = gather_serial(g, ops[k], i)
        if rest is not None:
            g.mark(ops[k], rest)
        gathered[k] = (ops[k], rest)
    letters: Dict[str, object] = {}
    owner: Dict[str, Tuple[torch.Tensor, int]] = {}  # a sharded letter -> an operand and dim holding it
    for spec, t in zip(specs, ops):
        lay = g.layout(t)
        for i, c in enumerate(spec):
            e = lay[i] if lay is not None else None
            if e is not None:
                if c in letters and letters[c] not in (None, e):
                    raise g.error("torch.einsum pairing differently sharded dims", lay)
                letters[c] = e
                owner.setdefault(c, (t, i))
            letters.setdefault(c, None)
    done = [set() for _ in ops]  # mesh dims a cut operand's gradient is summed over
    for k, (spec, t) in enumerate(zip(specs, ops)):  # a replicated operand with a sharded dim's full length: cut
        if g.layout(t) is not None or k in gathered:
            continue
        for i, c in enumerate(spec):
            if c in owner and t.shape[i] != 1:
                cut = fit(g, ops[k], i, *owner[c])
                if cut is None:
                    raise g.error(f"torch.einsum: a replicated operand spans sharded dim {c!r}", letters[c])
                ops[k] = cut
                done[k].add(g.root(*owner[c]).axis)
    summed = sorted({a for c, e in letters.items() if e is not None and c not in out for _, a in e if a is not None})
    out_layout = tuple(letters[c] for c in out)
    axes = [a for e in out_layout if e for _, a in e if a is not None]
    if len(axes) != len(set(axes)) or set(axes) & set(summed):
        raise g.error(f"torch.einsum '{eq}' pairs sharded dims it cannot gather", None)
    bound = _bind_gathered(g, list(gathered.values()), out_layout + tuple((((1, a),) for a in summed)))
    swap = [
        bound[id(t)] if id(t) in bound else g.bound(t, sorted(set(axes + summed) - d)) if g.layout(t) is None else t
        for t, d in zip(ops, done)
    ]
    result = func(eq, *swap)
    return g.mark(_summed(g, result, summed), out_layout) if summed else g.mark(result, out_layout)


#: rules that never communicate (a guard settles before the others; see tplayers.region.dispatch)
LOCAL = (_linear,)

TABLE = {
    "linear": _linear,
    "matmul": _matmul,
    "__matmul__": _matmul,
    "mm": _matmul,
    "bmm": _matmul,
    "baddbmm": _matmul,
    "addmm": _matmul,
    "einsum": _einsum,
}
