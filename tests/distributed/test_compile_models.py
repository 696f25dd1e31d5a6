"""torch.compile(fullgraph=True) beyond the TP block and the CNN of ``test_compile.py``: a U-Net
style model (transposed conv, bilinear upsampling, GroupNorm, BatchNorm, average pooling, a skip
connection) with a ``domain_mean`` loss, NeighborhoodAttention sharded along H (its tile kernel as
the registered op ``tplayers::na2d_tiles``), a sequence-parallel GPT-2 block (with graph breaks
where it exchanges the sequence lengths), and a Llama block with GQA replicas (tp 4 > 2 kv heads)
under a compiled ``vocab_parallel_cross_entropy``.

Each compiles with ``backend="aot_eager"`` and no graph break, and one training step (forward,
backward, SGD) then a second input equal eager (outputs, input gradient, every parameter gradient,
buffers) up to fp64 round-off.
"""

import copy
import os
import sys

import pytest
import torch
import torch._dynamo as dynamo
from gpt_block import Block, sp_plan
from harness import run_ranks
from torch import nn

import tplayers

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
)
from llama_tp import Llama, llama_plan  # noqa: E402

TOL = dict(rtol=1e-12, atol=1e-12)


class WithLoss(nn.Module):
    """``model`` followed by a per-pixel loss reduced over the whole domain (a replicated scalar)."""

    def __init__(self, model, mesh):
        super().__init__()
        self.model, self.mesh = model, mesh

    def forward(self, x):
        y = self.model(x)
        return tplayers.domain_mean(y.square(), self.mesh).reshape(1)


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())
        self.down = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.up_t = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.up_b = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.mix = nn.Conv2d(4 + 4 + 6, 3, 3, padding=1)

    def forward(self, x):
        e = self.enc(x)
        d = self.down(e)
        return self.mix(torch.cat([e, self.up_t(d), self.up_b(d)], dim=1))


def _compare(eager, compiled, inputs, cot_shape_of):
    """Two steps (SGD in between): compiled equals eager; returns nothing, raises on a mismatch."""
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for x in inputs:
        results = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = model(xi)
            cot = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3))
            (y * cot).sum().backward()
            grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
            bufs = {n.removeprefix("_orig_mod."): b.clone() for n, b in model.named_buffers()}
            results.append((y.detach(), xi.grad, grads, bufs))
        (ye, ge, pe, be), (yc, gc, pc, bc) = results
        torch.testing.assert_close(yc, ye, **TOL)
        torch.testing.assert_close(gc, ge, **TOL)
        assert pe.keys() == pc.keys() and be.keys() == bc.keys()
        for name in pe:
            torch.testing.assert_close(pc[name], pe[name], **TOL, msg=lambda m: f"grad {name}: {m}")
        for name in be:
            torch.testing.assert_close(bc[name], be[name], **TOL, msg=lambda m: f"buffer {name}: {m}")
        opt_e.step(), opt_c.step()


def _checked_copy(eager, x):
    """A copy of ``eager`` whose domain regions an eager call ran through (torch.compile refuses a region no
    eager call checked, unless it is plainly twins and local modules), with ``eager``'s state."""
    model = copy.deepcopy(eager)
    with torch.no_grad():
        model(x)
    model.load_state_dict(eager.state_dict())
    return model


def _check(eager, inputs, fullgraph=True):
    """``fullgraph=False``: the layer reads values on the host (sequence parallelism's per-call
    length exchange), so the graph breaks there; the result must still equal eager."""
    model = _checked_copy(eager, inputs[0])
    explained = dynamo.explain(_checked_copy(eager, inputs[0]))(inputs[0])
    if fullgraph:
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    dynamo.reset()
    compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    _compare(eager, compiled, inputs, None)
    return explained.graph_break_count


def _unet(rank, world):
    mesh = tplayers.default_mesh()
    xs = [tplayers.shard(torch.randn(2, 2, 8 * world, 6, dtype=torch.float64), 2, mesh) for _ in range(2)]
    for with_loss in (False, True):
        torch.manual_seed(0)
        eager = tplayers.parallelize_module(
            TinyUNet().double(), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
        )
        _check(WithLoss(eager, mesh) if with_loss else eager, xs)
    return 0


def _pools(rank, world):
    """Max pooling, InstanceNorm with running stats, a global adaptive max pool and a head."""
    torch.manual_seed(0)
    mesh = tplayers.default_mesh()
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.MaxPool2d(3, 2, 1),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()
    eager = tplayers.parallelize_module(serial, {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    xs = [tplayers.shard(torch.randn(2, 2, 6 * world + 1, 5, dtype=torch.float64), 2, mesh) for _ in range(2)]
    return _check(eager, xs)


def _na(rank, world):
    torch.manual_seed(0)
    mesh = tplayers.default_mesh()
    serial = tplayers.NeighborhoodAttention(8, 2, 3, 1, rel_pos_bias=True, dtype=torch.float64)
    eager = tplayers.NeighborhoodAttention.from_module(serial, mesh=mesh, shard_dims=(1,))
    xs = [tplayers.shard(torch.randn(2, 4 * world + 1, 5, 8, dtype=torch.float64), 1, mesh) for _ in range(2)]
    return _check(eager, xs)


def _sp_block(rank, world):
    torch.manual_seed(0)
    mesh = tplayers.default_mesh()
    heads = 2
    eager = tplayers.parallelize_module(Block(4 * heads, heads, p=0.0, dtype=torch.float64), sp_plan(heads), mesh=mesh)
    xs = [tplayers.shard(torch.randn(2, 5 * world, 4 * heads, dtype=torch.float64), 1, mesh) for _ in range(2)]
    return _check(eager, xs, fullgraph=False)


def _llama_gqa(rank, world):
    """fullgraph for the model; the loss compiles too (its target check and vocab offsets read
    values on the host, so it may break the graph, never the result)."""
    torch.manual_seed(4)
    mesh = tplayers.default_mesh()
    vocab, d, heads, kv, ffn = 29, 16, 8, 2, 11
    eager = tplayers.parallelize_module(
        Llama(vocab, d, heads, kv, ffn, 1, False).double(), llama_plan(d, heads, kv, ffn, False), mesh=mesh
    )
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True, backend="aot_eager")
    loss_c = torch.compile(tplayers.vocab_parallel_cross_entropy, backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for _ in range(2):
        inp, target = torch.randint(0, vocab, (2, 7), generator=gen), torch.randint(0, vocab, (2, 7), generator=gen)
        target[0, :2] = -100
        out = []
        for model, loss_fn in ((eager, tplayers.vocab_parallel_cross_entropy), (compiled, loss_c)):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(inp), target, mesh, label_smoothing=0.1)
            loss.backward()
            out.append(
                (loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()})
            )
        torch.testing.assert_close(out[1][0], out[0][0], **TOL)
        assert out[0][1].keys() == out[1][1].keys()
        for name in out[0][1]:
            torch.testing.assert_close(out[1][1][name], out[0][1][name], **TOL, msg=lambda m: f"grad {name}: {m}")
        for opt in opts:
            opt.step()
    return 0  # the model: fullgraph


@pytest.mark.parametrize(
    "case,world",
    [(_unet, 2), (_pools, 3), (_na, 2), (_sp_block, 2), (_llama_gqa, 4)],
    ids=["unet", "pools_instance_norm_head", "neighborhood_attention", "sequence_parallel", "llama_gqa_vocab_ce"],
)
def test_compile_equals_eager(case, world):
    out = run_ranks(case, world, timeout=240)
    print(f"{case.__name__}: graph breaks {out[0]}")
