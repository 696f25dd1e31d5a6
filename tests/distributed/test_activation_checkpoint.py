"""Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) around a
DistributedConv2d block: exact, each convolution runs at most twice per step (as nn.Conv2d's
do), and the tensors held between forward and backward are no more than nn.Conv2d's.

Held tensors are measured two ways: storages allocated during the forward and still alive
when it returns (a TorchDispatchMode with weak storage references: sees everything,
including anything kept on ``ctx`` outside ``save_for_backward``), and the tensors autograd
packs through ``torch.autograd.graph.saved_tensors_hooks``.
"""

import copy
import time

import torch
from harness import run_ranks
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import tplayers


class _Tracker(TorchDispatchMode):
    """Counts convolution output elements and tracks storages created by ops, weakly."""

    def __init__(self):
        super().__init__()
        self.convs = 0
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.convolution.default:
            # output elements convolved: a layer taking the main-plus-strips strategy adds thin strip
            # convolutions to its main one, so calls alone would overcount it
            self.convs += out.numel()
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                s = t.untyped_storage()
                self.storages.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def held(self, exclude):
        """Storages created during the forward and alive now. A gloo worker thread drops its collective's
        buffers (e.g. a norm's statistics gather) a moment after the collective returns, on a busy
        machine milliseconds later; what the model holds stays until backward. So: the fewest alive
        over 100 ms."""
        best = None
        for _ in range(10):
            alive = {k: n for k, (ref, n) in self.storages.items() if not ref.expired() and k not in exclude}
            now = (len(alive), sum(alive.values()))
            best = now if best is None or now < best else best
            time.sleep(0.01)
        return best


def _block(in_c=3):
    return nn.Sequential(
        nn.Conv2d(in_c, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular"),
        nn.Tanh(),
        nn.Conv2d(8, 4, 3, stride=1, padding=2, dilation=2),
    )


def _measure(model, x, ckpt):
    """(conv output elements per step, held storages (count, bytes), packed tensors, output, input grad, param grads)."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t

    tracker = _Tracker()
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
    held = tracker.held({y.untyped_storage()._cdata})
    with tracker:
        y.backward(torch.ones_like(y))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return tracker.convs, held, len(packed), y.detach(), x.grad, grads


def _case(rank, world):
    torch.manual_seed(0)
    serial = _block().double()
    mesh = tplayers.default_mesh()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    x = torch.randn(2, 3, 4 * world + 3, 7, dtype=torch.float64)
    local = tplayers.shard(x, 2, mesh)
    ref_local = copy.deepcopy(serial)  # nn.Conv2d block on a tensor of this rank's local size
    report = {}
    for ckpt in (False, True):
        par(local)  # warm the layout cache (its one small exchange is not per step)
        report[("par", ckpt)] = _measure(par, local, ckpt)
        report[("nn", ckpt)] = _measure(ref_local, local, ckpt)
    # exact with and without checkpointing
    plain, ck = report[("par", False)], report[("par", True)]
    assert torch.equal(plain[3], ck[3]) and torch.equal(plain[4], ck[4])
    assert all(torch.equal(plain[5][k], ck[5][k]) for k in plain[5])
    y_serial = serial(x)
    torch.testing.assert_close(ck[3], tplayers.shard(y_serial, 2, mesh), rtol=1e-12, atol=1e-12)
    summary = {f"{who}{'+ckpt' if c else ''}": (v[0], v[1], v[2]) for (who, c), v in report.items()}
    n_par, n_nn = report[("par", True)], report[("nn", True)]
    # convolution output elements per step: each layer at most twice (forward + recompute), and no
    # more than nn.Conv2d's (whose region's last conv is not recomputed: non-reentrant checkpointing
    # stops once every saved tensor is back, and ours are saved before the conv runs too)
    assert n_par[0] <= 2 * report[("par", False)][0] and n_par[0] <= n_nn[0], summary
    assert report[("par", False)][0] == report[("nn", False)][0], summary  # one pass: the same outputs
    assert n_par[1][0] <= n_nn[1][0], summary  # storages held from forward to backward
    assert n_par[1][1] <= n_nn[1][1], summary  # and their bytes
    assert n_par[2] <= n_nn[2], summary  # tensors packed by saved-tensor hooks
    # without checkpointing: no more saved tensors than nn.Conv2d (the halo-padded input is saved
    # instead of the input, a few rows larger)
    assert report[("par", False)][2] <= report[("nn", False)][2], summary
    return summary


def test_checkpointed_conv_block_2_ranks():
    summary = run_ranks(_case, 2, timeout=90)
    print("conv output elements, (held storages, bytes), packed:", summary[0])


def test_checkpointed_conv_block_3_ranks():
    run_ranks(_case, 3, timeout=90)


def _window_ops(rank, world):
    """Every other window op and a norm in one checkpointed region: convolutions run no more often,
    and nothing more is held, than in the nn model's region."""
    torch.manual_seed(0)
    serial = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.MaxPool2d(3, 2, 1),
        nn.GroupNorm(2, 4),
        nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.AvgPool2d(2),
        nn.ConvTranspose2d(4, 3, 2, stride=2),
        nn.BatchNorm2d(3),
        nn.Conv2d(3, 2, 3, padding=1),
    ).double()
    mesh = tplayers.default_mesh()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh)
    local = tplayers.shard(torch.randn(2, 2, 8 * world, 6, dtype=torch.float64), 2, mesh)
    par(local)  # the layout cache
    plain, ck = _measure(par, local, False), _measure(par, local, True)
    ref = _measure(copy.deepcopy(serial), local, True)
    assert torch.equal(plain[3], ck[3]) and torch.equal(plain[4], ck[4])
    assert all(torch.equal(plain[5][k], ck[5][k]) for k in plain[5])
    assert ck[0] <= ref[0] and ck[1] <= ref[1] and ck[2] <= ref[2], (ck[:3], ref[:3])
    return ck[:3], ref[:3]


def test_checkpointed_window_ops_and_norms():
    print("tplayers vs nn (conv output elements, held, packed):", run_ranks(_window_ops, 2, timeout=90)[0])
