"""A module reachable under two names is one module through parallelize_module (issue 24).

Serial oracle in fp64: outputs, input gradients, every parameter gradient, one optimizer step,
a second input; 2 and 4 gloo ranks, uneven partitions. Before: the second name kept the serial
module (local on each slab, or a second set of Parameters).
"""

import copy

import pytest
import torch
from harness import run_ranks
from oracle import assert_params_match
from torch import nn

import tplayers
from tplayers.sharding import offsets_from_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)


class AliasUNet(nn.Module):
    """A small U-Net with one nn.Upsample under two names and one conv block under two names."""

    def __init__(self, c=4):
        super().__init__()
        self.inc = nn.Conv2d(2, c, 3, padding=1)
        self.enc_block = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(c, c, 3, padding=1)
        self.up2 = self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec_block = self.enc_block  # the same block reused on the way up
        self.out = nn.Conv2d(2 * c, 1, 1)

    def forward(self, x):  # x: (N, 2, H, W), H divisible by 4
        e = self.enc_block(self.inc(x))  # (N, c, H, W)
        m = torch.tanh(self.mid(self.pool(e)))  # (N, c, H/2, W/2)
        low = self.mid(self.pool(m))  # (N, c, H/4, W/4): mid reused by call, one name
        u = self.dec_block(self.up1(low) + m)  # (N, c, H/2, W/2)
        return self.out(torch.cat([self.up2(u), e], 1))  # (N, 1, H, W)


def _unet(rank, world, layout):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = AliasUNet().double()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    assert par.up1 is par.up2 and isinstance(par.up1, tplayers.DistributedUpsample)
    assert par.enc_block is par.dec_block and isinstance(par.enc_block[0], tplayers.DistributedConv2d)
    assert len(list(par.parameters())) == len(list(serial.parameters()))
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step in range(2):  # a step, then a second input after it
        x = torch.randn(2, 2, sum(layout), 8, dtype=torch.float64)
        xs = x.clone().requires_grad_(True)
        xp = x.narrow(2, offsets_from_sizes(layout)[rank], layout[rank]).clone().requires_grad_(True)
        ys, yp = serial(xs), par(xp)
        yg = tplayers.gather(yp, (2,), mesh)
        torch.testing.assert_close(yg, ys, **TIGHT)
        cot = torch.randn_like(ys)
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        torch.testing.assert_close(tplayers.gather(xp.grad, (2,), mesh), xs.grad, **TIGHT)
        assert_params_match(par, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(par, serial, grads=False, **TIGHT)
    return True


@pytest.mark.parametrize("world,layout", [(2, [6, 6]), (4, [5, 5, 5, 5])])  # balanced; uneven at H/2, H/4
def test_unet_with_shared_upsample_and_reused_block_is_exact(world, layout):
    assert all(run_ranks(_unet, world, args=(layout,), timeout=120))


class SharedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.b = self.a = nn.Linear(10, 10)  # registered as "b" first, then "a"
        self.out = nn.Linear(10, 5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.b(torch.tanh(self.a(h)))))


PLANS = {
    "names_a": {"a": tplayers.RowParallel(input_is_parallel=False)},  # the second name only
    "names_b": {"b": tplayers.ColumnParallel(gather_output=True)},  # the first name only
    "one_key_both": {r"a|b": tplayers.ColumnParallel(gather_output=True)},  # one key matching both names
}


def _tp_alias(rank, world, plan_name):
    mesh = tplayers.default_mesh()
    torch.manual_seed(1000 + rank)  # a different model on every rank: the default src_rank=0 makes it rank 0's
    model = SharedLinear().double()
    serial = copy.deepcopy(model)
    for t in list(serial.parameters()):
        torch.distributed.broadcast(t.data, 0)
    par = tplayers.parallelize_module(model, PLANS[plan_name], mesh=mesh)
    assert par.a is par.b and isinstance(par.a, tplayers.layers.ShardedModule)
    assert len(list(par.parameters())) == len(list(serial.parameters()))
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(par.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(4, 6, dtype=torch.float64, generator=gen)
        xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ys, yp = serial(xs), par(xp)
        torch.testing.assert_close(yp, ys, **TIGHT)
        ys.square().sum().backward()
        yp.square().sum().backward()
        torch.testing.assert_close(xp.grad, xs.grad, **TIGHT)
        assert_params_match(par, serial, grads=True, **TIGHT)
        opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
        assert_params_match(par, serial, grads=False, **TIGHT)
    return True


@pytest.mark.parametrize("plan_name", ["names_a", "names_b", "one_key_both"])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_plan_naming_one_alias_replaces_both_names(world, plan_name):
    assert all(run_ranks(_tp_alias, world, args=(plan_name,), timeout=60))


class PerPixelShared(nn.Module):
    """A per-pixel linear under two names inside a domain region (wrapped to sum its gradient)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.mix2 = self.mix1 = nn.Linear(3, 3)

    def forward(self, x):
        h = self.conv(x).permute(0, 2, 3, 1)  # (N, H, W, C)
        return self.mix2(torch.tanh(self.mix1(h))).permute(0, 3, 1, 2)


class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU())
        self.head_conv = self.trunk[0]  # the trunk's conv, reused outside the region

    def forward(self, x):
        return self.head_conv(x) + self.trunk(x)


def _names(model):
    return {n: m for n, m in model.named_modules(remove_duplicate=False)}


def _alias_errors(rank, world):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    msgs = []

    def refused(model, plan, *names):
        before = _names(model)
        with tplayers.count_collectives() as log:
            with pytest.raises(ValueError) as err:
                tplayers.parallelize_module(model, plan, mesh=mesh)
        after = _names(model)
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), "model changed"
        for n in names:
            assert repr(n) in str(err.value), (n, str(err.value))
        msgs.append((str(err.value), log.count()))

    # two keys, two different replacements for one module: both names in the error, before any collective
    lin = SharedLinear().double()
    refused(
        lin,
        {"a": tplayers.ColumnParallel(gather_output=True), "b": tplayers.RowParallel(input_is_parallel=False)},
        "a",
        "b",
    )
    # two keys naming the two names, even alike: a module matched by two keys (docs/design.md, plans)
    refused(lin, {"a": tplayers.ColumnParallel(), "b": tplayers.ColumnParallel()}, "a", "b")
    # a conv inside the region and reused outside it (one Parameter, two uses on differently laid out data)
    refused(Trunk().double(), {"trunk": tplayers.DomainParallel(shard_dims=(2,))}, "trunk.0", "head_conv")
    # the same through a partition function given the container
    refused(Trunk().double(), {"trunk": lambda name, m, mesh: copy.deepcopy(m)}, "trunk.0", "head_conv")
    # one conv in two regions given by two keys (two replacements): both names
    two = nn.Module()
    two.r1 = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())
    two.r2 = nn.Sequential(two.r1[0], nn.Tanh())
    refused(
        two,
        {"r1": tplayers.DomainParallel(shard_dims=(2,)), "r2": tplayers.DomainParallel(shard_dims=(3,))},
        "r1.0",
        "r2.0",
    )
    # a stateful module nested in one swapped subtree and matched itself: nested keys
    with pytest.raises(ValueError, match="nested modules"):
        tplayers.parallelize_module(
            Trunk().double(),
            {"trunk": tplayers.DomainParallel(shard_dims=(2,)), "head_conv": tplayers.DomainParallel(shard_dims=(2,))},
            mesh=mesh,
        )
    return msgs


def test_aliases_that_cannot_share_one_replacement_raise_naming_both_names():
    for msgs in run_ranks(_alias_errors, 2, timeout=60):
        assert "matched by two plan keys" in msgs[0][0] and msgs[0][1] == 0
        assert "matched by two plan keys" in msgs[1][0] and msgs[1][1] == 0
        assert "outside every module the plan swaps" in msgs[2][0] and msgs[2][1] == 0
        assert "outside every module the plan swaps" in msgs[3][0] and msgs[3][1] == 0
        assert "inside 'r1'" in msgs[4][0] and "inside 'r2'" in msgs[4][0] and msgs[4][1] == 0


def _per_pixel_alias(rank, world):
    """Exact, or a ValueError naming both names (never two differently wrapped uses)."""
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = PerPixelShared().double()
    try:
        par = tplayers.parallelize_module(
            copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
        )
    except ValueError as err:
        assert "'mix1'" in str(err) and "'mix2'" in str(err), str(err)
        return "raised"
    assert par.mix1 is par.mix2
    x = torch.randn(2, 2, 9, 4, dtype=torch.float64)
    xp = tplayers.shard(x, 2, mesh)
    torch.testing.assert_close(tplayers.gather(par(xp), (2,), mesh), serial(x), **TIGHT)
    serial(x).square().sum().backward()
    tplayers.gather(par(xp), (2,), mesh).square().sum().backward()
    assert_params_match(par, serial, grads=True, **TIGHT)
    return "exact"


def test_per_pixel_linear_under_two_names_in_a_region_is_exact_or_refused():
    out = run_ranks(_per_pixel_alias, 2, timeout=60)
    assert len(set(out)) == 1, out


def _tie_through_alias(rank, world):
    """A tied head reachable under a second name, planned under that name: the tie and the alias
    both survive (one Parameter, one module), exact against the serial model; the embedding side
    alone still refuses naming both tied names."""
    import os
    import sys

    import torch.nn.functional as F
    from oracle import assert_local_slices

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    )
    from gpt2_tp import GPT2, gpt2_plan

    mesh = tplayers.default_mesh()
    torch.manual_seed(3)
    vocab, d = 19, 8
    serial = GPT2(vocab, d, 2, 1, 8).double()
    serial.head_alias = serial.lm_head  # the tied head under a second name
    plan = gpt2_plan(d, 2)
    plan["head_alias"] = plan.pop("lm_head")
    model = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
    assert model.lm_head is model.head_alias and model.lm_head.weight is model.wte.weight
    idx = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    ls = F.cross_entropy(serial(idx).reshape(-1, vocab), idx.reshape(-1))
    lp = tplayers.vocab_parallel_cross_entropy(model(idx), idx, mesh)
    torch.testing.assert_close(lp, ls, **TIGHT)
    ls.backward(), lp.backward()
    assert_local_slices(model, serial, grads=True, **TIGHT)
    with pytest.raises(ValueError, match="tied") as err:
        tplayers.parallelize_module(copy.deepcopy(serial), {"wte": tplayers.RowParallel()}, mesh=mesh)
    assert "wte.weight" in str(err.value) and "lm_head.weight" in str(err.value)
    return True


def test_tie_through_an_aliased_head_is_kept():
    assert all(run_ranks(_tie_through_alias, 2, timeout=60))
