"""Separate q / k / v / o projections of one attention planned together (issue 24; docs/design.md, tensor-parallel linears).

Llama-like GQA (examples/llama_tp.py's model, 4 query / 2 key-value heads) against the serial model
in fp64 (loss, every parameter gradient, one AdamW step) where the heads split, a ValueError naming
the rank and heads where they do not (tp 3), on every rank before any collective. The same for an
attention whose projections have other names and say their role in the style, and for a plan that
would split a head (no head_dim, or an output projection reading other heads than its rank's).
"""

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import assert_local_slices
from torch import nn

import tplayers

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
)
from llama_tp import Llama, llama_plan, rotary  # noqa: E402

TIGHT = dict(rtol=1e-10, atol=1e-12)
VOCAB, D, HEADS, KV, FFN = 23, 16, 4, 2, 10  # head_dim 4


class RoleAttention(nn.Module):
    """GQA with projections named so no rule can guess them: the plan says their roles."""

    def __init__(self, d=D, heads=HEADS, kv=KV):
        super().__init__()
        self.hd = d // heads
        self.qp = nn.Linear(d, heads * self.hd)
        self.kp = nn.Linear(d, kv * self.hd)
        self.vp = nn.Linear(d, kv * self.hd)
        self.op = nn.Linear(heads * self.hd, d)

    def forward(self, x):  # x: (b, s, d)
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (self.qp(x), self.kp(x), self.vp(x)))
        rep = q.shape[1] // k.shape[1]  # query heads per kv head held here
        y = F.scaled_dot_product_attention(
            rotary(q), rotary(k).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )
        return self.op(y.transpose(1, 2).reshape(b, s, -1))


def role_plan(hd):
    return {
        "qp": tplayers.ColumnParallel(head_dim=hd, head_role="q"),
        "kp": tplayers.ColumnParallel(head_dim=hd, head_role="k"),
        "vp": tplayers.ColumnParallel(head_dim=hd, head_role="v"),
        "op": tplayers.RowParallel(head_dim=hd, head_role="o"),
    }


def _step_compare(serial, model, loss_fn):
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # a step, then a second input
        ls, lp = loss_fn(serial, gen, False), loss_fn(model, gen, True)
        torch.testing.assert_close(lp, ls, **TIGHT)
        ls.backward(), lp.backward()
        assert_local_slices(model, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_local_slices(model, serial, grads=False, **TIGHT)


def _llama_loss(mesh):
    def loss(m, gen, parallel):
        if not parallel:
            loss.batch = (
                torch.randint(0, VOCAB, (2, 7), generator=gen),
                torch.randint(0, VOCAB, (2, 7), generator=gen),
            )
        inp, target = loss.batch
        logits = m(inp)
        if parallel:
            return tplayers.vocab_parallel_cross_entropy(logits, target, mesh)
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    return loss


def _exact(rank, world, kind):
    mesh = tplayers.default_mesh()
    torch.manual_seed(4)
    if kind == "roles":
        serial = RoleAttention().double()
        model = tplayers.parallelize_module(copy.deepcopy(serial), role_plan(D // HEADS), mesh=mesh)

        def loss(m, gen, parallel):
            if not parallel:
                loss.x = torch.randn(2, 5, D, dtype=torch.float64, generator=gen)
            return m(loss.x).square().mean()

        _step_compare(serial, model, loss)
        return model.kp.weight_ranges
    serial = Llama(VOCAB, D, HEADS, KV, FFN, 1, kind == "fused").double()
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), llama_plan(D, HEADS, KV, FFN, kind == "fused"), mesh=mesh
    )
    _step_compare(serial, model, _llama_loss(mesh))
    return model.layers[0].attn.k_proj.weight_ranges if kind == "separate" else None


@pytest.mark.parametrize("kind", ["separate", "fused", "roles"])
@pytest.mark.parametrize("world", [2, 4])
def test_gqa_4_query_2_kv_heads_exact_at_2_and_4_ranks(world, kind):
    out = run_ranks(_exact, world, args=(kind,), timeout=120)
    if kind != "fused":
        hd = D // HEADS
        for rank, ranges in enumerate(out):  # kv head r * 2 // world (replicated at 4 ranks)
            kv = rank * KV // world if world > KV else rank
            assert ranges == ((kv * hd, (kv + 1) * hd),)


class HFLikeAttention(RoleAttention):
    """Hugging Face style names and a ``head_dim`` attribute (and no head_dim in the plan)."""

    def __init__(self, d=D, heads=8, kv=KV):
        nn.Module.__init__(self)
        self.hd = self.head_dim = d // heads
        self.q_proj, self.k_proj = nn.Linear(d, heads * self.hd), nn.Linear(d, kv * self.hd)
        self.v_proj, self.o_proj = nn.Linear(d, kv * self.hd), nn.Linear(heads * self.hd, d)


def _refusals(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    msgs = []

    def refused(model, plan, pattern, collectives=0):
        before = {n: m for n, m in model.named_modules()}
        with tplayers.count_collectives() as log:
            with pytest.raises(ValueError, match=pattern) as err:
                tplayers.parallelize_module(model, plan, mesh=mesh)
        assert {n: m for n, m in model.named_modules()} == before, "model changed"
        assert log.count() == collectives, log.summary()
        msgs.append(str(err.value))

    if world == 3:
        hd = D // HEADS
        # Llama-like 4 / 2 heads, separate q/k/v by name: rank 1 holds query head 2, kv head 0
        llama = Llama(VOCAB, D, HEADS, KV, FFN, 1, False).double()
        refused(llama, llama_plan(D, HEADS, KV, FFN, False), r"rank 1 holds query heads \[2, 3\)")
        with pytest.raises(ValueError, match=r"rank 1 holds query heads \[2, 3\)"):
            tplayers.explain(llama, llama_plan(D, HEADS, KV, FFN, False), mesh, print_table=False)
        # the fused layout refuses in its layer (found while building; carried to every rank)
        fused = Llama(VOCAB, D, HEADS, KV, FFN, 1, True).double()
        refused(fused, llama_plan(D, HEADS, KV, FFN, True), r"rank 1 holds query heads \[2, 3\)", collectives=1)
        # projections with other names, roles given in the style
        refused(RoleAttention().double(), role_plan(hd), r"rank 1 holds query heads \[2, 3\) of qp")
        return msgs
    # world 4, no head_dim on q/k/v (o has one): the kv projections would split heads
    llama8 = Llama(VOCAB, D, 8, KV, FFN, 1, False).double()  # head_dim 2: 2 kv heads = 4 features on 4 ranks
    plan = llama_plan(D, 8, KV, FFN, False)
    plan[r"layers\.\d+\.attn\.(q|k|v)_proj"] = tplayers.ColumnParallel()
    refused(
        llama8,
        plan,
        r"layers.0.attn.k_proj: on 4 ranks, rank 0 would hold output features \[0, 1\), not whole heads of 2",
    )
    # Hugging Face style: nothing in the plan says head_dim, the attention's head_dim attribute does
    hf = HFLikeAttention().double()
    plain = {"(q|k|v)_proj": tplayers.ColumnParallel(), "o_proj": tplayers.RowParallel()}
    refused(hf, plain, r"k_proj: on 4 ranks, rank 0 would hold output features \[0, 1\).*<root>.head_dim=2")
    # multi-head (2 heads) at 4 ranks: q heads replicated in groups, o split in balanced heads
    mha = RoleAttention(d=8, heads=2, kv=2).double()
    refused(mha, role_plan(4), r"rank 1's qp outputs query features \[0, 4\).*but op takes input features \[4, 8\)")
    # a role that does not fit the style
    with pytest.raises(ValueError, match=r"head_role=...\) must be one of 'o' or None, got 'q'"):
        tplayers.parallelize_module(mha, {"op": tplayers.RowParallel(head_role="q")}, mesh=mesh)
    return msgs


@pytest.mark.parametrize("world", [3, 4])
def test_heads_that_cannot_follow_their_kv_group_or_would_split_raise_on_every_rank(world):
    out = run_ranks(_refusals, world, timeout=120)
    assert all(len(m) == 3 for m in out)
    same = (
        (0, 2) if world == 3 else (0, 1, 2)
    )  # at 3 the fused refusal is the layer's own on some ranks, carried on others
    for i in same:
        assert all(m[i] == out[0][i] for m in out), [m[i] for m in out]
    if world == 3:
        assert "layers.0.attn.q_proj (4 heads)" in out[0][0] and "layers.0.attn.k_proj (2 heads)" in out[0][0]


def _docstring_example(rank, world):
    import textwrap

    import tplayers.parallelize.attention_groups as mod

    doc = mod.__doc__
    code = textwrap.dedent(doc[doc.index("::\n") + 3 :])
    if world == 3:
        with pytest.raises(ValueError, match=r"rank 1 holds query heads \[2, 3\) of wq_"):
            exec(code, {})
        return "raised"
    exec(code, {})
    return "ran"


@pytest.mark.parametrize("world,expected", [(2, "ran"), (3, "raised")])
def test_module_docstring_example(world, expected):
    assert run_ranks(_docstring_example, world, timeout=60) == [expected] * world
