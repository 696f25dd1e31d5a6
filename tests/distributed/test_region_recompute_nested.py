"""Nested activation checkpoints inside a ``DomainParallel`` region: a checkpointed block calling
checkpointed blocks (transformers' ``SwinStage`` and ``SwinLayer`` are both checkpointed). Recomputing
the inner block starts from tensors its parent's recomputation saved, which torch hands over as
detached copies (``tplayers/region/aliases.py``): they are the same slices, so they keep their layouts
and the recomputation stays exact. Outputs, the input gradient, every parameter gradient and the
parameters after an SGD step equal the serial model's in fp64 at 2 ranks, for module checkpoints
(the recomputation guard of a module's call) and for function bodies under
``context_fn=tplayers.region_context_fn``, in both reentrant modes where they apply.
"""

import copy

import pytest
import torch
from harness import run_ranks
from oracle import backward_step_match
from torch import nn
from torch.utils.checkpoint import checkpoint

import tplayers
from tplayers.domain.active import active_guard

TIGHT = dict(rtol=1e-10, atol=1e-12)


class Inner(nn.Module):
    """A block with a routed op of its own (a spatial max): run without the guard it would take each
    rank's slice alone. ``runs``: (in backward, under a guard) per call."""

    def __init__(self, c):
        super().__init__()
        self.conv, self.norm, self.runs = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(1, c), []

    def forward(self, x):
        self.runs.append((torch._C._current_graph_task_id() != -1, active_guard() is not None))
        return x + torch.tanh(self.norm(self.conv(x))) * x.amax(dim=(2, 3), keepdim=True)


class Outer(nn.Module):
    """Two inner blocks, each checkpointed inside this block's own checkpoint (``how``: "module" checkpoints
    the inner modules' calls; "body" checkpoints a function body with a spatial mean in it, under
    ``region_context_fn``)."""

    def __init__(self, c, how, reentrant):
        super().__init__()
        self.blocks = nn.ModuleList([Inner(c), Inner(c)])
        self.how, self.reentrant = how, reentrant

    def _body(self, block, x):
        return block(x - x.mean(dim=(2, 3), keepdim=True))

    def forward(self, x):
        for block in self.blocks:
            if self.how == "module":
                x = checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = checkpoint(self._body, block, x, use_reentrant=False, context_fn=tplayers.region_context_fn)
        return x


class Model(nn.Module):
    def __init__(self, how, reentrant):
        super().__init__()
        self.stem, self.stage, self.head = nn.Conv2d(2, 4, 3, padding=1), Outer(4, how, reentrant), nn.Conv2d(4, 2, 1)
        self.how, self.reentrant = how, reentrant

    def forward(self, x):
        x = self.stem(x)
        if self.how == "module":
            x = checkpoint(self.stage, x, use_reentrant=self.reentrant)
        else:
            x = checkpoint(self.stage, x, use_reentrant=False, context_fn=tplayers.region_context_fn)
        return self.head(x)


def _nested(rank, world, how, reentrant):
    mesh = tplayers.default_mesh()
    torch.manual_seed(0)
    serial = Model(how, reentrant).double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    local = lambda t: tplayers.shard(t, 2, mesh)  # noqa: E731
    for step in range(2):
        torch.manual_seed(5 + step)
        x = torch.randn(2, 2, 11, 6, dtype=torch.float64)  # 11 rows: uneven shares
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = serial(xs), parallel(xl)
        torch.testing.assert_close(yl, local(ys), **TIGHT)
        w = torch.randn_like(ys)
        loss_s, loss_p = (ys * w).sum(), tplayers.domain_sum(yl * local(w), mesh)
        backward_step_match(loss_s, loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT)
    clone = copy.deepcopy(parallel)  # after recomputations: the region's record of them is not copied
    torch.testing.assert_close(clone(local(x)), parallel(local(x)), rtol=0, atol=0)
    for block in parallel.stage.blocks:  # each inner block ran in forward, and again in backward, under a guard
        runs = block.runs
        assert set(runs) == {(False, True), (True, True)} and runs.count((True, True)) >= 2, runs
    return True


@pytest.mark.parametrize(
    "how,reentrant", [("module", False), ("module", True), ("body", False)], ids=["module", "module_reentrant", "body"]
)
def test_nested_checkpoints_are_exact(how, reentrant):
    assert run_ranks(_nested, 2, args=(how, reentrant), timeout=120) == [True, True]
