"""Communication: autograd-paired collectives and comm accounting.

The domain-parallel halo exchange and boundary operations live in :mod:`tplayers.domain`
(re-exported here for existing imports).
"""

from tplayers.comm.accounting import CollectiveRecord, CommLog, count_collectives, record_collective
from tplayers.domain.boundary import ReplicatedToSharded, ShardedToReplicated, replicated_to_sharded, sharded_to_replicated
from tplayers.domain.halo import HaloExchange1d, halo_exchange, halo_exchange_along
from tplayers.comm.sequence import (
    GatherFromSequenceRegion,
    ReduceScatterToSequenceRegion,
    gather_from_sequence_region,
    reduce_scatter_along_dim,
    reduce_scatter_to_sequence_region,
)
from tplayers.comm.collectives import (
    CopyManyToParallelRegion,
    CopyToParallelRegion,
    copy_many_to_parallel_region,
    GatherAlongDim,
    ReduceFromParallelRegion,
    SplitAlongDim,
    all_gather_along_dim,
    all_reduce_sum,
    copy_to_parallel_region,
    exchange_sizes,
    gather_along_dim,
    reduce_from_parallel_region,
    run_p2p,
    split_along_dim,
)

__all__ = [
    "ShardedToReplicated",
    "ReplicatedToSharded",
    "sharded_to_replicated",
    "replicated_to_sharded",
    "CollectiveRecord",
    "CommLog",
    "count_collectives",
    "record_collective",
    "CopyToParallelRegion",
    "CopyManyToParallelRegion",
    "copy_many_to_parallel_region",
    "ReduceFromParallelRegion",
    "SplitAlongDim",
    "GatherAlongDim",
    "all_reduce_sum",
    "all_gather_along_dim",
    "exchange_sizes",
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "split_along_dim",
    "run_p2p",
    "gather_along_dim",
    "GatherFromSequenceRegion",
    "ReduceScatterToSequenceRegion",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "reduce_scatter_along_dim",
    "HaloExchange1d",
    "halo_exchange",
    "halo_exchange_along",
]
