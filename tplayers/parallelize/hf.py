"""A tplayers plan from a Hugging Face transformers model's own tensor-parallel plan.

transformers models carry their plan as strings: ``config.base_model_tp_plan`` for the base
model (``{"layers.*.self_attn.q_proj": "colwise", ...}``), the head class's ``_tp_plan``
(``{"lm_head": "colwise_gather_output"}``), joined under ``base_model_prefix`` into the
instance's ``model.tp_plan``. :func:`plan_from_transformers` turns that into a tplayers plan
(regex keys, style values) for :func:`~tplayers.parallelize_module` and
:func:`~tplayers.explain`, adding what the strings leave out: whole heads and grouped-query
replication from the config (so it runs where the kv heads are fewer than the ranks), fused
``[q|k|v]`` sections, sequence parallelism and a vocab-parallel head on request. Nothing here
imports transformers: the model and its config are read as plain objects.

Named ``plan_from_transformers`` (not ``parallelize_transformers``): it returns the plan as
data, to read, edit and pass to ``explain`` before anything changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from torch import nn

from tplayers.layers._linear_base import linear_dims
from tplayers.layers._sections import SectionLayout
from tplayers.mesh import resolve_mesh
from tplayers.parallelize.expert_styles import ExpertParallel
from tplayers.parallelize.heads import FUSED as _FUSED
from tplayers.parallelize.heads import KV as _KV
from tplayers.parallelize.heads import Q as _Q
from tplayers.parallelize.heads import localize_heads
from tplayers.parallelize.hf_generate import VocabParallelHead
from tplayers.parallelize.hf_local import EXPERTS_HINT, cover_local_parameters, experts_module_key, is_experts_entry
from tplayers.parallelize.hf_loss import causal_lm_loss
from tplayers.parallelize.hf_sequence import (
    SequenceGatheredAttention,
    add_sequence_parallel_modules,
    check_sequence_parallel_model,
    check_sequence_parallel_style,
)
from tplayers.parallelize.styles import ColumnParallel, ParallelStyle, ReplicatedGradSum, RowParallel

__all__ = ["plan_from_transformers", "ReplicatedGradSum", "causal_lm_loss", "TRANSFORMERS_STYLES"]

#: transformers 5.23's styles (``ALL_PARALLEL_STYLES``) that have a tplayers equivalent here
TRANSFORMERS_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "packed_colwise",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "replicate",
)
#: transformers 5.23's styles with no tplayers equivalent (expert parallelism, MLA, packed input dims)
_UNSUPPORTED = {
    "packed_rowwise": "a linear whose input features are packed blocks",
    "mla_kv_a_proj": "multi-head latent attention's kv_a projection",
    "all_reduce": "an all-reduce of a module's partial output (mixture-of-experts)",
    "moe_tp_experts": "mixture-of-experts tensor parallelism",
    "moe_identity_expert": "mixture-of-experts",
    "local_params": "bare parameters sharded by their own plan entry",
    "grouped_gemm": "expert parallelism",
    "ep_dispatch_experts": "expert parallelism",
}
# Models whose transformers classes carry no tensor-parallel plan (in base-model names).
_BUILTIN = {
    "gpt2": {
        "wte": "embedding_rowwise",
        "h.*.attn.c_attn": "colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    }
}
_BUILTIN_HEAD = {"lm_head": "colwise_gather_output"}


@dataclass(frozen=True)
class _AttentionColumnParallel(ColumnParallel):
    """ColumnParallel on an attention input projection; after the swap, the attention module's
    head counts (``num_key_value_groups``, GPT-2's ``split_size``, ``num_heads``) are set to
    this rank's (transformers reads them in ``forward``)."""

    def finalize(self, model, mesh):
        for attn in model.modules():
            localize_heads(attn)
        return model


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"plan_from_transformers: model ({type(model).__name__}) has no .config; "
            "expected a transformers PreTrainedModel"
        )
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _heads(config):
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or (hidden // heads if isinstance(hidden, int) else None)
    return (heads, kv, hd) if hd else None


def _string_plan(model: nn.Module, config) -> Dict[str, str]:
    """The model's own plan as transformers joins it, or the built-in one for models without."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if plan:
        return plan
    prefix = getattr(model, "base_model_prefix", "")
    base_is_child = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    base = dict(getattr(config, "base_model_tp_plan", None) or _BUILTIN.get(getattr(config, "model_type", ""), {}))
    plan = {(f"{prefix}.{k}" if base_is_child else k): v for k, v in base.items()}
    if base and base_is_child:
        plan.update(
            dict(getattr(type(model), "_tp_plan", None) or {})
            or {k: v for k, v in _BUILTIN_HEAD.items() if isinstance(getattr(model, k, None), nn.Module)}
        )
    return plan


def _to_regex(key: str) -> str:
    return re.escape(key).replace(r"\*", r"\d+")  # transformers' "layers.*" is any layer number


def plan_from_transformers(
    model: nn.Module,
    *,
    mesh=None,
    tp_plan: Optional[Mapping[str, str]] = None,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
    replicate_experts: bool = False,
    expert_parallel: bool = False,
) -> Dict[str, ParallelStyle]:
    """A tplayers plan for a transformers model, from the model's own tensor-parallel plan.

    ``tp_plan`` (transformers' string plan, ``{"model.layers.*.mlp.up_proj": "colwise", ...}``)
    defaults to ``model.tp_plan`` (the config's ``base_model_tp_plan`` under the base model
    prefix, with the head class's ``_tp_plan``); GPT-2, whose classes carry none, gets a
    built-in one. Every style transformers defines is mapped (:data:`TRANSFORMERS_STYLES`):

    - ``colwise`` -> ``ColumnParallel``; on attention projections with whole heads
      (``head_dim`` from the config) and grouped-query key/value heads replicated in groups
      when fewer than the ranks; a fused ``c_attn``/``qkv_proj`` gets ``sections=(q, kv, kv)``.
      After the swap each attention's head counts are set to this rank's.
    - ``rowwise`` -> ``RowParallel`` (whole heads on an attention output projection);
      ``rowwise_rep``/``rowwise_split_input`` -> ``RowParallel(input_is_parallel=False)``.
    - ``colwise_gather_output``/``colwise_rep`` -> ``ColumnParallel(gather_output=True)``;
      with ``vocab_parallel=True`` the ``lm_head`` keeps its local logits (use
      :func:`causal_lm_loss` or :func:`~tplayers.vocab_parallel_cross_entropy`).
    - ``embedding_rowwise`` -> vocab-parallel embedding, ``embedding_colwise`` ->
      ``ColumnParallel(gather_output=True)``; ``packed_colwise`` -> two equal ``sections``.
    - ``sequence_parallel``/``replicated_with_grad_allreduce`` -> :class:`ReplicatedGradSum`;
      ``replicate`` -> left as it is (every rank keeps the whole module).

    ``sequence_parallel=True`` makes the linears and the embedding sequence-parallel and wraps
    every other module with parameters of the decoder's residual stream (the norms) in
    :class:`ReplicatedGradSum`; pass ``position_ids`` for the full sequence to the model (it
    sees only this rank's tokens). A style that is unknown or has no tplayers equivalent, a
    plan key naming a parameter, or heads that cannot be split on this mesh (grouped-query
    attention at a rank count that splits a group) raise ``ValueError`` naming them, on every
    rank, before anything changes.

    Args:
        model: a transformers ``PreTrainedModel`` (or any module, with ``tp_plan``).
        mesh: a 1-D mesh (``None``: :func:`tplayers.default_mesh`).
        tp_plan: transformers' string plan; default: the model's own.
        vocab_parallel, sequence_parallel: keep the logits vocabulary-sharded; sequence parallelism.
        replicate_experts: leave a mixture of experts' ``experts`` out of the plan (every rank holds
            and runs all of them; the router is replicated too): exact, no expert memory saved.
        expert_parallel: expert parallelism over the mesh: every ``experts`` module the plan names
            (transformers' ``moe_tp_experts`` entry and its ``packed_colwise`` / ``rowwise``
            parameter entries) gets :class:`~tplayers.ExpertParallel`: each rank holds whole experts
            and the tokens travel to them by all-to-all; the router stays replicated. Exact.
            Without either option the experts' entries are refused (no in-expert tensor parallelism).

    Returns:
        ``{regex: style}``, a plan for :func:`~tplayers.parallelize_module` and :func:`~tplayers.explain`.

    Raises:
        ValueError: as above (no plan, an unknown style, heads this mesh cannot split).
        TypeError: a non-bool ``vocab_parallel`` / ``sequence_parallel``.

    Example (``torchrun --nproc-per-node 2`` or 4; 4 query and 2 kv heads: kv heads replicated at 4)::

        import copy, torch, tplayers, transformers
        torch.manual_seed(0)                                     # the same model and ids on every rank
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(config)
        serial = copy.deepcopy(model)
        plan = tplayers.plan_from_transformers(model, vocab_parallel=True)
        tplayers.explain(model, plan)                            # prints the table
        model = tplayers.parallelize_module(model, plan)
        ids = torch.randint(0, 64, (2, 9))
        loss = tplayers.causal_lm_loss(model(ids).logits, ids)   # vocab-parallel, never gathered
        torch.testing.assert_close(loss, serial(ids, labels=ids).loss)
    """
    for arg, value in (
        ("vocab_parallel", vocab_parallel),
        ("sequence_parallel", sequence_parallel),
        ("replicate_experts", replicate_experts),
        ("expert_parallel", expert_parallel),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"plan_from_transformers: {arg} must be a bool, got {type(value).__name__}")
    if expert_parallel and (replicate_experts or sequence_parallel):
        other = "replicate_experts=True" if replicate_experts else "sequence_parallel=True"
        raise ValueError(
            f"plan_from_transformers: expert_parallel=True cannot be combined with {other} (the experts are "
            "either split or replicated; expert parallelism takes replicated tokens, not sequence shards)"
        )
    mesh = resolve_mesh(mesh, 1)
    config = _text_config(model)
    strings = dict(tp_plan) if tp_plan is not None else _string_plan(model, config)
    if not strings:
        raise ValueError(
            f"plan_from_transformers: {type(model).__name__} has no tensor-parallel plan "
            "(config.base_model_tp_plan and _tp_plan are empty); pass tp_plan={...}"
        )
    if sequence_parallel:
        check_sequence_parallel_model(model, config)
    heads = _heads(config)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    head_name = _output_embedding_name(model)
    plan: Dict[str, ParallelStyle] = {}
    attention: Dict[str, Dict[str, ParallelStyle]] = {}  # under sequence parallelism: parent key -> children
    for key, style in strings.items():
        if not isinstance(style, str):
            raise TypeError(
                f"plan_from_transformers: tp_plan[{key!r}] must be a style name, got {type(style).__name__}"
            )
        regex = _to_regex(key)
        names = [n for n in modules if re.fullmatch(regex, n)]
        if replicate_experts and is_experts_entry(key):
            continue  # every rank keeps the whole experts module
        if expert_parallel and is_experts_entry(key):  # the experts module, whichever entry names it
            experts = _to_regex(experts_module_key(key))
            if any(re.fullmatch(experts, n) for n in modules):
                plan[experts] = ExpertParallel()
            continue
        hint = EXPERTS_HINT if is_experts_entry(key) else ""
        if style not in TRANSFORMERS_STYLES:
            what = _UNSUPPORTED.get(style)
            reason = f"has no tplayers equivalent ({what})" if what else "is unknown"
            raise ValueError(
                f"plan_from_transformers: style {style!r} of tp_plan key {key!r} {reason}; "
                f"supported: {', '.join(TRANSFORMERS_STYLES)}{hint}"
            )
        if not names and any(re.fullmatch(regex, p) for p in params):
            raise ValueError(
                f"plan_from_transformers: tp_plan key {key!r} ({style!r}) names a parameter; "
                f"only module entries are supported{hint}"
            )
        if not names or style == "replicate":
            continue  # a plan entry for modules this model does not have (transformers skips those too)
        lm_head = head_name is not None and names == [head_name]
        if sequence_parallel and not lm_head:
            check_sequence_parallel_style(key, style)
        role = _attention_role(style, names, modules, heads)
        sp = sequence_parallel and role != "in"  # the attention's input is gathered once, see hf_sequence
        value = _map_style(style, key, names, modules, heads, mesh, sp, vocab_parallel and lm_head)
        if sequence_parallel and role is not None:
            attention.setdefault(_to_regex(key.rpartition(".")[0]), {})[key.rpartition(".")[2]] = value
        else:
            plan[regex] = value
    if expert_parallel and not any(is_experts_entry(k) for k in strings):
        raise ValueError(
            f"plan_from_transformers: expert_parallel=True, but the plan of {type(model).__name__} names no "
            "experts module (no mixture of experts to split)"
        )
    for parent, children in attention.items():
        plan[parent] = SequenceGatheredAttention(children=children)
    if vocab_parallel and head_name is not None and not any(re.fullmatch(k, head_name) for k in plan):
        plan[re.escape(head_name)] = VocabParallelHead(sequence_parallel=sequence_parallel)
    if sequence_parallel:
        add_sequence_parallel_modules(model, plan, ReplicatedGradSum)
    cover_local_parameters(model, plan, ReplicatedGradSum)  # e.g. Apertus' xIELU scalars in the MLP
    return plan


def _output_embedding_name(model: nn.Module) -> Optional[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    for name, module in model.named_modules():
        if head is not None and module is head:
            return name
    return None


def _attention_role(style, names, modules, heads) -> Optional[str]:
    """ "in" for an attention's q/k/v (or fused) projection, "out" for its output projection."""
    if heads is None:
        return None
    leaves = {n.rpartition(".")[2] for n in names}
    if style == "colwise" and leaves <= set(_Q + _KV + _FUSED):
        return "in"
    parents = {n.rpartition(".")[0] for n in names}
    if style == "rowwise" and all(any(f"{p}.{q}" in modules for q in _Q + _FUSED) for p in parents):
        return "out"
    return None


def _map_style(style, key, names, modules, heads, mesh, sp, local_logits) -> ParallelStyle:
    leaves = {n.rpartition(".")[2] for n in names}
    leaf = leaves.pop() if len(leaves) == 1 else None
    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        gather = style != "colwise" and not local_logits
        if local_logits:  # a vocab-parallel lm_head: decoding with local logits is refused
            return VocabParallelHead(sequence_parallel=sp)
        if heads is not None and leaf in _Q + _KV + _FUSED and not gather:
            return _attention_column(key, names, modules, heads, mesh, leaf, sp)
        # gathered (Phi3's qkv_proj): all heads on every rank, head counts stay global
        return ColumnParallel(gather_output=gather, sequence_parallel=sp)
    if style == "rowwise":
        is_out = _attention_role(style, names, modules, heads) == "out"
        return RowParallel(head_dim=heads[2] if is_out else None, sequence_parallel=sp)
    if style in ("rowwise_rep", "rowwise_split_input"):
        return RowParallel(input_is_parallel=False)
    if style == "embedding_rowwise":
        return RowParallel(sequence_parallel=sp)
    if style == "embedding_colwise":
        return ColumnParallel(gather_output=True)
    if style == "packed_colwise":  # a fused [gate | up]: two equal blocks, each split on its own
        dims = {linear_dims(modules[n]) for n in names}
        out = dims.pop()[1] if len(dims) == 1 and None not in dims else None
        if out is None or out % 2:
            raise ValueError(
                f"plan_from_transformers: 'packed_colwise' on {key!r} needs linears with an even "
                f"number of output features, got {sorted(str(d) for d in dims)}"
            )
        return ColumnParallel(sections=(out // 2, out // 2), sequence_parallel=sp)
    return ReplicatedGradSum()  # sequence_parallel, replicated_with_grad_allreduce


def _attention_column(key, names, modules, heads, mesh, leaf, sp) -> ParallelStyle:
    """Whole heads; the grouped-query layout checked on this mesh before anything changes."""
    q_heads, kv_heads, hd = heads
    sections = (q_heads * hd, kv_heads * hd, kv_heads * hd)
    expected = {"q": q_heads * hd, "kv": kv_heads * hd, "fused": sum(sections)}
    role = "fused" if leaf in _FUSED else "q" if leaf in _Q else "kv"
    for n in names:
        dims = linear_dims(modules[n])
        if dims is None or dims[1] != expected[role]:
            got = "not a linear" if dims is None else f"{dims[1]} output features"
            raise ValueError(
                f"plan_from_transformers: {n!r} ({role} projection) should have {expected[role]} "
                f"output features from the config's heads ({q_heads} query, {kv_heads} key/value "
                f"of head_dim {hd}), got {got}"
            )
    SectionLayout.build(f"plan_from_transformers: attention of {key!r}", sections, mesh.size(0), hd)
    if role == "fused":
        return _AttentionColumnParallel(sections=sections, head_dim=hd, sequence_parallel=sp)
    return _AttentionColumnParallel(head_dim=hd, sequence_parallel=sp)
