"""Replicated parameters of a domain-parallel model: gradients summed over the domain group.

Under domain parallelism every rank sees only its slice of the image, so a
replicated parameter (a channel norm's scale, a per-pixel linear, a learnable
constant) gets only a partial gradient on each rank. :class:`DomainReplicated`
wraps such a module: its forward hands the module's own parameters through
:class:`~tplayers.comm.CopyManyToParallelRegion` (identity forward, one
all-reduce of all their gradients in backward) and calls the module with them via ``torch.func.functional_call``.
The communication is visible in ``forward``; no hooks, no patching.

The wrapper registers the module's own parameters, buffers and children under
their original names, so ``state_dict`` keys are exactly the serial model's.
Wrap only modules applied to *sharded* data (per-pixel computation): a module applied to
replicated data (a head after a global pool) already gets the full gradient, and summing it
would multiply it by the domain size. Inside a ``DomainParallel`` region the region guard
sums replicated gradients where the data meets the shards, and this wrapper is the identity. Norms over the
spatial dims need their twins (``DistributedGroupNorm``...), not this wrapper.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.func import functional_call

from tplayers.comm import copy_many_to_parallel_region
from tplayers.domain.active import active_guard
from tplayers.layers._common import ShardedModule, adopt_tensors
from tplayers.layers._copy import MeshBound
from tplayers.mesh import resolve_mesh

__all__ = ["DomainReplicated"]


class DomainReplicated(MeshBound, nn.Module):
    """Run ``module`` with its direct parameters' gradients summed over ``mesh`` (1-D or 2-D).

    forward: ``module(*args)`` with its own parameters passed through one
    :class:`~tplayers.comm.CopyManyToParallelRegion` per mesh dim / backward: one all-reduce of
    all their gradients per mesh dim. The identity wrapper inside a guarded domain region.

    Args:
        module: a module applied to sharded data (per-pixel), whose children hold no parameters
            of their own (wrap those separately).
        mesh: the domain's 1-D or 2-D mesh (``None``: :func:`tplayers.default_mesh`).

    Returns:
        ``forward(*args)``: what ``module`` returns; ``state_dict`` keys are ``module``'s.

    Raises:
        ValueError: a child of ``module`` has parameters of its own.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        serial = torch.nn.LayerNorm(8, dtype=torch.float64)
        full = torch.randn(2, 10, 16, 8, dtype=torch.float64)   # channels-last activations, H sharded
        scale = tplayers.DomainReplicated(copy.deepcopy(serial), mesh)
        scale(tplayers.shard(full, 1, mesh)).sum().backward()   # scale.weight.grad: summed over ranks
        serial(full).sum().backward()
        torch.testing.assert_close(scale.weight.grad, serial.weight.grad)
        assert list(scale.state_dict()) == ["weight", "bias"]    # as in nn.LayerNorm
    """

    def __init__(self, module: nn.Module, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        mesh = resolve_mesh(mesh, (1, 2))
        self.mesh = mesh
        self._groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self._wrapped = (module,)  # a tuple: not a registered child, so no extra key prefix
        adopt_tensors(self, module)
        for name, child in module.named_children():
            if _has_unsummed_parameters(child):
                raise ValueError(
                    f"DomainReplicated wraps one module's own parameters; child {name!r} "
                    f"({type(child).__name__}) has parameters of its own: wrap it separately, or use "
                    "parallelize_module with DomainParallel, which wraps every such module"
                )
            self.add_module(name, child)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (its children are shared with this wrapper)."""
        return self._wrapped[0]

    def forward(self, *args, **kwargs):
        named = list(self.named_parameters(recurse=False))
        if not named or active_guard() is not None:  # nothing to sum, or the region guard sums where used
            return self.module(*args, **kwargs)
        names, params = zip(*named)
        params = list(params)
        for group in self._groups:  # identity forward; backward: one all-reduce of all their grads
            params = copy_many_to_parallel_region(params, group)
        tensors = dict(zip(names, params))
        tensors.update(self.named_buffers(recurse=False))
        return functional_call(self.module, tensors, args, kwargs, strict=False)

    def collectives(self):
        """Collectives per step: ``(forward list, backward list)``."""
        return [], ["all_reduce (replicated grads)"] * len(self._groups)

    def extra_repr(self) -> str:
        return f"{type(self.module).__name__}, gradients summed over the domain"


def _has_unsummed_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters that no domain-aware layer inside it sums."""
    if isinstance(module, (DomainReplicated, ShardedModule)):
        return False
    if next(module.parameters(recurse=False), None) is not None:
        return True
    return any(_has_unsummed_parameters(c) for c in module.children())
