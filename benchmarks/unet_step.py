"""U-Net training step: tplayers on 2 ranks vs PhysicsNeMo ShardTensor on 2 ranks vs one process.

    torchrun --nproc-per-node 2 benchmarks/unet_step.py [--size 128 --width 16] [--repeats 5]

ShardTensor comes from ``nvidia-physicsnemo`` 2.2.2, installed without its dependencies (they
would replace torch) plus the modules it imports::

    pip install -c constraints.txt --no-deps nvidia-physicsnemo==2.2.2 warp-lang treelib termcolor tensordict
    pip install -c constraints.txt requests tqdm s3fs cloudpickle pyvers six   # none of these pulls torch

The U-Net stays inside the subset ShardTensor shards: Conv2d (3x3, padding 1; 1x1), GroupNorm, SiLU,
MaxPool2d(2) (stride == kernel), nearest Upsample(x2), channel concatenation of the skips. It is
examples/unet.py's U-Net (channels width / 2 width) without the time embedding, the ConvTranspose
and the bilinear upsample. One training step (forward, global MSE loss, backward, Adam) for:

(a) tplayers: ``parallelize_module(serial, {"": DomainParallel(shard_dims=(2,))})`` on an
    H-sharded input, loss ``tplayers.domain_mean``;
(b) ShardTensor: a copy of the serial model (plain nn layers, replicated parameters) applied to a
    ShardTensor sharded along H (``Shard(2)``, ``sharding_shapes="chunk"``), loss
    ``(out - target).pow(2).mean()`` on ShardTensors. Its conv and GroupNorm handlers all-reduce
    the parameter gradients themselves (one all-reduce per conv weight and per bias, one per norm)
    inside backward, so the step needs no extra gradient sum: that cost is inside its time;
(c) the serial model in one process (rank 0, while rank 1 waits at a barrier).

Before timing, outputs and parameter gradients of (a) and (b) are checked against (c). Every
process uses one thread; timings are interleaved (a, b, c, repeated) and reported as medians.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers
from tplayers.ops.na_cpu import host_isa  # the CPU's vector ISA: avx512 / avx2 / base


def load_shardtensor():
    """(ShardTensor, Shard, version), or (None, reason) when it cannot run here."""
    try:
        import physicsnemo
        from physicsnemo.domain_parallel import ShardTensor

        # physicsnemo registers its handlers only when CUDA is available: import the ones this
        # U-Net needs (each module registers its handlers at import time)
        from physicsnemo.domain_parallel.custom_ops import _reductions  # noqa: F401  mean / sum
        from physicsnemo.domain_parallel.shard_utils import (  # noqa: F401
            conv_patches,  # F.conv2d (halo exchange, weight/bias gradient all-reduce)
            normalization_patches,  # F.group_norm
            pooling_patches,  # F.max_pool2d (stride == kernel)
            unpooling_patches,  # F.interpolate
        )
        from torch.distributed.tensor.placement_types import Shard
    except Exception as err:  # noqa: BLE001 - report any import failure as the blocker
        return None, f"{type(err).__name__}: {err}"
    return (ShardTensor, Shard, physicsnemo.__version__), None


class Block(nn.Module):
    """conv 3x3 -> GroupNorm -> SiLU -> conv 3x3 -> GroupNorm -> SiLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.GroupNorm(4, cout),
            nn.SiLU(),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.GroupNorm(4, cout),
            nn.SiLU(),
        )

    def forward(self, x):
        return self.body(x)


class UNet(nn.Module):
    """Two levels down (MaxPool 2), up by nearest Upsample x2, skips concatenated, 1x1 head."""

    def __init__(self, cin: int = 1, cout: int = 1, width: int = 16):
        super().__init__()
        w1, w2 = width, 2 * width
        self.enc1, self.enc2, self.mid = Block(cin, w1), Block(w1, w2), Block(w2, w2)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec2 = Block(2 * w2, w2)
        self.red1, self.dec1 = nn.Conv2d(w2, w1, 1), Block(2 * w1, w1)
        self.head = nn.Conv2d(w1, cout, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        m = self.mid(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up(m), e2], 1))
        d1 = self.dec1(torch.cat([self.red1(self.up(d2)), e1], 1))
        return self.head(d1)


def _time(fn, iters: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _grad_err(model: nn.Module, serial: nn.Module) -> float:
    """Largest |grad - serial grad| over the parameters (same names, both models fully replicated)."""
    ref = dict(serial.named_parameters())
    err = 0.0
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = max(err, (g - ref[name].grad).abs().max().item())
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128, help="global H = W (divisible by 4 * ranks)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first level (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (medians reported)")
    parser.add_argument("--iters", type=int, default=3, help="steps per timed repeat (after one warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*all_gather_tensor.*is deprecated")  # physicsnemo's full_tensor
    mesh = tplayers.init_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.size % (4 * world):
        raise SystemExit(f"--size must be divisible by 4 * ranks = {4 * world} (two 2x2 poolings per shard)")
    st, why = load_shardtensor()

    torch.manual_seed(0)  # the same model and data on every rank
    serial = UNet(width=args.width)
    x, tgt = torch.randn(args.batch, 1, args.size, args.size), torch.randn(args.batch, 1, args.size, args.size)

    # (a) tplayers
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    # each rank's own contiguous slab (as when it loads its part), as ShardTensor gets below
    xl, tl = tplayers.shard(x, 2, mesh).contiguous(), tplayers.shard(tgt, 2, mesh).contiguous()

    def loss_tpl():
        return tplayers.domain_mean(F.mse_loss(model(xl), tl, reduction="none"), mesh)

    # (b) ShardTensor
    if st is not None:
        ShardTensor, Shard, st_version = st
        st_model = copy.deepcopy(serial)
        xs = ShardTensor.from_local(
            x.chunk(world, 2)[rank].contiguous(), mesh, [Shard(2)], sharding_shapes="chunk", global_shape=x.shape
        )
        ts = ShardTensor.from_local(
            tgt.chunk(world, 2)[rank].contiguous(), mesh, [Shard(2)], sharding_shapes="chunk", global_shape=tgt.shape
        )

        def loss_st():
            return (st_model(xs) - ts).pow(2).mean()

    # correctness: outputs, losses and parameter gradients against the serial model
    ref = serial(x)
    ref_loss = F.mse_loss(ref, tgt)
    ref_loss.backward()
    out = model(xl)
    out_err = (out - ref.chunk(world, 2)[rank]).abs().max()
    dist.all_reduce(out_err, op=dist.ReduceOp.MAX)
    loss = loss_tpl()
    loss.backward()
    checks = [("tplayers", out_err.item(), (loss - ref_loss).abs().item(), _grad_err(model, serial))]
    torch.testing.assert_close(out, ref.chunk(world, 2)[rank], rtol=1e-4, atol=1e-4)
    if st is not None:
        st_out = st_model(xs)
        full = st_out.full_tensor()
        torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)
        sl = loss_st()
        sl.backward()
        grad_kind = type(next(st_model.parameters()).grad).__name__
        sl_val = sl.full_tensor() if hasattr(sl, "full_tensor") else sl
        checks.append(
            (
                "ShardTensor",
                (full - ref).abs().max().item(),
                (sl_val - ref_loss).abs().item(),
                _grad_err(st_model, serial),
            )
        )
    for name, _, _, gerr in checks:
        if gerr > 1e-4:
            raise SystemExit(f"{name}: parameter gradients differ from the serial model's by {gerr:.2e}")

    # one training step each
    opt_t = torch.optim.Adam(model.parameters())
    opt_s = torch.optim.Adam(serial.parameters())

    def step_tpl():
        opt_t.zero_grad()
        loss_tpl().backward()
        opt_t.step()
        dist.barrier()

    if st is not None:
        opt_st = torch.optim.Adam(st_model.parameters())

        def step_st():
            opt_st.zero_grad()
            loss_st().backward()
            opt_st.step()
            dist.barrier()

    def step_serial():
        opt_s.zero_grad()
        F.mse_loss(serial(x), tgt).backward()
        opt_s.step()

    times = {"tpl": [], "st": [], "serial": []}
    for _ in range(args.repeats):
        dist.barrier()
        times["tpl"].append(_time(step_tpl, args.iters))
        if st is not None:
            dist.barrier()
            times["st"].append(_time(step_st, args.iters))
        dist.barrier()
        if rank == 0:
            times["serial"].append(_time(step_serial, args.iters))
        dist.barrier()

    if rank == 0:
        med = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in times.items()}
        print(
            f"torch {torch.__version__}, physicsnemo {st[2] if st else 'unavailable'}, CPU {host_isa()}, "
            f"{world} ranks (gloo, 1 thread each) vs 1 process (1 thread)"
        )
        if st is None:
            print(f"ShardTensor unavailable: {why}")
        print(
            f"U-Net train step: batch {args.batch}, 1x{args.size}x{args.size}, width {args.width} "
            f"(channels {args.width}/{2 * args.width}), {sum(p.numel() for p in serial.parameters())} "
            f"parameters; medians of {args.repeats} interleaved repeats of {args.iters} steps"
        )
        print("correctness vs serial: max |output err|, |loss err|, max |param grad err|")
        for name, o, lo, g in checks:
            print(f"  {name:12s} {o:.2e}  {lo:.2e}  {g:.2e}")
        if st is not None:
            print(
                f"  ShardTensor parameter gradients come back as {grad_kind}, already summed over ranks "
                "(its conv/GroupNorm backward all-reduces them; no extra all-reduce in its step)"
            )
        print(f"{'contender':28s} {'ms/step':>9s} {'speed-up vs 1 proc':>19s}")
        rows = [("tplayers, 2 ranks", med["tpl"])]
        if st is not None:
            rows.append(("ShardTensor, 2 ranks", med["st"]))
        rows.append(("serial, 1 process", med["serial"]))
        for name, ms in rows:
            print(f"{name:28s} {ms:9.2f} {med['serial'] / ms:18.2f}x")
        if st is not None:
            print(
                f"tplayers / ShardTensor time: {med['tpl'] / med['st']:.2f} "
                f"(ShardTensor / tplayers: {med['st'] / med['tpl']:.2f}x)"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
