"""tplayers: explicit distributed layers for PyTorch.

The pipeline, left to right::

    plan ──> swap modules ──> forward/backward with explicit collectives ──> checkpoint

    import torch, tplayers
    mesh = tplayers.init_mesh()                                   # torchrun env, or a world of 1
    model = tplayers.parallelize_module(model, {
        r"blocks\\.\\d+\\.mlp\\.fc1": tplayers.ColumnParallel(),
        r"blocks\\.\\d+\\.mlp\\.fc2": tplayers.RowParallel(),
    }, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())                   # after swapping

    tplayers.save_checkpoint(model, "ckpt/")                       # sharded; loads at any world size

Hand-written model code uses the layers directly (``ColumnParallelLinear``,
``RowParallelLinear``, ``DistributedConv2d``) with an explicit ``mesh``. Domain
(spatial) parallelism splits activations by rows/columns: ``shard``, ``scatter``
and ``gather`` move between global and local tensors, and
``parallelize_module(model, {"": DomainParallel(shard_dims=(2,))})`` swaps a CNN.
"""

from tplayers import functional
from tplayers.checkpoint import gather_grads, gather_state_dict, load_checkpoint, save_checkpoint
from tplayers.comm import CommLog, count_collectives
from tplayers.domain.boundary import (
    ReplicatedToSharded,
    ShardedToReplicated,
    replicated_to_sharded,
    sharded_to_replicated,
)
from tplayers.domain.moves import repartition
from tplayers.domain.reductions import domain_mean, domain_sum
from tplayers.domain.shard import gather, reset_layouts, scatter, shard
from tplayers.grad_norm import clip_grad_norm_, grad_norm
from tplayers.layers import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    ContextParallelAttention,
    DistributedAdaptiveAvgPool1d,
    DistributedAdaptiveAvgPool2d,
    DistributedAdaptiveAvgPool3d,
    DistributedAdaptiveMaxPool1d,
    DistributedAdaptiveMaxPool2d,
    DistributedAdaptiveMaxPool3d,
    DistributedAvgPool1d,
    DistributedAvgPool2d,
    DistributedAvgPool3d,
    DistributedBatchNorm1d,
    DistributedBatchNorm2d,
    DistributedBatchNorm3d,
    DistributedConv1d,
    DistributedConv2d,
    DistributedConv3d,
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
    DistributedGroupNorm,
    DistributedInstanceNorm1d,
    DistributedInstanceNorm2d,
    DistributedInstanceNorm3d,
    DistributedMaxPool1d,
    DistributedMaxPool2d,
    DistributedMaxPool3d,
    DistributedMultiheadAttention,
    DistributedUpsample,
    DomainReplicated,
    ExpertParallelExperts,
    NeighborhoodAttention,
    NeighborhoodAttention1d,
    NeighborhoodAttention3d,
    ParallelDropout,
    ReplicatedBranch,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tplayers.losses import vocab_parallel_cross_entropy
from tplayers.mesh import default_mesh, init_mesh
from tplayers.ops.na import na1d, na2d, na3d
from tplayers.parallelize import (
    ColumnParallel,
    DomainParallel,
    ExpertParallel,
    ParallelStyle,
    RowParallel,
    SequenceParallel,
    ShardedDropout,
    explain,
    parallelize_module,
)
from tplayers.parallelize.hf import ReplicatedGradSum, causal_lm_loss, plan_from_transformers
from tplayers.region.recompute import region_context_fn
from tplayers.region.scope import domain_region
from tplayers.sharding import ShardSpec, shard_range, shard_sizes

__version__ = "0.1.0"

__all__ = [
    "init_mesh",
    "default_mesh",
    "shard_sizes",
    "shard_range",
    "ShardSpec",
    "shard",
    "scatter",
    "gather",
    "reset_layouts",
    "domain_region",
    "region_context_fn",
    "functional",
    "domain_sum",
    "domain_mean",
    "ShardedToReplicated",
    "ReplicatedToSharded",
    "sharded_to_replicated",
    "replicated_to_sharded",
    "count_collectives",
    "repartition",
    "CommLog",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ColumnParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "grad_norm",
    "clip_grad_norm_",
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
    "DomainReplicated",
    "ReplicatedBranch",
    "ParallelStyle",
    "ColumnParallel",
    "RowParallel",
    "DomainParallel",
    "SequenceParallel",
    "ShardedDropout",
    "ParallelDropout",
    "ExpertParallelExperts",
    "ExpertParallel",
    "parallelize_module",
    "plan_from_transformers",
    "ReplicatedGradSum",
    "causal_lm_loss",
    "explain",
    "save_checkpoint",
    "load_checkpoint",
    "gather_state_dict",
    "gather_grads",
    "na1d",
    "na2d",
    "na3d",
    "NeighborhoodAttention",
    "ContextParallelAttention",
    "DistributedMultiheadAttention",
    "NeighborhoodAttention1d",
    "NeighborhoodAttention3d",
]
