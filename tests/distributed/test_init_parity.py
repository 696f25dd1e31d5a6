"""Layers built directly under one seed hold exactly their slice of the serial layer (gloo ranks)."""

import random

import pytest
import torch
from harness import run_ranks
from oracle import gather_tensor
from torch import nn

import tplayers


class SerialMLP(nn.Module):
    def __init__(self, d, hidden, out, bias1, bias2, dtype):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=bias1, dtype=dtype)
        self.fc2 = nn.Linear(hidden, out, bias=bias2, dtype=dtype)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class ParallelMLP(nn.Module):
    """The same model, hand-written with the tensor-parallel layers (Megatron style)."""

    def __init__(self, d, hidden, out, bias1, bias2, dtype, mesh):
        super().__init__()
        self.fc1 = tplayers.ColumnParallelLinear(d, hidden, bias=bias1, mesh=mesh, dtype=dtype)
        self.fc2 = tplayers.RowParallelLinear(hidden, out, bias=bias2, mesh=mesh, dtype=dtype)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _init_parity(rank, world, seed):
    mesh = tplayers.default_mesh()
    rng = random.Random(seed)
    for case in range(8):
        d, hidden, out = rng.randint(1, 9), rng.randint(1, 13), rng.randint(1, 7)  # uneven, some < world
        bias1, bias2 = rng.random() < 0.7, rng.random() < 0.7
        dtype = rng.choice([torch.float32, torch.float64])
        s = rng.randrange(1 << 30)
        torch.manual_seed(s)
        serial = SerialMLP(d, hidden, out, bias1, bias2, dtype)
        after_serial = torch.random.get_rng_state()
        torch.manual_seed(s)
        par = ParallelMLP(d, hidden, out, bias1, bias2, dtype, mesh)
        # The generator ends where the serial model's did: later layers match as well.
        assert torch.equal(torch.random.get_rng_state(), after_serial), case
        assert par.fc1.weight.dtype == dtype
        for name in ("fc1", "fc2"):
            for pname, spec in getattr(par, name).shard_specs().items():
                local = getattr(getattr(par, name), pname).detach()
                full = getattr(getattr(serial, name), pname).detach()
                assert torch.equal(local, spec.take(full)), (case, name, pname)  # exactly this rank's slice
                assert torch.equal(gather_tensor(getattr(par, name), pname, local), full), (case, name, pname)
        x = torch.randn(3, d, dtype=dtype)  # same seed stream on every rank: same x
        torch.testing.assert_close(par(x), serial(x), rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-6)
    # Shards differ across ranks (no rank holds a copy of another's): not "half the width".
    torch.manual_seed(0)
    col = tplayers.ColumnParallelLinear(5, 4 * world, mesh=mesh)
    gathered = gather_tensor(col, "weight", col.weight.detach())
    blocks = gathered.split(4, 0)
    assert all(not torch.equal(blocks[0], b) for b in blocks[1:])
    # device="meta" draws nothing and leaves the generator alone.
    state = torch.random.get_rng_state()
    meta = tplayers.RowParallelLinear(7, 3, mesh=mesh, device="meta")
    assert meta.weight.device.type == "meta" and torch.equal(torch.random.get_rng_state(), state)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_directly_built_layers_equal_serial_slices(world):
    assert all(run_ranks(_init_parity, world, args=(40 + world,), timeout=60))
