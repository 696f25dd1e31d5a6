"""Data parallelism composed with tensor and domain parallelism: DDP / FSDP2 on a 2-D mesh,
checkpoints with optimizer state, resumed at another layout and loaded serially.

    torchrun --standalone --nproc-per-node 2 examples/data_parallel.py            # dp 2 x tp 1
    torchrun --standalone --nproc-per-node 4 examples/data_parallel.py --wrap ddp # dp 2 x tp 2

The mesh is ``(dp, tp)`` with ``dp = 2`` (when the world is even). A small MLP is
tensor-parallel over ``mesh["tp"]`` and FSDP2-sharded (or DDP-replicated) over
``mesh["dp"]``; a small CNN is domain-parallel over ``mesh["tp"]`` (used as the
domain axis) and DDP-replicated over ``mesh["dp"]``. Each dp rank trains on its
half of every batch. The script then

1. checks the MLP's first step against the serial model on the full batch (fp64),
2. saves a sharded checkpoint with the AdamW state, loads it into a fresh wrapped
   model and optimizer, and checks that training continues bitwise identically,
3. loads the same checkpoint into the plain serial model and optimizer,
4. trains the dp x domain CNN one step under DDP and saves it with its SGD momentum.
"""

import argparse
import copy
import gc
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import tplayers
from tplayers.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint

PLAN = {"up": tplayers.ColumnParallel(), "down": tplayers.RowParallel()}


class MLP(nn.Module):
    def __init__(self, d=16, hidden=40):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 8, 3, padding=1, padding_mode="circular"),
            nn.Tanh(),
            nn.Conv2d(8, 2, 3, padding=1, padding_mode="circular"),
        )

    def forward(self, x):
        return self.net(x)


def wrap(model, kind, mesh):
    if kind == "ddp":
        return DDP(model, process_group=mesh["dp"].get_group())
    fully_shard(model, mesh=mesh["dp"])  # FSDP2: parameters become DTensors sharded over dp
    return model


def batch(step, dp_rank, dp, n=8, d=16):
    g = torch.Generator().manual_seed(step)
    x, t = torch.randn(n, d, dtype=torch.float64, generator=g), torch.randn(n, d, dtype=torch.float64, generator=g)
    k = n // dp
    return (x, t), (x[dp_rank * k : (dp_rank + 1) * k], t[dp_rank * k : (dp_rank + 1) * k])


def train(model, opt, steps, dp_rank, dp):
    for step in steps:
        _, (x, t) = batch(step, dp_rank, dp)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), t)  # dp averages the halves' gradients
        loss.backward()
        opt.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temp folder per torchrun run)")
    args = parser.parse_args()
    tplayers.init_mesh(device_type="cpu", timeout=timedelta(minutes=2))
    world = dist.get_world_size()
    dp = 2 if world % 2 == 0 else 1
    mesh = tplayers.init_mesh((dp, world // dp), ("dp", "tp"), device_type="cpu", timeout=timedelta(minutes=2))
    dp_rank, rank = mesh.get_local_rank(0), dist.get_rank()

    # 1. dp x tp MLP, first step against the serial model on the full batch
    torch.manual_seed(0)
    serial = MLP().double()
    model = wrap(tplayers.parallelize_module(copy.deepcopy(serial), PLAN, mesh=mesh["tp"]), args.wrap, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after parallelize_module and wrapping
    train(model, opt, [0], dp_rank, dp)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    (x, t), _ = batch(0, 0, 1)
    nn.functional.mse_loss(serial(x), t).backward()
    serial_opt.step()
    full = gather_state_dict(model)  # serial keys and shapes, whatever the wrapping
    if rank == 0:
        err = max((full[k] - v).abs().max().item() for k, v in serial.state_dict().items())
        print(f"{args.wrap} over dp={dp} x tp={world // dp}: step 0 parity vs serial full batch, max |diff| {err:.1e}")
        assert err < 1e-12

    # 2. checkpoint with optimizer state, resumed in a fresh wrapped model
    # Every rank of one torchrun run names the same folder without communicating (no pickle).
    root = args.dir or os.path.join(
        tempfile.gettempdir(), "tplayers-dp-" + os.environ.get("TORCHELASTIC_RUN_ID", "local")
    )
    path = os.path.join(root, "ckpt")
    save_checkpoint(model, path, optimizer=opt)
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    fresh = wrap(tplayers.parallelize_module(MLP().double(), PLAN, mesh=mesh["tp"]), args.wrap, mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(fresh, path, optimizer=fresh_opt)
    a = train(model, opt, [1, 2], dp_rank, dp)
    b = train(fresh, fresh_opt, [1, 2], dp_rank, dp)
    same = all(
        torch.equal(u, v)
        for u, v in zip(
            gather_state_dict(model, all_ranks=True).values(), gather_state_dict(fresh, all_ranks=True).values()
        )
    )
    if rank == 0:
        print(f"resumed from {path}: loss {b:.6f} vs uninterrupted {a:.6f}, weights bitwise equal: {same}")
        assert same and a == b

    # 3. the same checkpoint in the plain serial model (load_checkpoint is collective: every rank
    #    loads its own full copy here; a single process can do the same without torchrun)
    plain = MLP().double()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    res = load_checkpoint(plain, path, optimizer=plain_opt)
    if rank == 0:
        print(
            f"serial model + AdamW loaded the {world}-rank checkpoint ({res.bytes_read} bytes read); "
            f"AdamW step {plain_opt.state[plain.up.weight]['step'].item():.0f}"
        )

    # 4. dp x domain: a CNN split over the domain axis, DDP over dp
    torch.manual_seed(0)
    cnn = tplayers.parallelize_module(CNN().double(), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh["tp"])
    cnn = DDP(cnn, process_group=mesh["dp"].get_group())
    cnn_opt = torch.optim.SGD(cnn.parameters(), lr=0.1, momentum=0.9)
    field = torch.randn(2 * dp, 2, 16, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mine = tplayers.shard(field[dp_rank * 2 : (dp_rank + 1) * 2], 2, mesh["tp"])  # my samples, my rows
    loss = (
        tplayers.domain_mean((cnn(mine) - mine) ** 2, mesh["tp"])
        if hasattr(tplayers, "domain_mean")
        else ((cnn(mine) - mine) ** 2).mean()
    )
    loss.backward()
    cnn_opt.step()
    save_checkpoint(cnn, os.path.join(root, "cnn"), optimizer=cnn_opt)
    if rank == 0:
        print(f"dp={dp} x domain={world // dp} CNN: DDP step done, checkpoint keys {sorted(CNN().state_dict())}")
    # Leave together, after releasing what holds communication state (DDP's reducer, FSDP's
    # hooks): a rank tearing down while a peer still uses the group can abort that peer.
    del model, fresh, cnn, opt, fresh_opt, cnn_opt
    gc.collect()
    dist.barrier()
    if rank == 0:
        print("done")
    dist.barrier()  # every rank done before any tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
