"""Peak memory per rank of a domain-parallel training step against one process (issue 31 item 5).

    python benchmarks/domain_memory.py [--size 256 --width 32] [--models unet,vae,vit,swinunetr]
                                       [--meshes 1,2,4,2x2] [--top 8] [--swin-size 64 --swin-window 4]

Each model (diffusers ``UNet2DModel`` and ``AutoencoderKL``, transformers ``ViTForImageClassification``
with SDPA attention and ``interpolate_pos_encoding=True``, MONAI ``SwinUNETR``) takes Adam training
steps (forward, loss, backward, ``optimizer.step()``), fp32, batch 1: first in this process without
tplayers (the peer, "1p"), then under ``parallelize_module(model, {"": DomainParallel(shard_dims=...)})``
on gloo ranks forked from this process: H sharded over 2 and 4 ranks, H and W over 2x2, and on one
rank ("1": tplayers' own single-rank cost, a second peer, "1r"). A first step warms up (Adam's state,
a partition's first call agrees on its decisions, buffers kept between steps); the second is
measured, its loss checked equal to the one process's. The U-Net and VAE losses are
``tplayers.domain_mean`` of the per-pixel MSE (a global mean); the ViT's is the cross-entropy of its
replicated logits. A model refused on some mesh is reported with the refusal's first line.

Bytes are those of the tensor storages allocated since before the first step, held by weak reference
in a ``TorchDispatchMode`` (as tests/memory_probe.py; CPU has no ``max_memory_allocated``): buffers
of the halo exchanges and collectives count, and so do buffers a layer keeps from one step to the
next; allocations outside ATen (gloo's own, Python's) do not. Parameters exist before and are
added separately.

- **act**: the most bytes alive at once during the second step's forward and backward, less the
  parameter gradients (a storage counts as one from its allocation when it ends up some
  ``p.grad``: a gradient bucket's flat buffer, a stolen weight gradient) and Adam's moments:
  activations saved for backward, their gradients, exchange buffers, kept buffers. This is what
  sharding divides.
- **state**: parameters + their gradients + Adam's two moments: replicated, the same on every rank.
- **total**: parameters + the second step's peak of everything (Adam's moments, gradients, the
  optimizer's temporaries included).
- **held**: bytes alive after the step besides parameters, gradients and moments (kept for the next).
- **bound**: ``1/N + halo``, per rank, from the tensors alive at the one process's act peak: each
  tensor with a sharded extent (an image of ``h`` rows at one of the model's resolutions, or tokens
  of such a grid) counts with the share the largest rank holds, its rows plus one halo row per
  neighbour (3x3 convolutions: one row each side at every resolution), its columns too on a 2x2
  mesh; tokens count without a halo (the ViT's patch convolution does not overlap, its attention
  passes key blocks round a ring) but with the CLS token; every other tensor (time embeddings,
  norms' statistics) counts whole. The goal (issue 31) is ``act / act(1p) <= 1.1 * bound``.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from region_recompute import build as build_diffusers  # benchmarks/: on sys.path when run as a script
from torch.distributed.device_mesh import DeviceMesh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tplayers
from tplayers.ops.na_cpu import host_isa  # the CPU's vector ISA: avx512 / avx2 / base

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
MIB = 2.0**20


class Probe(TorchDispatchMode):
    """A log of the storages allocated under it: bytes, shape, the op, when each was made and freed."""

    def __init__(self):
        super().__init__()
        self.live, self.log, self.totals, self.total = {}, [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        t = len(self.totals)
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:  # before adding: ids are reused
            entry = self.log[self.live.pop(key)[1]]
            entry[4] = t
            self.total -= entry[0]
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for a in tree_flatten(out)[0]:
            if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in inputs:
                s = a.untyped_storage()
                if s._cdata not in self.live:
                    self.live[s._cdata] = (StorageWeakRef(s), len(self.log))
                    self.log.append([s.nbytes(), tuple(a.shape), str(func), t, None, s._cdata])
                    self.total += s.nbytes()
        self.totals.append(self.total)
        return out

    def excluded(self, storages: set) -> list:
        """The log entries alive now whose storage is in ``storages``."""
        return [self.log[i] for key, (_, i) in self.live.items() if key in storages]

    def activations(self, skip: list, start: int):
        """(peak, tensors alive then) from op ``start`` on, less the ``skip`` entries over their lifetime."""
        less = [0] * (len(self.totals) + 1)
        for e in skip:
            less[e[3]] += e[0]
            if e[4] is not None:
                less[e[4]] -= e[0]
        run, best, when = 0, -1, start
        for t, total in enumerate(self.totals):
            run += less[t]
            if t >= start and total - run > best:
                best, when = total - run, t
        ids = {id(e) for e in skip}
        alive = [
            (e[0], e[1], e[2]) for e in self.log if id(e) not in ids and e[3] <= when and (e[4] is None or e[4] > when)
        ]
        return best, alive


# ---------------------------------------------------------------------------------------------- models


def build(kind: str, args):
    """(model, forward call, resolutions of its sharded extents (rows, cols), halo rows per side)."""
    torch.manual_seed(0)
    s, w = args.size, args.width
    if kind in ("unet", "vae"):  # region_recompute.py's models
        call = (lambda m, x: m(x, torch.tensor([7])).sample) if kind == "unet" else (lambda m, x: m(x).sample)
        return build_diffusers(kind, w, s), call, [s, s // 2, s // 4], 1
    if kind == "vit":
        import transformers

        cfg = transformers.ViTConfig(
            image_size=args.vit_size,
            patch_size=args.patch,
            num_channels=3,
            hidden_size=192,
            num_hidden_layers=4,
            num_attention_heads=3,
            intermediate_size=768,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=10,
        )
        cfg._attn_implementation = "sdpa"
        m = transformers.ViTForImageClassification(cfg)
        return m, lambda m, x: m(x, interpolate_pos_encoding=True).logits, [args.vit_size // args.patch], 0
    if kind == "swinunetr":
        from monai.networks.nets import SwinUNETR

        # depths (1, 1, 1, 1): no shifted windows (MONAI builds the shift mask from int(np.ceil(h / ws)), a local
        # number: refused on every rank; docs/region-guard.md). Training runs MONAI's einsum-free eager window
        # attention (its SDPA path is for inference only): a window covering a whole sharded dim (the deepest
        # stage) has its keys and values gathered (tplayers/region/rules_linalg.py)
        m = SwinUNETR(
            in_channels=1,
            out_channels=2,
            feature_size=12,
            spatial_dims=3,
            depths=(1, 1, 1, 1),
            window_size=args.swin_window,
            use_flash_attention=True,
        )
        return m, lambda m, x: m(x), [args.swin_size >> k for k in range(6)], 1
    raise ValueError(f"model: expected unet, vae, vit or swinunetr, got {kind!r}")


def data(kind: str, args):
    """(input, target) of the whole domain, the same in every process."""
    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        x = torch.randn(1, 3, args.vit_size, args.vit_size, generator=g)
        return x, torch.tensor([3])
    if kind == "swinunetr":
        v = args.swin_size
        return torch.randn(1, 1, v, v, v, generator=g), torch.randn(1, 2, v, v, v, generator=g)
    return torch.randn(1, 3, args.size, args.size, generator=g), torch.randn(1, 3, args.size, args.size, generator=g)


def loss_of(kind, out, target, mesh):
    if kind == "vit":
        return F.cross_entropy(out, target)
    err = F.mse_loss(out, target, reduction="none")
    return err.mean() if mesh is None else tplayers.domain_mean(err, mesh)


def train_step(model, opt, call, kind, x, target, mesh):
    model.zero_grad(set_to_none=True)
    if mesh is not None:
        dist.barrier()
    loss = loss_of(kind, call(model, x), target, mesh)
    loss.backward()
    return loss


def run(model, call, kind, x, target, mesh):
    """Two Adam steps under one probe (the first warms up: Adam's state, a partition's decisions, buffers
    kept between steps); the figures of the second. Parameters exist before the probe; everything else
    the model, the optimizer and tplayers allocate, and still hold during the second step, counts."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with Probe() as probe:
        first = train_step(model, opt, call, kind, x, target, mesh).item()
        opt.step()
        start = len(probe.totals)
        loss = train_step(model, opt, call, kind, x, target, mesh).item()
        grads = {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
        moments = {t.untyped_storage()._cdata for st in opt.state.values() for t in st.values() if t.dim() > 0}
        skip_ids = grads | moments
        skip = probe.excluded(skip_ids)
        act, at_peak = probe.activations(skip, start)
        opt.step()
        peak = max(probe.totals[start:])
        held = sum(probe.log[i][0] for k, (ref, i) in probe.live.items() if not ref.expired() and k not in skip_ids)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    return dict(loss=(first, loss), act=act, peak=peak, held=held, params=params, moments=moments, at_peak=at_peak)


# ------------------------------------------------------------------------------------------- the bound


def share(shape, levels, halo, mesh_shape, spatial_dims):
    """The largest rank's fraction of a tensor of this shape, or None when no extent of it is sharded."""
    n = len(mesh_shape)
    for h in levels:  # an image (N, C, *spatial) at resolution h
        if len(shape) == 2 + spatial_dims and all(d == h for d in shape[2:]):
            f = 1.0
            for parts in mesh_shape:  # H (then W) sharded: rows of the largest rank + halo
                f *= min(1.0, (math.ceil(h / parts) + halo * min(parts - 1, 2)) / h)
            return f
    for h in levels:  # tokens of an h x h grid (a prefix token or not), flattened pixels
        for d in shape:
            if d in (h**spatial_dims, h**spatial_dims + 1) and h >= 8:
                rows = math.ceil(h / mesh_shape[0])  # no halo: attention passes key blocks round a ring
                cols = h if n == 1 else math.ceil(h / mesh_shape[1])
                return min(1.0, (rows * cols * h ** (spatial_dims - 2) + d - h**spatial_dims) / d)
    return None


def bound(at_peak, levels, halo, mesh_shape, spatial_dims):
    """(bound as a fraction of the 1-process act peak, the fraction of its bytes with no sharded extent)."""
    total = sum(b for b, _, _ in at_peak)
    shares = [(b, share(s, levels, halo, mesh_shape, spatial_dims)) for b, s, _ in at_peak]
    kept = sum(b * (1.0 if f is None else f) for b, f in shares)
    return kept / total, sum(b for b, f in shares if f is None) / total


# ---------------------------------------------------------------------------------------------- ranks


def rank_main(rank, world, mesh_shape, kind, args, init_file, queue):
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=5)
        )
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
        model, call, levels, _ = build(kind, args)
        dims = tuple(range(2, 2 + len(mesh_shape)))
        model = tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh)
        x, target = data(kind, args)
        x = tplayers.shard(x, dims, mesh)
        if kind != "vit":
            target = tplayers.shard(target, dims, mesh)
        out = run(model, call, kind, x, target, mesh)
        flat = sum(b for b, shape, _ in out["at_peak"] if len(shape) == 1)
        out["at_peak"] = (sorted(out["at_peak"], reverse=True)[: args.top], len(out["at_peak"]), flat)
        queue.put((rank, "ok", out))
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints it
        msg = str(e).splitlines()[0] if isinstance(e, ValueError) else traceback.format_exc()
        queue.put((rank, "refused" if isinstance(e, ValueError) else "error", msg))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def on_ranks(mesh_shape, kind, args):
    world = math.prod(mesh_shape)
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=rank_main, args=(r, world, mesh_shape, kind, args, os.path.join(tmp, "rdv"), queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = dict((r, (st, out)) for r, st, out in (queue.get(timeout=args.timeout) for _ in range(world)))
        for p in procs:
            p.join(timeout=30)
    return [got[r] for r in range(world)]


# ----------------------------------------------------------------------------------------------- main


def show_top(tensors, levels=(), spatial_dims=2):
    """The tensors, marking those of full size along a sharded H (images with H = W, whole token grids)."""
    for b, shape, op in tensors:
        image = len(shape) == 2 + spatial_dims and len(set(shape[2:])) == 1 and shape[2] in levels
        tokens = any(d in (h**spatial_dims, h**spatial_dims + 1) for h in levels if h >= 8 for d in shape)
        whole = image or tokens
        print(f"      {b / MIB:8.2f} MiB {str(list(shape)):28s} {op}{'  <- full size' if whole else ''}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="unet,vae,vit")  # swinunetr: its own run (RESULTS.md), minutes on 2 cores
    ap.add_argument("--meshes", default="1,2,4,2x2", help="1: tplayers on one rank (a second peer)")
    ap.add_argument("--size", type=int, default=256, help="U-Net / VAE image side")
    ap.add_argument("--width", type=int, default=32, help="U-Net / VAE base width")
    ap.add_argument("--vit-size", type=int, default=384)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--swin-size", type=int, default=64)
    ap.add_argument("--swin-window", type=int, default=4, help="SwinUNETR window (MONAI's default 7 cuts 8-row stages)")
    ap.add_argument("--top", type=int, default=6, help="largest tensors alive at the act peak to list")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# CPU ISA {host_isa()}, torch {torch.__version__}, fp32, batch 1, Adam, gloo ranks (one thread each)")
    print(
        "# act: peak of forward + backward, parameter gradients and Adam moments excluded; state: params + grads"
        " + Adam moments (replicated); total: the step's peak of everything; held: kept between steps besides state"
    )
    for kind in args.models.split(","):
        runs = {}
        for spec in args.meshes.split(","):
            shape = tuple(int(p) for p in spec.split("x"))
            runs[spec] = on_ranks(shape, kind, args)
            bad = [(st, out) for st, out in runs[spec] if st != "ok"]
            if bad:
                print(f"\n{kind} on {spec}: {bad[0][0]} on {len(bad)} of {len(runs[spec])} ranks: {bad[0][1]}")
        runs = {k: [out for _, out in r] for k, r in runs.items() if all(st == "ok" for st, _ in r)}
        if not runs:
            continue
        model, call, levels, halo = build(kind, args)
        x, target = data(kind, args)
        ser = run(model, call, kind, x, target, None)
        sd = x.dim() - 2
        params = ser["params"]
        state = 2 * params + ser["moments"]
        ser_total = params + ser["peak"]
        one = runs.get("1", [None])[0]
        print(f"\n{kind}: input {list(x.shape)}, {params / 4 / 1e6:.2f} M parameters; state {state / MIB:.2f} MiB")
        print(
            f"  1 process: act {ser['act'] / MIB:8.2f} MiB  total {ser_total / MIB:8.2f} MiB"
            f"  held {ser['held'] / MIB:6.2f} MiB  (loss {ser['loss'][1]:.6f})"
        )
        print("  mesh rank |  act MiB  act/1p   1/N  bound  goal meets act/1r | total MiB total/1p held MiB | loss")
        worst = {}
        for spec, ranks in runs.items():
            shape = tuple(int(p) for p in spec.split("x"))
            b, whole = bound(ser["at_peak"], levels, halo, shape, sd)
            for r, out in enumerate(ranks):
                ratio = out["act"] / ser["act"]
                total = out["params"] + out["peak"]
                meets = ratio <= 1.1 * b
                vs_one = f"{out['act'] / one['act']:6.3f}" if one else "     -"
                print(
                    f"  {spec:4s} {r:4d} | {out['act'] / MIB:8.2f} {ratio:7.3f} {1 / math.prod(shape):5.3f}"
                    f" {b:6.3f} {1.1 * b:5.3f}  {'yes' if meets else 'NO ':3s} {vs_one} |"
                    f" {total / MIB:9.2f} {total / ser_total:8.3f} {out['held'] / MIB:8.2f} | {out['loss'][1]:.6f}"
                )
                torch.testing.assert_close(out["loss"][1], ser["loss"][1], rtol=2e-4, atol=1e-6)
                if spec not in worst or ratio > worst[spec][0]:
                    worst[spec] = (ratio, r, out["at_peak"], shape)
            print(
                f"       (bound: {whole:.0%} of the 1-process act peak's bytes have no sharded extent, counted whole)"
            )
        print(f"  1 process, largest tensors alive at its act peak ({len(ser['at_peak'])} in all):")
        show_top(sorted(ser["at_peak"], reverse=True)[: args.top])
        for spec, (ratio, r, (top, count, flat), shape) in worst.items():
            print(
                f"  {spec} rank {r} (the largest act), largest tensors alive at its act peak ({count} in all;"
                f" flat 1-D buffers, exchanges' and the attention ring's, {flat / MIB:.2f} MiB):"
            )
            show_top(top, levels if len(shape) == 1 and shape[0] > 1 else (), sd)


if __name__ == "__main__":
    main()
