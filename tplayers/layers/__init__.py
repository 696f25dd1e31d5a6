"""Modules: tensor-parallel linears, domain-parallel spatial twins, neighborhood attention."""

from tplayers.layers._common import ShardedModule
from tplayers.layers.adaptive_pool import (
    DistributedAdaptiveAvgPool1d,
    DistributedAdaptiveAvgPool2d,
    DistributedAdaptiveAvgPool3d,
    DistributedAdaptiveMaxPool1d,
    DistributedAdaptiveMaxPool2d,
    DistributedAdaptiveMaxPool3d,
)
from tplayers.layers.branch import ReplicatedBranch
from tplayers.layers.context_attention import ContextParallelAttention, DistributedMultiheadAttention
from tplayers.layers.conv import DistributedConv1d, DistributedConv2d, DistributedConv3d
from tplayers.layers.conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
)
from tplayers.layers.dropout import ParallelDropout
from tplayers.layers.embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from tplayers.layers.experts import ExpertParallelExperts
from tplayers.layers.linear import ColumnParallelLinear, RowParallelLinear
from tplayers.layers.neighborhood_attention import (
    NeighborhoodAttention,
    NeighborhoodAttention1d,
    NeighborhoodAttention3d,
)
from tplayers.layers.norm import (
    DistributedBatchNorm1d,
    DistributedBatchNorm2d,
    DistributedBatchNorm3d,
    DistributedGroupNorm,
    DistributedInstanceNorm1d,
    DistributedInstanceNorm2d,
    DistributedInstanceNorm3d,
)
from tplayers.layers.pool import (
    DistributedAvgPool1d,
    DistributedAvgPool2d,
    DistributedAvgPool3d,
    DistributedMaxPool1d,
    DistributedMaxPool2d,
    DistributedMaxPool3d,
)
from tplayers.layers.replicated import DomainReplicated
from tplayers.layers.upsample import DistributedUpsample

__all__ = [
    "ContextParallelAttention",
    "DistributedMultiheadAttention",
    "ShardedModule",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ColumnParallelEmbedding",
    "DistributedConv1d",
    "DistributedConv2d",
    "DistributedConv3d",
    "DistributedConvTranspose1d",
    "DistributedConvTranspose2d",
    "DistributedConvTranspose3d",
    "DistributedMaxPool1d",
    "DistributedMaxPool2d",
    "DistributedMaxPool3d",
    "DistributedAvgPool1d",
    "DistributedAvgPool2d",
    "DistributedAvgPool3d",
    "DistributedAdaptiveAvgPool1d",
    "DistributedAdaptiveAvgPool2d",
    "DistributedAdaptiveAvgPool3d",
    "DistributedUpsample",
    "DistributedBatchNorm1d",
    "DistributedBatchNorm2d",
    "DistributedBatchNorm3d",
    "DistributedGroupNorm",
    "DistributedInstanceNorm1d",
    "DistributedInstanceNorm2d",
    "DistributedInstanceNorm3d",
    "DistributedAdaptiveMaxPool1d",
    "DistributedAdaptiveMaxPool2d",
    "DistributedAdaptiveMaxPool3d",
    "ParallelDropout",
    "ExpertParallelExperts",
    "DomainReplicated",
    "ReplicatedBranch",
    "NeighborhoodAttention",
    "NeighborhoodAttention1d",
    "NeighborhoodAttention3d",
]
