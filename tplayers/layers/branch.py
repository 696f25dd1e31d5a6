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

    Args:
        module: the replicated branch (its inputs and outputs replicated).
        mesh: the domain's 1-D or 2-D mesh; ``None``: the identity wrapper until ``DomainParallel``
            binds it.

    Returns:
        ``forward(*args)``: ``module(*args)``, its gradient summed over the domain in backward.

    Example (``torchrun --nproc-per-node 2``, or plain ``python``)::

        import copy, torch, tplayers
        mesh = tplayers.init_mesh()
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4), torch.nn.Sigmoid())
        full = torch.randn(2, 4, 10, 8)
        pool = tplayers.DistributedAdaptiveAvgPool2d(1, mesh=mesh)
        gate = tplayers.ReplicatedBranch(copy.deepcopy(mlp), mesh)
        h = tplayers.shard(full, 2, mesh)                 # this rank's rows
        y = h * gate(pool(h))[..., None, None]            # squeeze-excitation
        tplayers.domain_sum(y, mesh).backward()
        serial = full * mlp(full.mean((2, 3)))[..., None, None]
        serial.sum().backward()
        torch.testing.assert_close(tplayers.gather(y, 2, mesh), serial)
        torch.testing.assert_close(gate.module[1].weight.grad, mlp[1].weight.grad)   # exact gradients
    """

    def __init__(self, module: nn.Module, mesh: Optional[DeviceMesh] = None) -> None:
        """``mesh=None``: identity until ``DomainParallel`` binds it to its region's mesh."""
        super().__init__()
        self.mesh = None if mesh is None else resolve_mesh(mesh, (1, 2))
        self.module = module

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        return out if self.mesh is None else replicated_to_sharded(out, self.mesh)
