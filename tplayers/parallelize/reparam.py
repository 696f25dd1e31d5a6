"""Swapping a module whose weight is reparametrized: spectral and weight normalization, in both of torch's
forms (the forward pre-hook of ``nn.utils.spectral_norm`` / ``weight_norm``, and the parametrizations of
``nn.utils.parametrizations.spectral_norm`` / ``weight_norm`` or any ``parametrize.register_parametrization``).

A domain twin holds its weights whole on every rank, so the reparametrization is replicated work: the
twin gets the same machinery on the same tensors (the serial module's original weights, power-iteration
vectors, norms) and computes the same weight on every rank; its convolution sums that weight's gradient
over the ranks (a computed weight is not a bucketed parameter, :mod:`tplayers.comm.buckets`), and
autograd carries it back through the replicated reparametrization to the originals. The twin's
``state_dict`` keys are the serial module's (``weight_orig`` / ``weight_u`` / ``weight_v``,
``weight_g`` / ``weight_v``, ``parametrizations.weight.original``...).
"""

from __future__ import annotations

import copy
from typing import Callable, List

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["base_type", "is_reparametrized", "swap_reparametrized"]

_HOOKS = (SpectralNorm, WeightNorm)


def _hooks(module: nn.Module) -> List:
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, _HOOKS)]


def is_reparametrized(module: nn.Module) -> bool:
    """Whether ``module``'s tensors are computed by parametrizations or a spectral / weight norm hook."""
    return parametrize.is_parametrized(module) or bool(_hooks(module))


def base_type(module: nn.Module) -> type:
    """``module``'s class, looking through the class ``register_parametrization`` makes
    (``ParametrizedConv2d`` -> ``nn.Conv2d``)."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def swap_reparametrized(module: nn.Module, build: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """The twin ``build(plain)`` of a reparametrized ``module`` (``plain``: a copy with the computed
    weights as plain parameters), carrying ``module``'s reparametrization on copies of its tensors."""
    computed = {h.name: getattr(module, h.name) for h in _hooks(module)}
    try:  # a hook's computed weight is not a leaf, which deepcopy refuses: copy it detached
        for name, t in computed.items():
            setattr(module, name, t.detach())
        plain = copy.deepcopy(module)
    finally:
        for name, t in computed.items():
            setattr(module, name, t)
    names = list(plain.parametrizations.keys()) if parametrize.is_parametrized(plain) else []
    for name in names:
        parametrize.remove_parametrizations(plain, name, leave_parametrized=True)
    for hook in _hooks(plain):
        (nn.utils.remove_spectral_norm if isinstance(hook, SpectralNorm) else nn.utils.remove_weight_norm)(
            plain, hook.name
        )
    twin = build(plain)
    for name in names:  # the same parametrizations (copies), then the serial originals' values
        source = module.parametrizations[name]
        for p in source:
            parametrize.register_parametrization(twin, name, copy.deepcopy(p), unsafe=True)
        _copy_state(twin.parametrizations[name], source)
    if names:  # the twin reads its weight more than once a call: computed once, as the serial module does
        twin._tp_reparametrized = True
    for hook in _hooks(module):
        with torch.random.fork_rng(devices=[]):  # spectral_norm draws its vectors: keep the caller's stream
            if isinstance(hook, SpectralNorm):
                nn.utils.spectral_norm(twin, hook.name, hook.n_power_iterations, hook.eps, hook.dim)
            else:
                nn.utils.weight_norm(twin, hook.name, hook.dim)
        for suffix in ("_orig", "_u", "_v", "_g"):
            if hasattr(module, hook.name + suffix):
                with torch.no_grad():
                    getattr(twin, hook.name + suffix).copy_(getattr(module, hook.name + suffix))
        with torch.no_grad():  # the computed weight as the serial module last left it
            setattr(twin, hook.name, getattr(module, hook.name).detach().clone())
    return twin


def _copy_state(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        for (name, t), (_, s) in zip(dst.state_dict(keep_vars=True).items(), src.state_dict(keep_vars=True).items()):
            t.copy_(s)
            if isinstance(t, nn.Parameter) and isinstance(s, nn.Parameter):
                t.requires_grad_(s.requires_grad)
