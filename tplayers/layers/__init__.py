"""Modules that own parameters: tensor-parallel linears (and, later, domain-parallel layers)."""

from tplayers.layers._common import ShardedModule
from tplayers.layers.attention import NeighborhoodAttention
from tplayers.layers.conv import DistributedConv2d
from tplayers.layers.dropout import ParallelDropout
from tplayers.layers.replicated import DomainReplicated
from tplayers.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ShardedModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "DistributedConv2d",
    "ParallelDropout",
    "DomainReplicated",
    "NeighborhoodAttention",
]
