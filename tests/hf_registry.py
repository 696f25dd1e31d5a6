"""Every causal-LM architecture of the installed transformers whose config ships a
``base_model_tp_plan``, built tiny (random init, fp64, no downloads) and run from its own plan at
tp 2 against the serial model: forward logits, a loss's every parameter gradient. Each gets a verdict:

- ``exact``: logits and every gradient equal the serial model's (1e-9);
- ``refused``: a ``ValueError`` from tplayers on every rank (plan, swap or forward), with its reason;
- ``crash``: another exception (a rank's traceback, the first line kept);
- ``silent``: it ran, and differs from the serial model (the worst difference kept);
- ``no tiny config``: the generic tiny config does not build or run serially (not a tplayers verdict).

A mixture of experts refused for its experts is tried again with ``replicate_experts=True`` and with
``expert_parallel=True``. ``attention_dropout=p``: the same in training with the config's attention
dropout at ``p`` (every rank and the serial run seeded alike; verdict ``no attention dropout`` where
the model's training forward does not change with it).

Used by tests/distributed/test_hf_registry.py (one architecture per run of the ranks, so a crash
that leaves a rank waiting costs only that architecture's timeout) and by
``python tests/hf_registry.py`` (prints the markdown table of docs/huggingface.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import copy  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tplayers  # noqa: E402

VOCAB = 64
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    # mixture of experts, multi-head latent attention, linear attention: small where named
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    sliding_window=4,
)


def architectures():
    """``[(model_type, config class)]`` of the causal-LM registry whose config has a base tp plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ValueError, ImportError):
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            out.append(model_type)
    return out


#: config fields holding an attention-probability dropout (set by ``attention_dropout=``)
DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def tiny_model(model_type, attention_dropout=0.0):
    """The tiny fp64 model (seeded), or raises; ``attention_dropout`` > 0 sets the config's attention
    dropout fields (eager attention, as always here)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in {id(config): config, id(text): text}.values():
        _shrink(cfg)
        for field in DROPOUT_FIELDS if attention_dropout else ():
            if isinstance(getattr(cfg, field, None), (int, float)) and not isinstance(getattr(cfg, field), bool):
                setattr(cfg, field, attention_dropout)
    with torch.device("meta"):  # count first: a default sub-config (vision, audio) may be huge
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size > 5_000_000:
        raise ValueError(f"the tiny config still has {size:,} parameters (a sub-config this recipe leaves alone)")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double().eval()


def _shrink(config):
    for key, value in TINY.items():
        if hasattr(config, key) and not isinstance(getattr(config, key), dict):
            setattr(config, key, value)
    if hasattr(config, "qk_rope_head_dim"):  # multi-head latent attention: rope dims are the head_dim
        config.head_dim = config.qk_rope_head_dim
        if hasattr(config, "qk_head_dim"):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if hasattr(config, "kv_lora_rank") and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads  # latent attention: one kv head per query head
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) >= 2:
        kinds = list(dict.fromkeys(types))  # one layer of each kind (hybrid models: linear and full attention)
        config.layer_types = (kinds + types)[: config.num_hidden_layers] if len(kinds) < 2 else kinds[:2]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= VOCAB:
            setattr(config, key, 0)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # grouped_mm has no float64 kernel on the CPU


def _ids():
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


#: the generator seed of every rank and of the serial run before a forward with attention dropout
DROPOUT_SEED = 7


def serial_run(model_type, attention_dropout=0.0):
    """``(model, logits, {name: grad})`` of the serial tiny model, or raises. With ``attention_dropout``
    the forward runs in training under :data:`DROPOUT_SEED`."""
    model = tiny_model(model_type, attention_dropout)
    ids = _ids()
    if attention_dropout:
        model.train()
        torch.manual_seed(DROPOUT_SEED)
    logits = model(ids).logits
    _loss(logits, ids).backward()
    return model, logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _drops(model) -> bool:
    """Whether the training forward under :data:`DROPOUT_SEED` differs from the evaluation one."""
    ids = _ids()
    with torch.no_grad():
        torch.manual_seed(DROPOUT_SEED)
        trained = model.train()(ids).logits
        evaluated = model.eval()(ids).logits
    model.train()
    return float((trained - evaluated).abs().max()) > 1e-9


def verdict(rank, world, model_type, replicate_experts=False, expert_parallel=False, attention_dropout=0.0):
    """Run inside a rank: ``(verdict, detail)``. ``attention_dropout`` > 0: both models in training,
    seeded alike (``no attention dropout``: the model's training forward does not change with it)."""
    from tplayers.checkpoint.layout import local_tensors

    warnings.simplefilter("ignore")
    try:
        serial, want, grads = serial_run(model_type, attention_dropout)
        if attention_dropout and not _drops(serial):
            return "no attention dropout", "training and evaluation forwards agree"
    except Exception as e:  # noqa: BLE001 - a tiny config this generic recipe cannot build
        return "no tiny config", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    mesh = tplayers.default_mesh()
    model = copy.deepcopy(serial)
    model.zero_grad(set_to_none=True)
    ids = _ids()
    try:
        plan = tplayers.plan_from_transformers(
            model, mesh=mesh, replicate_experts=replicate_experts, expert_parallel=expert_parallel
        )
        model = tplayers.parallelize_module(model, plan, mesh=mesh)
        if attention_dropout:
            torch.manual_seed(DROPOUT_SEED)
        logits = model(ids).logits
        _loss(logits, ids).backward()
    except ValueError as e:
        experts = " [experts]" if "replicate_experts=True" in str(e) else ""  # the message names the option
        return "refused", str(e).splitlines()[0][:200] + experts
    except Exception as e:  # noqa: BLE001 - the verdict records it
        return "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    worst = float((logits.detach() - want).abs().max()) if logits.shape == want.shape else float("inf")
    where = "logits"
    mine = dict(model.named_parameters(remove_duplicate=False))
    for key, lt in local_tensors(model).items():
        if key not in grads or key not in mine or mine[key].grad is None:
            continue
        diff = float((mine[key].grad - lt.spec.take(grads[key])).abs().max())
        if diff > worst:
            worst, where = diff, key
    missing = [k for k in grads if k in mine and mine[k].grad is None]
    if missing:
        return "silent", f"no gradient for {missing[0]}"
    if worst <= 1e-9:
        return "exact", f"max diff {worst:.1e}"
    if worst <= 1e-6:  # a float32 rounding flip: these models' norms compute in float32 even in fp64
        return "float32-level", f"{where} off by {worst:.1e}"
    return "silent", f"{where} off by {worst:.2e}"


#: the refusals, by the part of the message that says why (first match wins)
REASONS = (
    (
        "ExpertParallel expects",
        "an experts module of another interface (not (hidden_states, top_k_index, top_k_weights))",
    ),
    ("shared_experts.gate_proj' ('colwise') names a parameter", "the plan shards the shared experts' bare parameters"),
    ("experts.", "mixture of experts: the plan shards expert parameters (not supported)"),
    ("moe_tp_experts", "mixture of experts: the plan shards expert parameters (not supported)"),
    ("mla_kv_a_proj", "multi-head latent attention (`mla_kv_a_proj`, not supported)"),
    ("names a parameter", "the plan shards a bare parameter (attention sinks, a gate bias)"),
    ("output features from the config", "projection widths other than the config's heads (gated or mixed attention)"),
    ("sits beside", "a module with parameters beside a sharded linear that the plan leaves out"),
)


def reason(detail: str) -> str:
    return next((why for key, why in REASONS if key in detail), detail)


def table(results):
    lines = ["| architecture | verdict | why / max difference |", "| --- | --- | --- |"]
    for model_type, (v, detail, *again) in results:
        text = reason(detail) if v == "refused" else detail
        for option, retry in zip(("replicate_experts", "expert_parallel"), again):
            text += f"; with `{option}=True`: {retry[0]}"
            text += f" ({reason(retry[1])})" if retry[0] == "refused" else ""
        lines.append(f"| `{model_type}` | {v} | {text.replace('|', '/')[:320]} |")
    return "\n".join(lines)


def survey(world=2, only=None, timeout=60, attention_dropout=0.0):
    """Every architecture's verdict; with ``attention_dropout`` > 0 the training run with that attention
    dropout (mixtures of experts with ``replicate_experts=True``, no retries)."""
    from harness import RankFailure, run_ranks

    results = []
    for model_type in only or architectures():
        args = (model_type, True, False, attention_dropout) if attention_dropout else (model_type,)
        try:
            out = run_ranks(verdict, world, args=args, timeout=timeout)
            v = out[0] if all(o[0] == out[0][0] for o in out) else ("crash", f"ranks disagree: {out}")
        except RankFailure as e:
            lines = [line for line in str(e).splitlines() if line.strip()]
            v = ("crash", (lines[-1] if lines else "rank failure")[:160])
        if v[0] == "refused" and v[1].endswith("[experts]"):  # a mixture of experts: its options too
            retries = []
            for options in ((True, False), (False, True)):  # replicate_experts, expert_parallel
                try:
                    out = run_ranks(verdict, world, args=(model_type, *options), timeout=timeout)
                    retry = out[0] if all(o[0] == out[0][0] for o in out) else ("crash", f"ranks disagree: {out}")
                except RankFailure as e:
                    retry = ("crash", str(e).splitlines()[-1][:160])
                retries.append(retry)
            v = (v[0], v[1], *retries)
        results.append((model_type, v))
        print(model_type, v, flush=True)
    return results


if __name__ == "__main__":  # python tests/hf_registry.py [--attention-dropout P] [model_type ...]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    argv = sys.argv[1:]
    p = float(argv[argv.index("--attention-dropout") + 1]) if "--attention-dropout" in argv else 0.0
    names = [
        a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--attention-dropout")
    ]
    res = survey(only=names or None, attention_dropout=p)
    print(table(res))
    counts = {}
    for _, (v, *_) in res:
        counts[v] = counts.get(v, 0) + 1
    print(counts)
