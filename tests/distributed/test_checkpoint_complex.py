"""Complex parameters (spectral weights) in checkpoints: complex64 stored as safetensors' C64, complex128 as its
float64 real view; saved sharded at 2 ranks and consolidated, gathered, loaded at 1, 3 and 4 ranks bitwise, with
their AdamW state (a fresh optimizer's state created from the file, then one more step equal to the serial one)."""

import json
import os

import pytest
import torch
from harness import run_ranks
from torch import nn

from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint
from tplayers.checkpoint.format import read_header
from tplayers.layers import ShardedModule
from tplayers.sharding import ShardSpec


def _full(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    re, im = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.complex(re, im).to(dtype)


class Spectral(ShardedModule):
    """A spectral weight sharded along its first dim (7 rows over the ranks), a replicated complex gain and a
    real bias: what an FNO layer holds."""

    def __init__(self, dtype, world=1, rank=0, seed=1):
        super().__init__()
        self.specs = {
            "weight": ShardSpec.balanced((7, 3, 2), 0, world, rank),
            "gain": ShardSpec.replicated((3,)),
            "bias": ShardSpec.replicated((3,)),
        }
        self.weight = nn.Parameter(self.specs["weight"].take(_full((7, 3, 2), seed, dtype)).clone())
        self.gain = nn.Parameter(_full((3,), seed + 1, dtype))
        self.bias = nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))

    def shard_specs(self):
        return self.specs

    def loss(self):
        # elementwise products only: each rank's gradient slice is the serial one bit for bit
        return (self.weight * self.weight.conj()).real.sum() + (
            self.gain * self.gain.conj()
        ).real.sum() * self.bias.sum()


def _made(dtype, seed=1):
    world, rank = (
        (torch.distributed.get_world_size(), torch.distributed.get_rank())
        if torch.distributed.is_initialized()
        else (1, 0)
    )
    return Spectral(dtype, world, rank, seed), rank


def _stepped(model, steps=1):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        model.loss().backward()  # elementwise in the weight: each rank's slice of the serial gradient
        opt.step()
        opt.zero_grad()
    return opt


def _save(rank, world, root, dtype):
    model, _ = _made(dtype)
    opt = _stepped(model)
    save_checkpoint(model, os.path.join(root, "sharded"), optimizer=opt)
    save_checkpoint(model, os.path.join(root, "one.safetensors"), consolidated=True)
    full = gather_state_dict(model, all_ranks=True)
    serial = Spectral(dtype)
    _stepped(serial)
    return all(
        torch.equal(full[k], v) and full[k].dtype == dtype or k == "bias" for k, v in serial.state_dict().items()
    )


def _load(rank, world, root, dtype):
    serial = Spectral(dtype)
    serial_opt = _stepped(serial)
    twice = Spectral(dtype)
    _stepped(twice, 2)
    for name in ("sharded", "one.safetensors"):
        model, _ = _made(dtype, seed=99)  # other values everywhere
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        load_checkpoint(model, os.path.join(root, name), optimizer=opt if name == "sharded" else None)
        spec = model.specs["weight"]
        assert torch.equal(model.weight, spec.take(serial.weight.detach())) and model.weight.dtype == dtype
        assert torch.equal(model.gain, serial.gain) and torch.equal(model.bias, serial.bias)
        if name == "sharded":
            state = opt.state[model.weight]
            ref = serial_opt.state[serial.weight]
            assert state["exp_avg"].dtype == dtype and torch.equal(state["exp_avg"], spec.take(ref["exp_avg"]))
            assert torch.equal(state["exp_avg_sq"], spec.take(ref["exp_avg_sq"]))
            # one more step from the loaded state equals the serial model's second step
            model.loss().backward()
            opt.step()
            assert torch.equal(model.weight, spec.take(twice.weight.detach()))
            assert torch.equal(model.gain, twice.gain)
    return True


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_parameters_save_gather_reshard(tmp_path, dtype):
    root = str(tmp_path)
    assert all(run_ranks(_save, 2, args=(root, dtype), timeout=60))
    # what the files say: complex64 as C64, complex128 as F64 with a trailing (real, imaginary) dim
    with open(os.path.join(root, "sharded", "index.json")) as f:
        entry = json.load(f)["tensors"]["weight"]
    _, header, _ = read_header(os.path.join(root, "one.safetensors"))
    if dtype == torch.complex64:
        assert entry["dtype"] == "C64" and entry["shape"] == [7, 3, 2] and header["weight"]["dtype"] == "C64"
    else:
        assert entry["dtype"] == "F64" and entry["shape"] == [7, 3, 2, 2] and header["weight"]["shape"] == [7, 3, 2, 2]
    for world in (3, 4):
        assert all(run_ranks(_load, world, args=(root, dtype), timeout=60))
    assert _load(0, 1, root, dtype)  # no process group: a plain single-device model
