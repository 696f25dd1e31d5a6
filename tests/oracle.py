"""Helpers that compare a parallel model with its serial oracle (run inside ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tplayers.comm import all_gather_along_dim
from tplayers.layers import ShardedModule
from tplayers.sharding import shard_sizes


def gather_tensor(layer: ShardedModule, name: str, local: torch.Tensor) -> torch.Tensor:
    """Reassemble the serial-layout tensor from each rank's ``local`` piece of ``name``."""
    spec = layer.shard_specs()[name]
    if spec.dim is None:
        return local
    assert not spec.ranges, f"{name} is multi-range (fused sections): use assert_local_slices"
    sizes = shard_sizes(spec.global_shape[spec.dim], spec.parts)
    return all_gather_along_dim(local.contiguous(), spec.dim, sizes, layer.mesh.get_group(0))


def assert_params_match(parallel: torch.nn.Module, serial: torch.nn.Module, *, grads: bool, **tol) -> None:
    """Every parameter (or its gradient) of ``parallel``, gathered, equals ``serial``'s."""
    serial_params = dict(serial.named_parameters())
    seen = set()
    for mod_name, mod in parallel.named_modules():
        if not isinstance(mod, ShardedModule):
            continue
        own = dict(mod.named_parameters())
        for pname in mod.shard_specs():
            if pname not in own:  # a buffer (running stats): compared by the callers
                continue
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            local = mod.get_parameter(pname)
            local = local.grad if grads else local.detach()
            ref = serial_params[full_name]
            ref = ref.grad if grads else ref.detach()
            torch.testing.assert_close(gather_tensor(mod, pname, local), ref, msg=lambda m: f"{full_name}: {m}", **tol)
            seen.add(full_name)
    for name, p in parallel.named_parameters():
        if name not in seen:
            ref = serial_params[name]
            torch.testing.assert_close(
                p.grad if grads else p.detach(),
                ref.grad if grads else ref.detach(),
                msg=lambda m: f"{name}: {m}",
                **tol,
            )
            seen.add(name)
    assert seen == set(serial_params), seen ^ set(serial_params)


def same_on_all_ranks(value: torch.Tensor) -> None:
    """Assert ``value`` is bitwise identical on every rank."""
    t = value.detach().contiguous().clone()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    for o in out:
        assert torch.equal(o, t)


def assert_local_slices(parallel: torch.nn.Module, serial: torch.nn.Module, *, grads: bool, **tol) -> None:
    """Every parameter (or gradient) of ``parallel`` equals THIS rank's slice of ``serial``'s.

    Works for any sharding (fused multi-range blocks, GQA replicas, vocab rows):
    the slice is ``ShardSpec.take`` of the serial tensor. Tied parameters are
    checked under every name. No communication.
    """
    from tplayers.checkpoint.layout import local_tensors

    ref = dict(serial.named_parameters(remove_duplicate=False))
    mine = dict(parallel.named_parameters(remove_duplicate=False))
    assert set(mine) == set(ref), set(mine) ^ set(ref)
    for key, lt in local_tensors(parallel).items():
        if key not in ref:
            continue  # a buffer
        got = mine[key].grad if grads else mine[key].detach()
        want = ref[key].grad if grads else ref[key].detach()
        assert (got is None) == (want is None), f"{key}: gradient presence differs"
        if got is not None:
            torch.testing.assert_close(got, lt.spec.take(want), msg=lambda m: f"{key}: {m}", **tol)


def memory_layout(t: torch.Tensor) -> str:
    """'cl' (channels-last 4-D / 5-D, not also plainly contiguous), 'contiguous' (not also
    channels-last), 'both' (e.g. one channel, or 1x1 spatial; an empty tensor), or 'other'."""
    if t.numel() == 0:
        return "both"
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    is_cl, is_plain = cl is not None and t.is_contiguous(memory_format=cl), t.is_contiguous()
    return "both" if is_cl and is_plain else "cl" if is_cl else "contiguous" if is_plain else "other"


def same_layout(local: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``local`` (a shard) is laid out as ``ref`` (the serial result) is: a tensor that is
    both layouts at once (ambiguous) matches either."""
    a, b = memory_layout(local), memory_layout(ref)
    return a == b or "both" in (a, b)


def local_slice(x: torch.Tensor, dims, layouts, coords) -> torch.Tensor:
    """This rank's block of the global ``x``: ``layouts[i]`` are the shard sizes of dim ``dims[i]``
    and ``coords[i]`` this rank's position along that mesh dim."""
    for d, sizes, c in zip(dims, layouts, coords):
        x = x.narrow(d, sum(sizes[:c]), sizes[c])
    return x


def backward_step_match(loss_s, loss_p, xs, xl, local, serial, parallel, opt_s, opt_p, *, buffers=True, **tol):
    """Backward both losses, then check the input gradient (``local`` maps the serial one to this
    rank's block), every parameter gradient, one optimizer step and (``buffers``) every buffer."""
    torch.testing.assert_close(loss_p, loss_s, **tol)
    loss_s.backward(), loss_p.backward()
    torch.testing.assert_close(xl.grad, local(xs.grad), **tol)
    assert_params_match(parallel, serial, grads=True, **tol)
    opt_s.step(), opt_p.step(), opt_s.zero_grad(), opt_p.zero_grad()
    assert_params_match(parallel, serial, grads=False, **tol)
    if buffers:
        for (n, b), r in zip(parallel.named_buffers(), serial.buffers()):
            torch.testing.assert_close(b, r, msg=lambda m: f"buffer {n}: {m}", **tol)


def edge_convs(model: torch.nn.Module, halo_only: bool = True) -> int:
    """The convolution twins in ``model`` whose cached layouts take the main-plus-strips strategy
    (``ConvSpec.strips``, :func:`tplayers.layers._conv_run.halo_conv`); with ``halo_only`` those with a halo
    (strips), not the convolutions that need none (one-pixel kernels), which take it on any slab."""
    from tplayers.layers.conv import _DistributedConvNd

    return sum(
        any(
            s.strips is not None and (s.strips.pad > 0 or not halo_only)
            for entry in m._layouts.values()
            for s in entry[2].values()
        )
        for m in model.modules()
        if isinstance(m, _DistributedConvNd)
    )
