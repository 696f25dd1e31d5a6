"""Full attention over domain-sharded tokens: :func:`scaled_dot_product_attention` and
:func:`token_positions`.

Each rank holds the queries of its own tokens (pixels, voxels, time steps) and, when the keys
are sharded too, its own keys and values; every other rank's K/V travel to it once (a ring of
blocks, or one all-gather) and are merged with an online softmax, so the result is exactly this
rank's rows of ``torch.nn.functional.scaled_dot_product_attention`` on the gathered tokens,
values and gradients, and no rank ever holds the full score matrix.

Choosing the algorithm (``algorithm="auto"``), measured with ``benchmarks/attention.py`` (a U-Net
mid-block attention on 2 CPU ranks; figures in ``benchmarks/RESULTS.md``): both move the minimum
forward (every other rank's K/V once); the ring's forward+backward was as fast as the all-gather's
or faster, holds one remote block at a time instead of all of them, and its backward returns dK/dV
point to point instead of a reduce-scatter of the full padded K/V size. Rule: ``auto`` = ring.
``"all_gather"`` stays selectable (one collective instead of N - 1 steps may win at N > 2 ranks on
a fast fabric; not measured here).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from tplayers.attention.plan import AttentionPlan, Cols, contiguous_cols, gather_padded, gather_rows, topology
from tplayers.attention.positions import token_positions
from tplayers.attention.ring import AllGatherAttention, LocalAttention, RingAttention
from tplayers.mesh import resolve_mesh
from tplayers.ops.dropout import dropout_slice
from tplayers.sharding import offsets_from_sizes

__all__ = ["scaled_dot_product_attention", "token_positions"]

_ALGORITHMS = ("auto", "ring", "all_gather")


def _sig(shape) -> int:
    """A deterministic integer of a shape (hash of a tuple of ints is not salted per process)."""
    return hash(tuple(int(s) for s in shape))


def _check_positions(name: str, pos, length: int, problems: List[str]) -> Tuple[int, int]:
    if pos is None:
        return 0, -1
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.dim() != 1:
        what = (
            f"{pos.dtype} tensor of shape {tuple(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        )
        problems.append(f"{name} must be a 1-D int64 tensor of the local tokens' global indices, got {what}")
        return 0, -1
    if pos.numel() != length:
        problems.append(f"{name} has {pos.numel()} entries, expected one per local token ({length})")
        return 0, -1
    if pos.numel() == 0:
        return 0, -1
    if torch.unique(pos).numel() != pos.numel():
        problems.append(f"{name} repeats a global index")
    return int(pos.min()), int(pos.max())


def _check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, algorithm) -> None:
    """Checks that do not depend on this rank's data (the same outcome on every rank)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"scaled_dot_product_attention: attn_mask must be a tensor or None, got {type(attn_mask).__name__}"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be a probability in [0, 1], got {dropout_p!r}")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: attn_mask must be None when is_causal=True (as in torch)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scaled_dot_product_attention: scale must be a float or None, got {type(scale).__name__}")
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"scaled_dot_product_attention: algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError(
            "scaled_dot_product_attention: attn_mask.requires_grad is unsupported (the mask is a "
            "constant here); detach it"
        )


def _local_problems(query, key, value, attn_mask, enable_gqa) -> List[str]:
    """Shape checks of this rank's tensors (collected, raised on every rank after the exchange)."""
    problems = []
    if min(query.dim(), key.dim(), value.dim()) < 2:
        problems.append(
            f"query, key and value need at least 2 dims (..., L, E), got shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
        return problems
    if len({query.dtype, key.dtype, value.dtype}) != 1 or not query.is_floating_point():
        problems.append(
            f"query, key and value must share one floating dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if query.size(-1) != key.size(-1):
        problems.append(f"query and key must share the last dim (E), got {query.size(-1)} and {key.size(-1)}")
    if key.size(-2) != value.size(-2):
        problems.append(f"key and value must hold the same tokens, got {key.size(-2)} and {value.size(-2)} rows")
    if enable_gqa and (
        min(query.dim(), key.dim(), value.dim()) < 3
        or key.size(-3) != value.size(-3)
        or query.size(-3) % key.size(-3) != 0
    ):
        problems.append(
            f"enable_gqa needs heads at dim -3 with query heads a multiple of key/value heads, got "
            f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if attn_mask is not None:
        if attn_mask.dim() < 2 or attn_mask.size(-2) not in (1, query.size(-2)):
            problems.append(
                f"attn_mask must be broadcastable to (..., Lq_local={query.size(-2)}, Lk_global), got "
                f"shape {tuple(attn_mask.shape)}"
            )
        elif attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            problems.append(f"attn_mask must be bool or {query.dtype} (the query's dtype), got {attn_mask.dtype}")
    return problems


def _raise_agreed(rows: List[List[int]], mine: List[str], me: int) -> None:
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    if bad:
        detail = "; ".join(mine) if mine else f"rank {bad[0]} rejected its arguments (see that rank's error)"
        raise ValueError(f"scaled_dot_product_attention: invalid arguments on ranks {bad}: {detail}")


def _batch_shape(query, key, value, attn_mask, groups) -> Tuple[int, ...]:
    kb, vb = list(key.shape[:-2]), list(value.shape[:-2])
    if groups > 1:
        kb[-1] *= groups
        vb[-1] *= groups
    shapes = [tuple(query.shape[:-2]), tuple(kb), tuple(vb)]
    if attn_mask is not None:
        shapes.append(tuple(attn_mask.shape[:-2]))
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError as err:
        raise ValueError(
            f"scaled_dot_product_attention: batch dims of query {shapes[0]}, key {shapes[1]}, value "
            f"{shapes[2]}" + (f", attn_mask {shapes[3]}" if len(shapes) > 3 else "") + f" do not broadcast: {err}"
        ) from None


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    mesh: Optional[DeviceMesh] = None,
    kv_sharded: bool = True,
    q_positions: Optional[torch.Tensor] = None,
    kv_positions: Optional[torch.Tensor] = None,
    algorithm: str = "auto",
):
    """``F.scaled_dot_product_attention`` on tokens sharded over ALL ranks of ``mesh``.

    ``mesh``: a 1-D or N-D DeviceMesh (N-D: its ranks in flattened, row-major order), None = the
    default mesh. ``query`` is ``(..., Lq_local, E)``; ``key``/``value`` are ``(..., Lk_local, E)``
    when ``kv_sharded`` (every rank's keys are attended), else ``(..., Lk, E)`` replicated: then no
    K/V moves at all, and the gradients returned for ``key``/``value`` are this rank's partial sums
    (the contributions of its queries; sum them over the ranks, e.g. with
    :func:`tplayers.replicated_to_sharded` on the replicated input). Returns this rank's rows
    ``(..., Lq_local, Ev)``.

    ``q_positions`` / ``kv_positions``: 1-D int64 tensors of the global indices of the local tokens
    in the serial sequence (see :func:`token_positions`); None = contiguous blocks in mesh rank order.
    They matter only for ``is_causal`` (top-left aligned over global positions, as torch's),
    ``attn_mask`` (its columns are the GLOBAL keys in global order; rows are this rank's queries, or
    1) and dropout; attention without them is order-free. ``scale``, ``enable_gqa`` (key/value heads
    repeat-interleaved as torch does, sent unrepeated) as in torch. The first collective is a small
    agreement of every rank's shapes, so a bad argument on any rank raises ``ValueError`` on all.

    ``dropout_p > 0``: exactly this rank's rows of the mask torch's math path draws for the serial
    call (same seed on every rank): every rank draws the full ``(..., Lq, Lk)`` mask, as the serial
    call does, and keeps its rows (bool) for the backward. That temporary is the only O(Lq x Lk)
    memory and only with dropout; the generator advances as the serial call's does.

    ``algorithm``: ``"ring"``, ``"all_gather"`` or ``"auto"`` (see the module docstring).

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as torch's, on
            this rank's tokens (above).
        mesh: the mesh the tokens are sharded over (``None``: :func:`tplayers.default_mesh`).
        kv_sharded: whether ``key`` / ``value`` are sharded (else replicated).
        q_positions, kv_positions: global token indices (above).
        algorithm: ``"auto"`` (= ``"ring"``), ``"ring"`` or ``"all_gather"``.

    Returns:
        This rank's rows of the serial result, ``(..., Lq_local, Ev)``.

    Raises:
        ValueError: on every rank (after the shape agreement), arguments that are invalid on any
            rank; a bad ``dropout_p`` / ``algorithm``, ``attn_mask`` with ``is_causal``.
        TypeError: non-tensor inputs or mask, a non-float ``scale``.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``; each rank holds rows of an 8x8 image)::

        import torch, torch.nn.functional as F, tplayers
        from tplayers.functional import scaled_dot_product_attention
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        x = torch.randn(1, 4, 8, 8, 16)                    # (N, heads, H, W, head_dim), the same everywhere
        q = k = v = tplayers.shard(x, 2, mesh).flatten(2, 3)   # (N, heads, H_local*W, head_dim)
        out = scaled_dot_product_attention(q, k, v, mesh=mesh)   # this rank's rows
        full = x.flatten(2, 3)
        torch.testing.assert_close(tplayers.gather(out, 2, mesh), F.scaled_dot_product_attention(full, full, full))
    """
    _check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, algorithm)
    mesh = resolve_mesh(mesh, tuple(range(1, 9)))
    problems = _local_problems(query, key, value, attn_mask, enable_gqa)
    need_order = bool(is_causal or attn_mask is not None or dropout_p > 0)
    lq = query.size(-2) if query.dim() >= 2 else 0
    lk = key.size(-2) if key.dim() >= 2 else 0
    qmin, qmax = _check_positions("q_positions", q_positions, lq, problems)
    kmin, kmax = _check_positions("kv_positions", kv_positions, lk, problems)
    if not kv_sharded and kv_positions is not None:
        problems.append("kv_positions is for sharded keys; replicated keys (kv_sharded=False) are in global order")
    topo = topology(mesh)
    # replicated keys move nothing; the query lengths are exchanged only when the serial query order
    # is needed and not given (causal without q_positions) or the global query count is (dropout)
    local_only = (not kv_sharded) and not (is_causal and q_positions is None) and dropout_p == 0
    if topo.size == 1 or local_only:
        if problems:
            raise ValueError("scaled_dot_product_attention: " + "; ".join(problems))
        q_sizes, k_sizes = None, [lk]
    else:
        mask_cols = -1 if attn_mask is None or attn_mask.dim() < 1 else attn_mask.size(-1)
        row = [
            0 if problems else 1,
            lq,
            lk,
            _sig(query.shape[:-2] + query.shape[-1:]) if not problems else 0,
            _sig(key.shape[:-2] + key.shape[-1:]) if not problems else 0,
            _sig(value.shape[:-2] + value.shape[-1:]) if not problems else 0,
            mask_cols,
            q_positions is not None,
            kv_positions is not None,
            qmin,
            qmax,
            kmin,
            kmax,
        ]
        rows = gather_rows(row, topo, "attention.meta")
        _raise_agreed(rows, problems, topo.index)
        for field, what in (
            (3, "query (batch dims and E)"),
            (4, "key (batch dims and E)"),
            (5, "value (batch dims and Ev)"),
            (7, "q_positions given or not"),
            (8, "kv_positions given or not"),
        ):
            if len({r[field] for r in rows}) != 1:
                raise ValueError(
                    f"scaled_dot_product_attention: ranks disagree on {what}; every rank must hold "
                    f"the same batch/channel shape and pass the same options"
                )
        q_sizes = [r[1] for r in rows]
        k_sizes = [r[2] for r in rows] if kv_sharded else [lk]
        lk_global = sum(k_sizes)
        if attn_mask is not None and any(r[6] not in (1, lk_global) for r in rows):
            raise ValueError(
                f"scaled_dot_product_attention: attn_mask's last dim must span the global keys "
                f"({lk_global}) or be 1, got {[r[6] for r in rows]} on the ranks"
            )
        if q_positions is not None and any(r[1] and (r[9] < 0 or r[10] >= sum(q_sizes)) for r in rows):
            raise ValueError(
                f"scaled_dot_product_attention: q_positions must lie in [0, {sum(q_sizes)}), got "
                f"ranges {[(r[9], r[10]) for r in rows if r[1]]}"
            )
        if kv_positions is not None and any(r[2] and (r[11] < 0 or r[12] >= lk_global) for r in rows):
            raise ValueError(
                f"scaled_dot_product_attention: kv_positions must lie in [0, {lk_global}), got "
                f"ranges {[(r[11], r[12]) for r in rows if r[2]]}"
            )
    groups = query.size(-3) // key.size(-3) if enable_gqa else 1
    batch = _batch_shape(query, key, value, attn_mask, groups)
    lk_global = sum(k_sizes)
    if attn_mask is not None and attn_mask.size(-1) not in (1, lk_global):
        raise ValueError(
            f"scaled_dot_product_attention: attn_mask's last dim must be the global key count "
            f"{lk_global} or 1, got shape {tuple(attn_mask.shape)}"
        )
    cols = _key_cols(k_sizes, kv_positions if need_order else None, topo, kv_sharded)
    q_pos = None
    if is_causal or dropout_p > 0:
        q_pos = (
            q_positions if q_positions is not None else _default_positions(q_sizes, topo.index if q_sizes else 0, lq)
        )
    bias_mask = None
    if attn_mask is not None:
        bias_mask = (
            attn_mask
            if attn_mask.dtype != torch.bool
            else torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attn_mask, float("-inf")
            )
        )
    keep, drop_scale = None, 1.0
    if dropout_p > 0:
        keep, drop_scale = _dropout_rows(query, batch, q_pos, sum(q_sizes) if q_sizes else lq, lk_global, dropout_p)
    plan = AttentionPlan(
        topo=topo,
        k_sizes=k_sizes,
        cols=cols,
        batch=batch,
        scale=float(scale) if scale is not None else query.size(-1) ** -0.5,
        groups=groups,
        bias_mask=bias_mask,
        q_pos=q_pos if is_causal else None,
        keep=keep,
        drop_scale=drop_scale,
        k_shape_of=lambda b: key.shape[:-2] + (k_sizes[b], key.size(-1)),
        v_shape_of=lambda b: value.shape[:-2] + (k_sizes[b], value.size(-1)),
    )
    if not kv_sharded or topo.size == 1:
        return LocalAttention.apply(query, key, value, plan)
    if algorithm == "all_gather":
        return AllGatherAttention.apply(query, key, value, plan)
    return RingAttention.apply(query, key, value, plan)


def _default_positions(q_sizes, index: int, lq: int) -> torch.Tensor:
    start = offsets_from_sizes(q_sizes)[index] if q_sizes else 0
    return torch.arange(start, start + lq)


def _key_cols(k_sizes, kv_positions, topo, kv_sharded) -> List[Cols]:
    """Every rank's key block as global columns (one all-gather of positions when they are given)."""
    if not kv_sharded:
        return [Cols(0, k_sizes[0])]
    if kv_positions is None:
        return contiguous_cols(k_sizes)
    table = gather_padded(kv_positions.reshape(1, -1, 1), k_sizes, topo, "attention.positions")
    per_rank = [table[b, 0, : k_sizes[b], 0] for b in range(topo.size)]
    flat = torch.cat(per_rank)
    if not torch.equal(torch.sort(flat).values, torch.arange(flat.numel())):
        raise ValueError(
            f"scaled_dot_product_attention: kv_positions over all ranks must be a permutation of "
            f"0..{flat.numel() - 1} (each global key exactly once)"
        )
    return [Cols(0, k_sizes[b], per_rank[b]) for b in range(topo.size)]


def _dropout_rows(query, batch, q_pos, lq_global: int, lk_global: int, p: float):
    """This rank's rows of the serial call's dropout mask (bool) and its scale 1 / (1 - p)."""
    if p >= 1.0:
        keep = torch.zeros(batch + (query.size(-2), lk_global), dtype=torch.bool, device=query.device)
        return keep, 0.0
    full = dropout_slice(
        torch.ones((), dtype=query.dtype, device=query.device).expand(batch + (lq_global, lk_global)),
        p,
        True,
        batch + (lq_global, lk_global),
        -1,
        0,
    )
    keep = full.index_select(-2, q_pos.to(query.device)) != 0
    return keep, 1.0 / (1.0 - p)
