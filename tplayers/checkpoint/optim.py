"""Optimizer state in checkpoints: saved sharded like its parameter, resharded on load.

Each per-parameter state tensor of ``optimizer.state[p]`` (AdamW ``exp_avg``,
``exp_avg_sq``, ``step``; SGD ``momentum_buffer``; any optimizer's tensors) is
stored under the key ``optimizer/<parameter key>/<state name>``. A state tensor
shaped like its parameter takes the parameter's :class:`~tplayers.ShardSpec`
(a tensor-parallel moment is sharded exactly like its weight, and FSDP2 DTensor
state is all-gathered over dp like the parameter); any other tensor (the 0-d
``step``) is replicated. Loading creates missing state (a fresh optimizer has
none before its first step) and installs it only after every rank validated
the checkpoint; the optimizer's hyperparameters (``lr``, ``betas``...) are the
ones it was built with (build it as before, then load).

Example::

    save_checkpoint(model, "ckpt/", optimizer=opt)          # at 2 ranks
    load_checkpoint(model, "ckpt/", optimizer=opt)          # at 3 ranks, or serially
"""

from __future__ import annotations

from typing import Dict, Iterator, Mapping, Tuple

import torch
from torch import nn

from tplayers.checkpoint.format import CheckpointError, torch_dtype
from tplayers.checkpoint.layout import LocalTensor
from tplayers.checkpoint.wrapped import Staging, full_local, unwrap
from tplayers.sharding import ShardSpec

__all__ = ["PREFIX", "is_optimizer_key", "optimizer_tensors", "optimizer_load_tensors"]

PREFIX = "optimizer/"


def is_optimizer_key(key: str) -> bool:
    return key.startswith(PREFIX)


def _check(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _named_params(model: nn.Module, optimizer) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(parameter key, parameter)`` for every parameter the optimizer updates, in group order."""
    names = {id(p): n for n, p in unwrap(model).named_parameters(remove_duplicate=True)}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}) is not a parameter "
                    "of the model (build the optimizer after parallelize_module / wrapping)"
                )
            yield names[id(p)], p


def _spec(value_shape, param_key: str, local: Mapping[str, LocalTensor]) -> ShardSpec:
    pspec = local[param_key].spec
    if tuple(value_shape) == pspec.local_shape:
        return pspec
    return ShardSpec.replicated(tuple(value_shape))


def optimizer_tensors(model: nn.Module, optimizer, local: Mapping[str, LocalTensor]) -> Dict[str, LocalTensor]:
    """This rank's optimizer state as checkpoint entries (``local``: the model's, for the specs).

    DTensor state is all-gathered over its mesh (collective, same order on every rank).
    """
    _check(optimizer)
    out: Dict[str, LocalTensor] = {}
    for name, p in _named_params(model, optimizer):
        for state_name, value in sorted(optimizer.state.get(p, {}).items()):
            if not isinstance(value, torch.Tensor):
                continue  # non-tensor state (None momentum) has nothing to save
            key = f"{PREFIX}{name}/{state_name}"
            t = full_local(value)
            out[key] = LocalTensor(key, t, _spec(t.shape, name, local))
    return out


def optimizer_load_tensors(
    model: nn.Module, optimizer, local: Mapping[str, LocalTensor], entries: Mapping, staging: Staging, path: str
) -> Dict[str, LocalTensor]:
    """Load targets for every optimizer entry of the checkpoint (``entries``: key -> index entry).

    State the optimizer lacks is created now but installed by ``staging.finish()`` (after
    every rank validated), so a failed load leaves the optimizer untouched.
    """
    _check(optimizer)
    params = dict(_named_params(model, optimizer))
    wanted = [k for k in entries if is_optimizer_key(k)]
    if not wanted:
        raise CheckpointError(f"{path}: holds no optimizer state (save it with save_checkpoint(..., optimizer=opt))")
    out: Dict[str, LocalTensor] = {}
    for key in sorted(wanted):
        name, _, state_name = key[len(PREFIX) :].rpartition("/")
        if name not in params:
            raise CheckpointError(f"{path}: optimizer state {key!r} belongs to no parameter the optimizer updates")
        p, entry = params[name], entries[key]
        pspec = local[name].spec
        # a complex128 state is stored as its float64 view (a trailing dim of 2, layout.real_views)
        as_complex = p.dtype == torch.complex128 and tuple(entry.shape) == tuple(pspec.global_shape) + (2,)
        like_param = tuple(entry.shape) == tuple(pspec.global_shape) or as_complex
        current = optimizer.state.get(p, {}).get(state_name)
        if not isinstance(current, torch.Tensor):
            dtype = p.dtype if as_complex else torch_dtype(entry.dtype, f"tensor {key!r}")
            if like_param:
                current = torch.zeros_like(p, dtype=dtype)  # a DTensor for an FSDP2 parameter
            else:  # e.g. AdamW's 0-d step, kept on the CPU as torch does (unless capturable/fused)
                current = torch.zeros(tuple(entry.shape), dtype=dtype)

            def install(p=p, state_name=state_name, current=current):
                optimizer.state[p][state_name] = current

            staging.defer(install)
        target = staging.target(current)
        spec = pspec if like_param else ShardSpec.replicated(tuple(target.shape))
        out[key] = LocalTensor(key, target, spec)
    return out
