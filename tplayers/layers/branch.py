"""A replicated branch whose output is used on the shards (conditioning, gating, FiLM, squeeze-excitation)."""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tplayers.domain.boundary import replicated_to_sharded
from tplayers.mesh import resolve_mesh

__all__ = ["ReplicatedBranch"]


class ReplicatedBranch(nn.Module):
    """Run ``module`` on replicated data and hand its (replicated) output to sharded computation.

    forward: ``replicated_to_sharded(module(*args))`` (identity forward, all-reduce of the output's
    gradient in backward, :class:`~tplayers.domain.boundary.ReplicatedToSharded`). The module's
    parameters then get the full gradient on every rank without any further sum, and so does
    whatever fed the branch (a global pool's output, for squeeze-excitation). ``DomainParallel``
    leaves the wrapped module as it is (no twin swap, no gradient wrapping) and binds a
    ``ReplicatedBranch(module)`` built without a mesh to the region's mesh. Without a mesh the
    wrapper is the identity (the serial model); ``state_dict`` keys are the wrapped module's under
    ``module.``.

    Use it where a custom ``forward`` pools the domain and feeds the result back onto the
    features (squeeze-excitation), or for a time-embedding / FiLM MLP (there a plain
    ``DomainParallel`` region is exact too: the MLP's parameters are summed instead).

    Example (``torchrun --nproc-per-node 2``)::

        import torch, tplayers
        mesh = tplayers.init_mesh()
        pool = tplayers.DistributedAdaptiveAvgPool2d(1, mesh=mesh)
        gate = tplayers.ReplicatedBranch(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4),
                                                             torch.nn.Sigmoid()), mesh)
        h = torch.randn(2, 4, 5, 8)                       # this rank's rows
        y = h * gate(pool(h))[..., None, None]            # squeeze-excitation, exact gradients
    """

    def __init__(self, module: nn.Module, mesh: Optional[DeviceMesh] = None) -> None:
        """``mesh=None``: identity until ``DomainParallel`` binds it to its region's mesh."""
        super().__init__()
        self.mesh = None if mesh is None else resolve_mesh(mesh, (1, 2))
        self.module = module

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        return out if self.mesh is None else replicated_to_sharded(out, self.mesh)
