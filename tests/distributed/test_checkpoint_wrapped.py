"""Checkpoints of wrapped models (DDP, FSDP2 over dp of a (dp, tp) mesh) and optimizer state.

Oracle: the serial model trained on the full batch in fp64 (DDP and FSDP2 average the
gradients of equal dp halves, so one parallel step equals one serial full-batch step).
"""

import json
import os

import pytest
import torch
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tplayers
from tplayers.checkpoint import CheckpointError, gather_state_dict, load_checkpoint, save_checkpoint

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _portable(state):
    """A state dict as nested lists (exact for fp64): tensors returned through the harness queue
    share memory by file descriptor, which can vanish when the rank exits first."""
    return {k: (v.tolist(), str(v.dtype)) for k, v in state.items()}


def _tensors(rows):
    return {k: torch.tensor(v, dtype=getattr(torch, d.removeprefix("torch."))) for k, (v, d) in rows.items()}


class Net(nn.Module):
    """LayerNorm (replicated), Column -> Row MLP with uneven hidden 7, Column head (5 outputs)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(6)
        self.up = nn.Linear(6, 7)
        self.down = nn.Linear(7, 6)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        h = self.ln(x)
        return self.head(h + self.down(torch.tanh(self.up(h))))


PLAN = {
    "up": tplayers.ColumnParallel(),
    "down": tplayers.RowParallel(),
    "head": tplayers.ColumnParallel(gather_output=True),
}


def serial_net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(step, n=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, dtype=torch.float64, generator=g), torch.randn(n, 5, dtype=torch.float64, generator=g)


def loss_fn(y, t):
    return ((y - t) ** 2).mean()


def make_opt(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, betas=(0.8, 0.9), weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_serial(model, opt, steps):
    for s in steps:
        x, t = batch(s)
        opt.zero_grad()
        loss_fn(model(x), t).backward()
        opt.step()


def train_dp(model, opt, steps, dp_rank, dp):
    for s in steps:
        x, t = batch(s)
        n = x.shape[0] // dp  # equal halves: the dp average of the means is the full-batch mean
        opt.zero_grad()
        loss_fn(model(x[dp_rank * n : (dp_rank + 1) * n]), t[dp_rank * n : (dp_rank + 1) * n]).backward()
        opt.step()


def build(kind, mesh2d):
    """The TP model on mesh['tp'], wrapped over mesh['dp'] as `kind` ('ddp' or 'fsdp')."""
    model = tplayers.parallelize_module(serial_net(), PLAN, mesh=mesh2d["tp"])
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model, process_group=mesh2d["dp"].get_group())
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh2d["dp"])
    return model


def _save_wrapped(rank, world, kind, path, opt_kind):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = build(kind, mesh)
    opt = make_opt(opt_kind, model.parameters())
    train_dp(model, opt, [0, 1], mesh.get_local_rank(0), 2)
    save_checkpoint(model, path, optimizer=opt)
    full = gather_state_dict(model)  # unwrapped too: the serial keys
    return _portable(full)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_wrapped_save_loads_serially(tmp_path, kind):
    """dp x tp = 2 x 2, DDP or FSDP2 with AdamW: the checkpoint has exactly the serial keys,
    and a serial model + AdamW loaded from it continue exactly like uninterrupted serial training."""
    path = str(tmp_path / "ckpt")
    full = _tensors(run_ranks(_save_wrapped, 4, args=(kind, path, "adamw"), timeout=120)[0])
    serial = serial_net()
    opt = make_opt("adamw", serial.parameters())
    train_serial(serial, opt, [0, 1])
    with open(os.path.join(path, "index.json")) as f:
        keys = set(json.load(f)["tensors"])
    assert {k for k in keys if not k.startswith("optimizer/")} == set(serial.state_dict())
    assert list(full) == list(serial.state_dict())
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, **TIGHT)
    fresh = serial_net(seed=5)
    fresh_opt = make_opt("adamw", fresh.parameters())
    load_checkpoint(fresh, path, optimizer=fresh_opt)
    for (n, p), q in zip(serial.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, **TIGHT)
        for s in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh_opt.state[q][s], opt.state[p][s], **TIGHT)
    train_serial(serial, opt, [2])
    train_serial(fresh, fresh_opt, [2])
    for p, q in zip(serial.parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, **TIGHT)
    load_checkpoint(serial_net(seed=6), path)  # without optimizer=: the optimizer entries are ignored


def _load_wrapped(rank, world, kind, path, opt_kind):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = build(kind, mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # nothing of the start survives the load
    opt = make_opt(opt_kind, model.parameters())
    load_checkpoint(model, path, optimizer=opt)
    train_dp(model, opt, [2, 3], mesh.get_local_rank(0), 2)
    full = gather_state_dict(model)
    return _portable(full)


@pytest.mark.parametrize("kind,opt_kind", [("ddp", "sgd"), ("fsdp", "adamw")])
def test_serial_save_loads_wrapped(tmp_path, kind, opt_kind):
    """The reverse: a serial checkpoint (model + optimizer after 2 steps) loads into dp x tp and
    two more parallel steps equal four uninterrupted serial steps."""
    path = str(tmp_path / "serial")
    serial = serial_net()
    opt = make_opt(opt_kind, serial.parameters())
    train_serial(serial, opt, [0, 1])
    save_checkpoint(serial, path, optimizer=opt)
    full = _tensors(run_ranks(_load_wrapped, 4, args=(kind, path, opt_kind), timeout=120)[0])
    train_serial(serial, opt, [2, 3])
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, **TIGHT)


def _tp_train(rank, world, path, opt_kind, steps, load):
    model = tplayers.parallelize_module(serial_net(), PLAN)
    opt = make_opt(opt_kind, model.parameters())
    if load:
        load_checkpoint(model, path, optimizer=opt)
    train_serial(model, opt, steps)  # pure TP: every rank sees the full batch
    if not load:
        save_checkpoint(model, path, optimizer=opt)
    return _portable(gather_state_dict(model))


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_optimizer_resume_at_another_world_size(tmp_path, opt_kind):
    """2-rank TP training with AdamW (SGD momentum) saved after 2 steps, resumed at 3 ranks for
    2 more: equals 4 uninterrupted serial steps in fp64."""
    path = str(tmp_path / "tp2")
    run_ranks(_tp_train, 2, args=(path, opt_kind, [0, 1], False), timeout=90)
    full = _tensors(run_ranks(_tp_train, 3, args=(path, opt_kind, [2, 3], True), timeout=90)[0])
    serial = serial_net()
    opt = make_opt(opt_kind, serial.parameters())
    train_serial(serial, opt, [0, 1, 2, 3])
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, **TIGHT)
    # the stored moments are sharded like their weights, not replicated
    with open(os.path.join(path, "index.json")) as f:
        tensors = json.load(f)["tensors"]
    state = "exp_avg" if opt_kind == "adamw" else "momentum_buffer"
    assert tensors[f"optimizer/up.weight/{state}"]["dim"] == 0
    assert tensors[f"optimizer/down.weight/{state}"]["dim"] == 1
    assert tensors["optimizer/ln.weight/" + state]["dim"] is None


def _bad(rank, world, path):
    model = tplayers.parallelize_module(serial_net(), PLAN)
    opt = make_opt("adamw", model.parameters())
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(model, path, optimizer=opt)
    assert len(opt.state) == 0  # nothing installed by a failed load
    with pytest.raises(ValueError, match="sharded form only"):
        save_checkpoint(model, path + ".st", consolidated=True, optimizer=opt)
    with pytest.raises(TypeError, match="optimizer must be"):
        save_checkpoint(model, path + ".x", optimizer="adam")
    stale = make_opt("adamw", serial_net().parameters())  # built before parallelize: not the model's
    with pytest.raises(ValueError, match="not a parameter of the model"):
        save_checkpoint(model, path + ".y", optimizer=stale)
    return True


def test_optimizer_errors(tmp_path):
    path = str(tmp_path / "plain")
    save_checkpoint(serial_net(), path)
    run_ranks(_bad, 2, args=(path,), timeout=60)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 5, 3, padding=1, padding_mode="circular"), nn.Tanh(), nn.Conv2d(5, 3, 3, stride=2, padding=1)
        )

    def forward(self, x):
        return self.net(x)


def _cnn_data(step):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(4, 2, 11, 6, dtype=torch.float64, generator=g), torch.randn(
        4, 3, 6, 3, dtype=torch.float64, generator=g
    )


def _dp_domain(rank, world, kind, path):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "domain"))
    torch.manual_seed(0)
    model = tplayers.parallelize_module(
        CNN().double(), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh["domain"]
    )
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    opt = make_opt("sgd", model.parameters())
    d = mesh.get_local_rank(0)
    for step in range(2):
        x, w = _cnn_data(step)
        x, w = x[2 * d : 2 * d + 2], w[2 * d : 2 * d + 2]  # my half of the batch
        y = model(tplayers.shard(x, 2, mesh["domain"]))
        # the domain's local sums add up to this half's sum; x 2 undoes dp's average of the halves
        loss = (y * tplayers.shard(w, 2, mesh["domain"])).sum() * 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_checkpoint(model, path, optimizer=opt)
    return _portable(gather_state_dict(model))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_dp_x_domain_trains_exactly_and_saves(tmp_path, kind):
    """(dp, domain) = (2, 2): DDP / FSDP2 over dp of a domain-parallel CNN trains like the serial model
    on the full batch (SGD momentum: linear in the gradients, so fp64 round-off stays at 1e-16; AdamW
    would amplify the round-off of gradients that are ~0), and its checkpoint loads serially."""
    path = str(tmp_path / "cnn")
    full = _tensors(run_ranks(_dp_domain, 4, args=(kind, path), timeout=120)[0])
    torch.manual_seed(0)
    serial = CNN().double()
    opt = make_opt("sgd", serial.parameters())
    for step in range(2):
        x, w = _cnn_data(step)
        opt.zero_grad()
        (serial(x) * w).sum().backward()
        opt.step()
    for k, v in serial.state_dict().items():
        torch.testing.assert_close(full[k], v, **TIGHT)
    fresh = CNN().double()
    fresh_opt = make_opt("sgd", fresh.parameters())
    load_checkpoint(fresh, path, optimizer=fresh_opt)
    for p, q in zip(serial.parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, **TIGHT)
        torch.testing.assert_close(fresh_opt.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"], **TIGHT)
