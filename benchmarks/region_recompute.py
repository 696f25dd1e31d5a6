"""Per-block activation checkpointing inside a domain region: peak bytes per rank of a training step.

    torchrun --nproc-per-node 2 benchmarks/region_recompute.py [--size 128 --width 16] [--batch 1] [--frozen]
        [--models vae unet efficientnet convnext]

diffusers' ``UNet2DModel`` and ``AutoencoderKL`` under ``parallelize_module(m, {"": DomainParallel(...)})``
on an H-sharded input, one training step each (forward, ``domain_mean`` MSE loss, backward), with the
package's own ``enable_gradient_checkpointing()`` off and on (``use_reentrant=False``, diffusers'
default; and ``use_reentrant=True`` through its ``gradient_checkpointing_func``). The recomputation in
backward re-enters the region's guard (``tplayers.region.recompute``); the step's gradients with
checkpointing are checked equal to those without it before measuring.

Bytes are those of tensor storages the step allocates (a ``TorchDispatchMode`` that holds them by weak
reference, as tests/memory_probe.py does): ``peak`` is the most alive at once during the step
(activations saved for backward, their gradients, the parameter gradients); ``held`` is what the
forward leaves alive for backward (the activations proper). With ``--frozen`` the parameters do not
require grad (the input does): the step then allocates activations and their gradients only, and
``peak`` is the peak activation bytes. The same model in one process (the
serial model on the whole input, rank 0) is the peer: its own ratio with/without checkpointing is
what the package's switch saves where no domain sharding is involved.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import tplayers
from tplayers.ops.na_cpu import host_isa  # the CPU's vector ISA: avx512 / avx2 / base

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


class Bytes(TorchDispatchMode):
    """Live bytes of the storages allocated under it: the peak, and a snapshot on demand."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                s = t.untyped_storage()
                self.live.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        self.peak = max(self.peak, self.now())
        return out

    def now(self) -> int:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())


TIMM = {"efficientnet": "efficientnet_b0", "convnext": "convnext_atto"}


def build(kind: str, width: int, size: int):
    torch.manual_seed(0)
    if kind in TIMM:
        import timm

        return timm.create_model(TIMM[kind], pretrained=False, num_classes=10)
    import diffusers

    if kind == "unet":
        return diffusers.UNet2DModel(
            sample_size=size,
            in_channels=3,
            out_channels=3,
            layers_per_block=2,
            block_out_channels=(width, 2 * width, 2 * width),
            norm_num_groups=8,
            attention_head_dim=8,
            down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        )
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(width, 2 * width, 2 * width),
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=2,
        sample_size=size,
    )


def _reentrant(module, *args):
    return checkpoint(module.__call__, *args, use_reentrant=True)


def _switch_on(model, mode):
    """The package's own switch: timm's ``set_grad_checkpointing()``, diffusers'
    ``enable_gradient_checkpointing()`` (``use_reentrant=True`` through its checkpointing function)."""
    if hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
    else:
        model.enable_gradient_checkpointing(_reentrant if mode == "reentrant" else None)


def step(model, kind, x, target, mesh):
    """One step under the byte counter: (peak bytes, bytes held after forward, the gradients)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    t = torch.tensor([7] * x.shape[0])
    if mesh is not None:
        dist.barrier()
    with Bytes() as b:
        if kind in TIMM:  # logits: the same on every rank
            y = model(x)
            err = F.mse_loss(y, target, reduction="none")
            loss = err.mean()
        else:
            y = (model(x, t) if kind == "unet" else model(x)).sample
            err = F.mse_loss(y, target, reduction="none")
            loss = tplayers.domain_mean(err, mesh) if mesh is not None else err.mean()
        del y, err
        held = b.now()
        loss.backward()
    return b.peak, held, [x.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--frozen", action="store_true", help="parameters frozen: activation bytes only")
    ap.add_argument("--models", nargs="+", default=["vae", "unet", "efficientnet", "convnext"])
    args = ap.parse_args()
    mesh = tplayers.init_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if rank == 0:
        print(f"# {world} ranks, CPU ISA {host_isa()}, torch {torch.__version__}, fp32")
        print(f"# input (N, C, H, W) = ({args.batch}, 3, {args.size}, {args.size}), H sharded; base width {args.width}")
        print(
            "# parameters frozen: the step allocates activations and their gradients only"
            if args.frozen
            else "# a full training step: parameter gradients included"
        )
    for kind in args.models:
        serial = build(kind, args.width, args.size)
        serial.requires_grad_(not args.frozen)
        torch.manual_seed(1)
        full = torch.randn(args.batch, 3, args.size, args.size)
        target = torch.randn(args.batch, 10) if kind in TIMM else torch.randn_like(full)
        x, tgt = tplayers.shard(full, 2, mesh), target if kind in TIMM else tplayers.shard(target, 2, mesh)
        modes = ("off", "non-reentrant") if kind in TIMM else ("off", "non-reentrant", "reentrant")
        rows = {}
        for mode in modes:
            par = tplayers.parallelize_module(
                copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
            )
            if mode != "off":
                _switch_on(par, mode)
            step(par, kind, x, tgt, mesh)  # warm-up: the first call of a partition agrees on its decisions
            rows[mode] = step(par, kind, x, tgt, mesh)
        for mode in modes[1:]:  # exact: the same gradients with checkpointing
            for g, r in zip(rows[mode][2], rows["off"][2]):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        ser = {}
        if rank == 0:
            for mode in modes:
                m = copy.deepcopy(serial)
                if mode != "off":
                    _switch_on(m, mode)
                ser[mode] = step(m, kind, full, target, None)
        dist.barrier()
        peaks = torch.tensor([[r[0], r[1]] for r in rows.values()], dtype=torch.float64)
        every = [torch.zeros_like(peaks) for _ in range(world)]
        dist.all_gather(every, peaks)
        if rank == 0:
            worst = torch.stack(every).amax(0)  # per mode, the largest rank's bytes
            print(f"\n{kind}: peak / held-after-forward MiB per rank (the largest rank's)")
            for i, mode in enumerate(rows):
                pk, hd = worst[i].tolist()
                print(
                    f"  {world} ranks, checkpointing {mode:14s} peak {pk / 2**20:8.2f}  held {hd / 2**20:8.2f}"
                    f"  ({pk / worst[0, 0].item():.2f}x / {hd / worst[0, 1].item():.2f}x of off)"
                )
            for mode, r in ser.items():
                print(
                    f"  1 process, checkpointing {mode:14s} peak {r[0] / 2**20:8.2f}  held {r[1] / 2**20:8.2f}"
                    f"  ({r[0] / ser['off'][0]:.2f}x / {r[1] / ser['off'][1]:.2f}x of off)"
                )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
