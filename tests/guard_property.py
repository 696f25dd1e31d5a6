"""Random small models that hunt silent paths in the domain-region guard (issue 33 item 6).

Each graph is a model of random steps (convolutions, transposed convolutions, norms, pools, module and
functional interpolation, spatial reductions, per-pixel linears on flattened pixels, full attention over
pixels, residuals, skip concatenations, ops no rule proves exact) under a random plan (the root, a
container, leaves, a mixture, a type key), called through ``forward`` or through another method, on a
random uneven partition of a 1-D or 2-D mesh. Against the serial model in fp64 every graph must be
**exact** (output, input gradient, every parameter gradient) or **refused** (a ``ValueError`` on every
rank). Anything else is counted: **silent** (a different result, no error), **crash** (another
exception), **split** (ranks disagree on the outcome).

``run_graphs(rank, world, seed, count, mesh_shape)`` runs ``count`` graphs on every rank (same seeds on
every rank) and returns the counts; ``tests/distributed/test_guard_property.py`` runs a bounded number
in CI, ``benchmarks/guard_property.py`` the long run.
"""

from __future__ import annotations

import copy
import os
import random
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tplayers

C = 4
TOL = dict(rtol=1e-8, atol=1e-10)


class Step(nn.Module):
    """One step of a graph; ``kind`` says what its forward does (module or functional form)."""

    def __init__(self, kind: str, rng: random.Random):
        super().__init__()
        self.kind = kind
        self.mode = rng.choice(["nearest", "bilinear"])
        if kind in ("conv3", "conv1", "conv_s2", "residual", "skip"):
            k, s = {"conv3": (3, 1), "conv1": (1, 1), "conv_s2": (3, 2), "residual": (3, 1), "skip": (3, 1)}[kind]
            self.conv = nn.Conv2d(C, C, k, s, k // 2)
        if kind == "skip":
            self.mix = nn.Conv2d(2 * C, C, 1)
        if kind == "convT":
            self.conv = nn.ConvTranspose2d(C, C, 2, stride=2)
        if kind in ("tokens", "attention", "cls_tokens"):
            self.proj = nn.Linear(C, 3 * C if kind == "attention" else C)
        if kind == "cls_tokens":
            self.cls = nn.Parameter(torch.randn(1, 1, C))
        if kind == "aspp":  # DeepLab's pooled branch: global pool, 1x1 conv, interpolated back, cat
            self.pool_conv, self.mix = nn.Conv2d(C, C, 1), nn.Conv2d(2 * C, C, 1)
        if kind == "fconv":  # a functional 3x3 convolution with a computed weight (ScaledStdConv2d-like)
            self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.mod = {
            "bn": lambda: nn.BatchNorm2d(C),
            "gn": lambda: nn.GroupNorm(2, C),
            "inorm": lambda: nn.InstanceNorm2d(C, affine=True),
            "maxpool": lambda: nn.MaxPool2d(2),
            "avgpool": lambda: nn.AvgPool2d(3, 1, 1),
            "upsample": lambda: nn.Upsample(scale_factor=2, mode=self.mode),
            "act": lambda: nn.SiLU(),
        }.get(kind, lambda: None)()

    def forward(self, x):
        k = self.kind
        if self.mod is not None:
            return self.mod(x)
        if k in ("conv3", "conv1", "conv_s2", "convT"):
            return self.conv(x)
        if k == "residual":
            return x + torch.tanh(self.conv(x))
        if k == "skip":
            return self.mix(torch.cat([x, self.conv(x)], dim=1))
        return functional(k, x, self)


def functional(kind: str, x, step=None):
    """The functional steps (also applied inline by a model's own code)."""
    if kind == "center":
        return x - x.mean(dim=(2, 3), keepdim=True)
    if kind == "scale_by_sum":
        return x / (1 + x.abs().sum(dim=(2, 3), keepdim=True))
    if kind == "interp":
        return F.interpolate(x, scale_factor=2, mode=getattr(step, "mode", "nearest"))
    if kind == "interp_size":
        n, c, h, w = x.shape
        return F.interpolate(x, size=(2 * h, 2 * w), mode="nearest")
    if kind == "tokens":
        n, c, h, w = x.shape
        t = step.proj(x.flatten(2).transpose(1, 2))
        return t.transpose(1, 2).reshape(n, c, h, w)
    if kind == "attention":
        n, c, h, w = x.shape
        q, k_, v = step.proj(x.flatten(2).transpose(1, 2)).chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q[:, None], k_[:, None], v[:, None])[:, 0]
        return x + o.transpose(1, 2).reshape(n, c, h, w)
    if kind == "cls_tokens":  # a CLS token before the pixel tokens, attention over all, x[:, :1] and x[:, 1:]
        n, c, h, w = x.shape
        t = torch.cat((step.cls.expand(n, -1, -1), x.flatten(2).transpose(1, 2)), dim=1)
        t = step.proj(t)
        o = F.scaled_dot_product_attention(t[:, None], t[:, None], t[:, None])[:, 0]
        return x + (o[:, 1:] * torch.tanh(o[:, :1])).transpose(1, 2).reshape(n, c, h, w)
    if kind == "aspp":
        p = step.pool_conv(x.mean(dim=(2, 3), keepdim=True))
        up = F.interpolate(p, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return step.mix(torch.cat([x, up], dim=1))
    if kind == "fconv":
        w = step.conv.weight / (1 + step.conv.weight.abs().mean())
        return F.conv2d(x, w, step.conv.bias, 1, 1)
    if kind == "flip":  # no rule proves it exact along a sharded dim
        return torch.flip(x, dims=(2,))
    if kind == "roll":
        return torch.roll(x, 1, dims=2)
    raise AssertionError(kind)


KINDS = [
    "conv3", "conv1", "conv_s2", "convT", "residual", "skip", "bn", "gn", "inorm", "maxpool", "avgpool",
    "upsample", "act", "center", "scale_by_sum", "interp", "interp_size", "tokens", "attention", "flip", "roll",
    "cls_tokens", "aspp", "fconv",
]  # fmt: skip
# flip is refused, roll by one row routed (refused where a rank holds no row): rarer, so most graphs run through
WEIGHTS = [1 if k in ("flip", "roll") else 4 for k in KINDS]
INLINE = ["center", "scale_by_sum", "interp", "act_inline", "flip"]


class Graph(nn.Module):
    """stem conv -> body (random steps, some applied inline by this model's code) -> optional pooled head."""

    def __init__(self, rng: random.Random):
        super().__init__()
        self.stem = nn.Conv2d(2, C, 3, padding=1)
        kinds = [rng.choices(KINDS, WEIGHTS)[0] for _ in range(rng.randint(1, 4))]
        self.body = nn.ModuleList(Step(k, rng) for k in kinds)
        self.inline = [rng.random() < 0.25 for _ in kinds]  # between body steps: this model's own code
        self.inline_kind = [rng.choice(INLINE) for _ in kinds]
        self.head = (
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(C, 3)) if rng.random() < 0.3 else None
        )

    def forward(self, x):
        return self.run(x)

    def run(self, x):
        h = self.stem(x)
        for step, inline, kind in zip(self.body, self.inline, self.inline_kind):
            h = step(h)
            if inline:
                h = torch.relu(h) if kind == "act_inline" else functional(kind, h)
        return h if self.head is None else self.head(h)


def _plan(rng: random.Random, model: Graph, dims):
    style = tplayers.DomainParallel(shard_dims=dims)
    n = len(model.body)
    choice = rng.choice(["root", "root", "body", "stem|body", "leaves", "mixture", "type"])
    if choice == "root":
        return {"": style}, choice
    if choice == "type":
        return {nn.Conv2d: style}, choice
    if choice == "leaves":
        return {"stem|body\\.\\d+": style}, choice
    if choice == "mixture":
        picked = sorted(rng.sample(range(n), rng.randint(1, n)))
        return {"stem|" + "|".join(f"body\\.{i}" for i in picked): style}, choice
    return {choice: style}, choice


def _sizes(rng: random.Random, n: int, parts: int):
    """A random uneven composition of ``n`` into ``parts`` positive sizes."""
    cuts = sorted(rng.sample(range(1, n), parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


def _one(rng: random.Random, mesh, dims, coords, world):
    torch.manual_seed(rng.randrange(1 << 30))
    serial = Graph(rng).double()
    plan, plan_kind = _plan(rng, serial, dims)
    through = rng.choice(["forward", "run"])
    h, w = rng.randint(6, 13), rng.randint(5, 9)
    layouts = [_sizes(rng, (h, w)[i], mesh.shape[i]) for i in range(len(dims))]
    x = torch.randn(2, 2, h, w, dtype=torch.float64)
    desc = (
        f"kinds={[s.kind for s in serial.body]} inline={serial.inline} plan={plan_kind} via {through} {h}x{w} {layouts}"
    )
    try:
        par = tplayers.parallelize_module(copy.deepcopy(serial), plan, mesh=mesh)
        xs = x.clone().requires_grad_()
        local = x
        for i, d in enumerate(dims):
            local = local.narrow(d, sum(layouts[i][: coords[i]]), layouts[i][coords[i]])
        xl = local.clone().requires_grad_()
        ref = serial.run(xs) if through == "run" else serial(xs)
        out = par.run(xl) if through == "run" else par(xl)
        got = tplayers.gather(out, dims if len(dims) > 1 else dims[0], mesh) if ref.dim() == 4 else out
        if got.shape != ref.shape:
            return ("silent", f"{desc}: shape {tuple(got.shape)} against the serial {tuple(ref.shape)}")
        cot = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        (ref * cot).sum().backward()
        (got * cot).sum().backward()
        ok = got.shape == ref.shape and torch.allclose(got, ref, **TOL)
        gx = xs.grad
        for i, d in enumerate(dims):
            gx = gx.narrow(d, sum(layouts[i][: coords[i]]), layouts[i][coords[i]])
        ok = ok and torch.allclose(xl.grad, gx, **TOL)
        ps = dict(serial.named_parameters())
        for name, p in par.named_parameters():
            a, b = p.grad, ps[name].grad
            ok = ok and ((a is None and b is None) or (a is not None and b is not None and torch.allclose(a, b, **TOL)))
        outcome = ("exact", "") if ok else ("silent", desc)
    except ValueError as e:
        outcome = ("refused", f"{desc}: {str(e)[:160]}")
    except Exception as e:  # noqa: BLE001 - counted, with the traceback
        outcome = ("crash", f"{desc}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    return outcome


def run_graphs(rank, world, seed: int, count: int, mesh_shape=None):
    """Run ``count`` random graphs (seeds ``seed..``) on every rank; the counts and the first few cases of
    each bad outcome."""
    if mesh_shape is not None and len(mesh_shape) == 2:
        mesh = tplayers.init_mesh(tuple(mesh_shape), ("h", "w"), device_type="cpu")
        dims = (2, 3)
    else:
        mesh, dims = tplayers.default_mesh(), (2,)
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    counts = {"exact": 0, "refused": 0, "silent": 0, "crash": 0, "split": 0}
    cases = {"silent": [], "crash": [], "split": [], "refused": []}
    reasons = {}
    verbose = bool(os.environ.get("TPLAYERS_PROPERTY_VERBOSE"))
    for i in range(count):
        if verbose and rank == 0:
            print(f"graph seed {seed + i}", flush=True)
        rng = random.Random(seed + i)
        kind, info = _one(rng, mesh, dims, coords, world)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, kind)
        if len(set(everyone)) > 1:
            kind, info = "split", f"seed {seed + i}: ranks {everyone}: {info}"
        elif kind != "exact":
            info = f"seed {seed + i}: {info}"
        counts[kind] += 1
        if kind == "refused":
            why = _reason(info)
            reasons[why] = reasons.get(why, 0) + 1
        if kind != "exact" and len(cases[kind]) < 5:
            cases[kind].append(info)
    cases["reasons"] = sorted(reasons.items(), key=lambda kv: -kv[1])
    return counts, cases


def _reason(info: str) -> str:
    """A refusal's kind, for the tally: the op the message names."""
    msg = info.split(": ", 2)[-1]
    for cut in ("domain region guard: ", "so every rank raises this error. "):
        msg = msg.split(cut)[-1]
    return msg.split(" (sharded dims")[0].split(" is not known")[0][:70]
