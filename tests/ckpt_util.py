"""Models shared by the checkpoint tests: a small transformer-ish net and a replicated-spec double."""

from __future__ import annotations

import torch
from torch import nn

import tplayers
from tplayers.layers import ShardedModule
from tplayers.sharding import ShardSpec


class ReplicatedDouble(ShardedModule):
    """Stands in for a domain-parallel layer: a ShardedModule whose every spec is replicated (dim None)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.bias = nn.Parameter(torch.randn(4))
        self.register_buffer("scale", torch.randn(2, 5).to(torch.bfloat16))
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))

    def shard_specs(self):
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return {
            name: ShardSpec.balanced(t.shape, None, world, rank)
            for name, t in list(self.named_parameters()) + list(self.named_buffers())
        }


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Embedding, two Column->Row MLP blocks (hidden 7: uneven; hidden 2: empty shards at 3-4 ranks), head."""

    def __init__(self, d: int = 6, hiddens=(7, 2), vocab: int = 11) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, h) for h in hiddens])
        self.head = nn.Linear(d, 5)
        self.dom = ReplicatedDouble()

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


PLAN = {
    r"blocks\.\d+\.fc1": tplayers.ColumnParallel(),
    r"blocks\.\d+\.fc2": tplayers.RowParallel(),
    "head": tplayers.ColumnParallel(),
}


def serial_net(seed: int, offset: float = 0.0, **kw) -> Net:
    """The serial reference: seeded weights, every tensor shifted by ``offset`` (tells checkpoints apart)."""
    torch.manual_seed(seed)
    net = Net(**kw)
    with torch.no_grad():
        for t in list(net.parameters()) + list(net.buffers()):
            t.add_(int(offset) if not t.is_floating_point() else offset)
    return net


def parallel_net(seed: int = 999, **kw) -> Net:
    """A parallel net (default mesh) with different weights than any checkpoint."""
    net = tplayers.parallelize_module(serial_net(seed, **kw), PLAN)
    return net


def snapshot(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_local_equals(model: nn.Module, reference: dict) -> None:
    """Every local tensor equals this rank's slice of the serial reference, bitwise."""
    from tplayers.checkpoint.layout import local_tensors

    for key, lt in local_tensors(model).items():
        want = lt.spec.take(reference[key])
        assert torch.equal(lt.tensor.detach(), want), f"{key}: {lt.tensor} != {want}"
