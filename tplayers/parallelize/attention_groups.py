"""Separate q / k / v / o projections of one attention, planned together
(docs/design.md (tensor-parallel linears)).

A fused projection (``ColumnParallel(sections=..., head_dim=...)``) checks in its own layout
that every rank's query heads use only key/value heads it holds. Separate ``q_proj`` /
``k_proj`` / ``v_proj`` (and the ``o_proj`` that reads the attention output) are separate
plan entries, each sharded on its own, so nothing tied their layouts together: with 4 query and
2 key/value heads at tp 3 each was split "correctly" and the model was silently wrong. Here the
plan groups them before anything is built:

- **who**: siblings under one parent module, by role. A role is given by the style
  (``ColumnParallel(head_role="q" | "k" | "v")``, ``RowParallel(head_role="o")``) or read from
  the module's name (``q_proj``, ``q``, ``query``, ``wq``, ``q_lin``, ``to_q``; ``k_...``, ``v_...``;
  ``o_proj``, ``o``, ``out_proj``, ``wo``, ``out_lin``);
- **head size**: a member style's ``head_dim``, else the parent's integer ``head_dim``
  attribute (Hugging Face attention modules have one);
- **checks** (``ValueError`` naming the module, the rank and the heads, on every rank before
  any collective): each member's local features are whole heads; each rank's query heads use
  only the key/value heads that rank holds (query head ``i`` of ``H`` uses kv head
  ``i * K // H``); the output projection's local input is exactly the local query heads.

Example (``torchrun --nproc-per-node 2``; at 3 ranks it raises, naming rank 1's heads)::

    import tplayers
    from torch import nn
    mesh = tplayers.init_mesh()
    attn = nn.Module()  # 4 query heads and 2 key/value heads of 8 features, names no rule reads
    attn.wq_, attn.wk_, attn.wv_ = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
    attn.wo_ = nn.Linear(32, 32)
    plan = {"wq_": tplayers.ColumnParallel(head_dim=8, head_role="q"),
            "wk_": tplayers.ColumnParallel(head_dim=8, head_role="k"),
            "wv_": tplayers.ColumnParallel(head_dim=8, head_role="v"),
            "wo_": tplayers.RowParallel(head_dim=8, head_role="o")}
    attn = tplayers.parallelize_module(attn, plan, mesh=mesh)
    assert attn.wq_.weight_ranges[0][1] - attn.wq_.weight_ranges[0][0] == 32 // mesh.size()
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.layers._sections import row_head_ranges
from tplayers.parallelize.styles import ColumnParallel, RowParallel
from tplayers.sharding import section_layout, shard_range

__all__ = ["check_attention_groups", "ROLE_NAMES"]

#: module names read as a projection's role when its style names none
ROLE_NAMES: Dict[str, Tuple[str, ...]] = {
    "q": ("q_proj", "q", "query", "wq", "q_lin", "to_q"),
    "k": ("k_proj", "k", "key", "wk", "k_lin", "to_k"),
    "v": ("v_proj", "v", "value", "wv", "v_lin", "to_v"),
    "o": ("o_proj", "o", "out_proj", "wo", "out_lin"),
}


def _role(match) -> Optional[str]:
    style = match.value
    if not isinstance(style, (ColumnParallel, RowParallel)) or not isinstance(match.module, nn.Linear):
        return None
    if (
        isinstance(style, ColumnParallel)
        and style.gather_output
        or isinstance(style, RowParallel)
        and not style.input_is_parallel
    ):
        return None  # full features on every rank (Phi3's gathered qkv_proj, its split-input o_proj): no heads split
    if style.head_role is not None:
        return style.head_role
    if isinstance(style, ColumnParallel) and style.sections is not None:
        return None  # a fused layout checks its own groups
    want = ("q", "k", "v") if isinstance(style, ColumnParallel) else ("o",)
    for alias in match.aliases or (match.name,):
        last = alias.rpartition(".")[2]
        for role in want:
            if last in ROLE_NAMES[role]:
                return role
    return None


def _ranges(match, parts: int) -> List[Tuple[int, int]]:
    """Per rank, the (start, stop) of the features this member's twin holds: outputs of a
    column member, inputs of the row (output) projection."""
    style, module = match.value, match.module
    if isinstance(style, RowParallel):
        return [row_head_ranges(module.in_features, parts, r, style.head_dim) for r in range(parts)]
    if style.head_dim is not None:
        return [row[0] for row in section_layout((module.out_features,), parts, style.head_dim)]
    return [shard_range(module.out_features, parts, r) for r in range(parts)]


def check_attention_groups(model: nn.Module, matches, mesh: DeviceMesh) -> None:
    """Raise ``ValueError`` where separate attention projections would not hold whole heads, or a
    rank's query heads would not sit with their key/value heads (see the module docstring)."""
    if mesh.ndim != 1:
        return  # tensor-parallel styles shard over a 1-D mesh; the layers say so themselves
    parts = mesh.size(0)
    groups: Dict[str, Dict[str, object]] = {}
    for m in matches:
        role = _role(m)
        if role is not None:
            groups.setdefault(m.name.rpartition(".")[0], {})[role] = m
    for parent, members in groups.items():
        _check_group(model, parent, members, parts)


def _check_group(model: nn.Module, parent: str, members: Dict[str, object], parts: int) -> None:
    where = parent or "<root>"
    hd, told = None, ""
    for role in ("q", "k", "v", "o"):
        m = members.get(role)
        if m is not None and m.value.head_dim is not None:
            hd, told = m.value.head_dim, f"head_dim={m.value.head_dim} of {m.name!r}'s style"
            break
    if hd is None:
        attr = getattr(model.get_submodule(parent), "head_dim", None)
        if isinstance(attr, int) and not isinstance(attr, bool) and attr > 0:
            hd, told = attr, f"{where}.head_dim={attr}"
    if hd is None:
        return  # nothing says how wide a head is: the layers cannot be checked for whole heads
    ranges = {role: _ranges(m, parts) for role, m in members.items()}
    for role, m in members.items():
        for r, (a, b) in enumerate(ranges[role]):
            if a % hd or b % hd:
                side = "input" if role == "o" else "output"
                raise ValueError(
                    f"{m.name}: on {parts} ranks, rank {r} would hold {side} features [{a}, {b}), not whole "
                    f"heads of {hd} ({told}), so the attention's view into heads fails or mixes heads; give "
                    f"its style head_dim={hd}"
                )
    q = members.get("q")
    if q is None:
        return
    heads = q.module.out_features // hd
    for role in ("k", "v"):
        kv = members.get(role)
        if kv is None:
            continue
        kv_heads = kv.module.out_features // hd
        if kv_heads < 1 or heads % kv_heads:
            continue  # not a grouped-query pair (e.g. cross-attention widths): nothing to align
        for r in range(parts):
            qa, qb = (x // hd for x in ranges["q"][r])
            ka, kb = (x // hd for x in ranges[role][r])
            need = sorted({i * kv_heads // heads for i in range(qa, qb)})
            if not set(need) <= set(range(ka, kb)):
                raise ValueError(
                    f"{where}: on {parts} ranks, rank {r} holds query heads [{qa}, {qb}) of {q.name} ({heads} "
                    f"heads), which use key/value heads {need} of {kv.name} ({kv_heads} heads), but it holds "
                    f"[{ka}, {kb}); query heads must sit with their key/value group on every rank: use a rank "
                    f"count that divides {heads} and divides or is a multiple of {kv_heads}, or keep this "
                    "attention out of the plan (replicated)"
                )
    o = members.get("o")
    if o is not None:
        for r in range(parts):
            if ranges["o"][r] != ranges["q"][r]:
                (qa, qb), (oa, ob) = ranges["q"][r], ranges["o"][r]
                raise ValueError(
                    f"{where}: on {parts} ranks, rank {r}'s {q.name} outputs query features [{qa}, {qb}) "
                    f"(heads [{qa // hd}, {qb // hd})), but {o.name} takes input features [{oa}, {ob}) there; "
                    f"the output projection must read exactly this rank's query heads (RowParallel(head_dim="
                    f"{hd}) with a rank count that does not exceed {heads}, or keep the attention replicated)"
                )
