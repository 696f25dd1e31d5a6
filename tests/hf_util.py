"""Tiny transformers models (random init, no downloads) and the fp64 comparison against the serial
model used by tests/distributed/test_hf_*.py: loss, every parameter gradient, after SGD steps."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import importlib  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from oracle import assert_local_slices  # noqa: E402

import tplayers  # noqa: E402

TIGHT = dict(rtol=1e-10, atol=1e-12)


def require(package: str):
    """The tested peer ``package``, imported plainly: the ``test`` extra installs it, so a missing one is
    an import error (locally and in CI alike), never a skip."""
    return importlib.import_module(package)


VOCAB = 37  # uneven at 2 and 4 ranks


def llama(seed=0, heads=4, kv=2, layers=2, tie=False):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=22,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).double()


def qwen2(seed=0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=22,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = transformers.Qwen2ForCausalLM(config).double()
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2: biases on q, k, v
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()  # non-zero, so a misplaced bias slice shows
    return model


def gpt2(seed=0, heads=3):
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=4 * heads,
        n_layer=2,
        n_head=heads,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    model = transformers.GPT2LMHeadModel(config).double()
    with torch.no_grad():
        for block in model.transformer.h:
            for conv in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                conv.bias.normal_()  # Conv1D starts with zero biases
    return model


def gpt2_hand_plan(model):
    """The GPT-2 plan of ``docs/huggingface.md`` for transformers' GPT2LMHeadModel, written by hand."""
    d, heads = model.config.n_embd, model.config.n_head
    hd = d // heads
    return {
        r"transformer\.wte": tplayers.RowParallel(),
        r"transformer\.h\.\d+\.attn\.c_attn": tplayers.ColumnParallel(sections=(d, d, d), head_dim=hd),
        r"transformer\.h\.\d+\.attn\.c_proj": tplayers.RowParallel(head_dim=hd),
        r"transformer\.h\.\d+\.mlp\.c_fc": tplayers.ColumnParallel(),
        r"transformer\.h\.\d+\.mlp\.c_proj": tplayers.RowParallel(),
        "lm_head": tplayers.ColumnParallel(gather_output=True),
    }


def localize_gpt2_split(model):
    """With a hand plan: GPT-2's attention splits c_attn's output by ``split_size``; make it this
    rank's q width (plan_from_transformers does this itself)."""
    for block in model.transformer.h:
        block.attn.split_size = list(block.attn.c_attn.local_sections)  # [q, k, v] widths, even if 0


def compare_lm(serial, model, mesh, *, vocab_parallel=False, sequence_parallel=False, steps=2, seq=9, tol=None):
    """SGD steps on both models from the same batches; loss, every gradient and parameter each step
    (to ``tol``, default ``TIGHT``; the first step's loss always to ``TIGHT``)."""
    tol = tol or TIGHT
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.5)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
        logits = serial(ids).logits  # (2, seq, vocab)
        ls = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if sequence_parallel:  # the model sees this rank's tokens only: positions of the full sequence
            out = model(ids, position_ids=torch.arange(seq).unsqueeze(0)).logits
        else:
            out = model(ids).logits
        if vocab_parallel:
            assert out.shape[-1] == tplayers.shard_sizes(VOCAB, mesh.size())[mesh.get_local_rank()]
            lp = tplayers.causal_lm_loss(out, ids, mesh)
        else:
            assert out.shape[-1] == VOCAB
            lp = F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        torch.testing.assert_close(lp, ls, **(TIGHT if not losses else tol))
        ls.backward()
        lp.backward()
        assert_local_slices(model, serial, grads=True, **tol)
        opt_s.step(), opt_p.step()
        opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **tol)
        losses.append(float(lp))
    full = tplayers.gather_state_dict(model, all_ranks=True)
    ref = serial.state_dict()
    assert set(full) == set(ref), set(full) ^ set(ref)
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], **tol, msg=lambda m: f"{k}: {m}")
    return losses


def gemma(kind="gemma2", seed=0, tie=True):
    """Gemma2 / Gemma3 (text): a scaled word embedding (``* sqrt(hidden)``), sliding windows, soft caps,
    4 query / 2 kv heads of head_dim 4, the lm_head tied to it by default."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=22,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=64,
        sliding_window=4,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    if kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common))
    assert float(model.model.embed_tokens.embed_scale) == 4.0  # sqrt(hidden): a lost scale shows
    return model.double()


def phi3(seed=0, attn="sdpa"):
    """Phi3: a fused qkv_proj and gate_up_proj whose own plan gathers their outputs
    (``colwise_gather_output``) and splits the next input locally (``rowwise_split_input``)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=22,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        attn_implementation=attn,
    )
    return transformers.Phi3ForCausalLM(config).double()
