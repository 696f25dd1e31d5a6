"""Domain-sharded data outside a guarded call: :class:`DomainTensor`.

Inside a domain region the guard sees every op on sharded data (a tag on the tensor, a mode on the
stack). A region call opened where no guarded call runs (a model method other than ``forward``,
such as ``AutoencoderKL.decode``; a region's submodule called by hand) returns, for each output
sharded along the region's dims, this rank's slice as a :class:`DomainTensor`: a ``torch.Tensor``
subclass that carries its region and layout, so the ops the method's own code applies to it
afterwards (``h - h.mean((2, 3))``) are checked, routed or refused exactly as inside the region
(``region.run_op``, :mod:`tplayers.region.outside`). Inside a guarded call (a region, a twin, a
routed implementation) it is a plain tensor, and every op on it returns plain tensors.

``tplayers.gather`` takes it like any local slice; :func:`plain` gives the slice as a plain tensor
(the same storage, attached to autograd). See docs/design.md (the region guard).
"""

from __future__ import annotations

from typing import Any

import torch

from tplayers.domain.active import in_guarded_call
from tplayers.ops.registry import GraphBreak

__all__ = ["DomainTensor", "plain", "wrap"]

# Tensor attributes and methods that read this rank's slice as it is (no op on its values across ranks).
_LOCAL_PROPS = frozenset(
    "dtype device requires_grad grad is_leaf grad_fn ndim layout is_cuda is_cpu is_meta is_sparse is_quantized "
    "is_nested names _base output_nr _version is_mps is_xpu itemsize nbytes".split()
)
_LOCAL_METHODS = frozenset(
    "__repr__ __format__ __str__ __reduce_ex__ __deepcopy__ __setstate__ __hash__ __array__ tolist numpy "
    "dim ndimension numel nelement element_size is_contiguous stride storage_offset data_ptr untyped_storage "
    "backward register_hook register_post_accumulate_grad_hook retain_grad requires_grad_ is_floating_point "
    "is_complex get_device _is_view is_set_to as_subclass".split()
)


def _local(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(func.__self__, "__name__", "") in _LOCAL_PROPS
    return name in _LOCAL_METHODS


class DomainTensor(torch.Tensor):
    """This rank's slice of a domain-sharded tensor that has left its region's call (see the module
    docstring). ``_tp_region``: the region whose mesh and dims it is sharded over; ``_tp_layout``: its
    layout (:mod:`tplayers.domain.layout`)."""

    _tp_region: Any
    _tp_layout: Any

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() and not _local(func):
            _refuse_compiled()
        if in_guarded_call() or _local(func) or torch._C._current_graph_task_id() != -1:
            # inside a guarded call, a local read, or a backward (a twin's saved input): this rank's slice
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        region = _first_region(args, kwargs)
        return region.run_op(func, args, kwargs)


_LEFT = (
    "DomainTensor: an op on domain-sharded data that left its region's call, inside code traced by "
    "torch.compile (which the region's rules do not run in): gather it first (tplayers.gather), "
    "run that code eagerly, or compile the whole call"
)


def _left() -> None:
    raise ValueError(_LEFT)


# a graph break, so the ValueError reaches the caller; built when a region is made (its DomainTensors come
# after), not at import (tplayers.region.compiled.prepare_refusals)
_refuse_compiled = GraphBreak(_left, _LEFT)


def _first_region(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, DomainTensor):
            return a._tp_region
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, DomainTensor):
                    return b._tp_region
    raise TypeError("DomainTensor.__torch_function__: no DomainTensor among the arguments")  # pragma: no cover


def wrap(t: torch.Tensor, region: Any, layout: Any) -> "DomainTensor":
    """``t`` (this rank's slice) as a :class:`DomainTensor` of ``region`` with ``layout`` (same storage,
    same autograd history)."""
    with torch._C.DisableTorchFunctionSubclass():
        out = t.as_subclass(DomainTensor)
    out._tp_region, out._tp_layout = region, layout
    return out


def plain(t: Any) -> Any:
    """``t`` as a plain tensor when it is a :class:`DomainTensor` (same storage, same autograd
    history); anything else as it is.

    >>> import torch
    >>> plain(torch.ones(2)).shape
    torch.Size([2])
    """
    if isinstance(t, DomainTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return t.as_subclass(torch.Tensor)
    return t
