"""Region-guard rules for per-pixel ops on flattened pixels with replicated operands (issue 31).

A vector quantizer (diffusers' ``VectorQuantizer`` in ``VQModel``, VQ-GAN, VQ-VAE) flattens the
pixels, ``z.permute(0, 2, 3, 1).reshape(-1, C)``, so the row dim holds the sharded dim merged with
the batch and the other spatial dims (the guard follows that, :mod:`tplayers.domain.layout`); then:

* ``torch.cdist(x1, x2)`` of sharded rows of ``x1`` against a replicated ``x2`` (the codebook) is one
  row of distances per pixel: each rank's rows are the serial result's rows, sharded like ``x1``'s
  rows (and symmetrically a replicated ``x1`` against sharded rows of ``x2`` shards the last dim).
  The vectors' dim must be whole; both operands' rows sharded (distances between pixels) is refused.
  torch picks its matrix-product path from the row counts (more than 25 rows on either side), so
  the route passes the ``compute_mode`` that the serial call takes, from the global row count (one
  small all-reduce when the codebook has 25 rows or fewer, the only case where it decides);
* ``F.embedding(indices, weight)`` (``nn.Embedding``) with sharded indices (the ``argmin`` over the
  codebook, a whole dim, is local) looks one replicated row up per pixel: the result is sharded
  like the indices, with a trailing whole dim, and the table's gradient is summed over the mesh dims
  (every rank's pixels add theirs, as the serial backward does). ``max_norm`` (renorms the rows the
  local indices touch, in place), ``scale_grad_by_freq`` (counts over the global batch) and
  ``sparse`` gradients are refused on every rank (decided from the arguments alone).

The commitment loss (``torch.mean((z_q.detach() - z) ** 2)``) is a reduction over the sharded rows,
routed to the global mean (:mod:`tplayers.region.rules_ops`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tplayers.domain.layout import broadcast_layouts, mesh_dims_of
from tplayers.region.rules import op_name
from tplayers.region.rules_ops import _bind

__all__ = ["TABLE", "LOCAL"]

_MM_ROWS = 25  # torch.cdist's default mode takes its matrix-product path above this many rows


def _global_rows(g, rows: int, axes) -> int:
    t = torch.tensor([rows], dtype=torch.int64)
    for a in axes:
        if g.groups[a].size() > 1:
            dist.all_reduce(t, group=g.groups[a])
    return int(t.item())


def _cdist(g, func, args, kwargs):
    a = _bind(args, kwargs, ("x1", "x2", "p", "compute_mode"), {"p": 2.0, "compute_mode": None})
    x1, x2 = a["x1"], a["x2"]
    l1, l2 = g.layout(x1), g.layout(x2)
    lay = l1 or l2
    if x1.dim() < 2 or x2.dim() < 2:
        raise g.error(f"{op_name(func)} of a tensor with fewer than 2 dims", lay)
    if (l1 and l1[-1]) or (l2 and l2[-1]):
        raise g.error(f"{op_name(func)} contracting a sharded dim (the vectors' dim)", lay)
    rows1, rows2 = (l1[-2] if l1 else None), (l2[-2] if l2 else None)
    if rows1 is not None and rows2 is not None:
        raise g.error(
            f"{op_name(func)} between two sharded sets of rows (distances between pixels of different ranks)",
            lay,
            "Keep one operand replicated (a codebook).",
        )
    batch = broadcast_layouts([x1.shape[:-2], x2.shape[:-2]], [l1[:-2] if l1 else None, l2[:-2] if l2 else None])
    out_layout = tuple(batch) + (rows1, rows2)
    axes = mesh_dims_of(out_layout)
    mode = a["compute_mode"]
    if float(a["p"]) == 2.0 and mode in (None, "use_mm_for_euclid_dist_if_necessary"):
        # the serial call takes the matrix-product path when either side has more than 25 rows
        other = x2.shape[-2] if rows1 is not None else x1.shape[-2]
        if other > _MM_ROWS:
            big = True
        else:
            sharded = x1 if rows1 is not None else x2
            big = _global_rows(g, int(sharded.shape[-2]), mesh_dims_of((rows1 or rows2,))) > _MM_ROWS
        mode = "use_mm_for_euclid_dist" if big else "donot_use_mm_for_euclid_dist"
    g.acted = True  # the compute mode is chosen from the global row count, not the local call's
    x1 = g.bound(x1, axes) if l1 is None else x1
    x2 = g.bound(x2, axes) if l2 is None else x2
    return g.mark(func(x1, x2, a["p"], mode), out_layout)


def _embedding(g, func, args, kwargs):
    if func is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    else:  # torch.embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
        names = ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse")
    a = _bind(
        args,
        kwargs,
        names,
        {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False},
    )
    if a["padding_idx"] is not None and a["padding_idx"] < 0 and func is not F.embedding:
        a["padding_idx"] = None  # torch.embedding's -1 means none
    idx, w = a["input"], a["weight"]
    lay = g.layout(idx)
    if lay is None or g.layout(w) is not None:
        raise g.error(f"{op_name(func)} of a sharded table", g.layout(w))
    for key, what in (
        ("max_norm", "renorms the rows this rank's indices touch, in place"),
        ("scale_grad_by_freq", "scales gradients by index counts over the whole batch"),
        ("sparse", "makes a sparse gradient"),
    ):
        if a[key]:
            raise g.error(
                f"{op_name(func)} with {key}={a[key]!r} on sharded indices (it {what})",
                lay,
                f"Drop {key} inside the domain region.",
            )
    out = F.embedding(idx, g.bound(w, mesh_dims_of(lay)), a["padding_idx"], None, a["norm_type"], False, False)
    return g.mark(out, tuple(lay) + (None,))


TABLE = {"cdist": _cdist, "embedding": _embedding}

#: rules that never communicate (``cdist`` may: one small all-reduce of a row count)
LOCAL = (_embedding,)
