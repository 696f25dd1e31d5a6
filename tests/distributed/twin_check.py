"""Shared checker of the spatial twins against their serial modules (fp64, inside ranks)."""

from __future__ import annotations

import random

import torch
from oracle import same_on_all_ranks
from torch.distributed.device_mesh import DeviceMesh

import tplayers
from tplayers.sharding import offsets_from_sizes, shard_sizes

TIGHT = dict(rtol=1e-10, atol=1e-10)


def partition(rng: random.Random, length: int, parts: int):
    """Balanced, a random uneven one, or one with an empty edge shard."""
    r = rng.random()
    if r < 0.35 or length < parts:
        return shard_sizes(length, parts)
    if r < 0.5:
        sizes = shard_sizes(length, parts - 1)
        return sizes + [0] if rng.random() < 0.5 else [0] + sizes
    cuts = sorted(rng.randint(0, length) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [length])]


def local_slice(x: torch.Tensor, layouts, shard_dims, coords):
    for i, d in enumerate(shard_dims):
        sizes = layouts[d]
        x = x.narrow(d, offsets_from_sizes(sizes)[coords[i]], sizes[coords[i]])
    return x


def check_twin(serial, twin, x, layouts, mesh: DeviceMesh, shard_dims, *, steps=2, gather_dims=None, what=""):
    """Outputs, input gradients, every parameter gradient, one SGD step and a second input.

    Returns False (on every rank alike) if the twin rejected the partition with a ValueError.
    """
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    gather_dims = tuple(shard_dims) if gather_dims is None else gather_dims
    params = list(twin.parameters())
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1) if params else None
    opt_p = torch.optim.SGD(params, lr=0.1) if params else None
    gen = torch.Generator().manual_seed(1234)
    for step in range(steps if params else 1):
        if step:
            x = torch.randn(x.shape, dtype=x.dtype, generator=gen)
        xs = x.clone().requires_grad_(True)
        xp = local_slice(x, layouts, shard_dims, coords).clone().requires_grad_(True)
        ys = serial(xs)
        try:
            yp = twin(xp)
        except ValueError as e:
            if step == 0 and ("halo" in str(e) or "too few" in str(e)):
                return False
            raise
        if tuple(gather_dims) == tuple(shard_dims) or mesh.ndim == 1:
            yg = tplayers.gather(yp, gather_dims, mesh) if gather_dims else yp
        else:  # some sharded dims were reduced to a replicated size 1: gather the others over their mesh dim
            yg = yp
            for i, d in enumerate(shard_dims):
                if d in gather_dims:
                    yg = tplayers.gather(yg, d, mesh[mesh.mesh_dim_names[i]])
        msg = lambda m: f"{what} {layouts} step {step}: {m}"  # noqa: E731
        torch.testing.assert_close(yg, ys, **TIGHT, msg=msg)
        cot = torch.randn(ys.shape, dtype=ys.dtype, generator=gen)
        (ys * cot).sum().backward()
        (yg * cot).sum().backward()
        gx = tplayers.gather(xp.grad, tuple(shard_dims), mesh)
        torch.testing.assert_close(gx, xs.grad, **TIGHT, msg=msg)
        for (name, p), q in zip(twin.named_parameters(), serial.parameters()):
            same_on_all_ranks(p.grad)
            torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=lambda m: f"{name}: {msg(m)}")
        if params:
            opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
            for p, q in zip(twin.parameters(), serial.parameters()):
                torch.testing.assert_close(p, q, **TIGHT)
    return True
