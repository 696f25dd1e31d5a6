"""Communication: autograd-paired collectives, the N-d halo exchange, gradient buckets, accounting.

The bottom of the distributed stack: every module here imports only torch, :mod:`tplayers.mesh`,
:mod:`tplayers.sharding` and :mod:`tplayers.ops`. Where domain-sharded data meets replicated data
(``replicated_to_sharded`` and friends) lives one floor up, in :mod:`tplayers.domain.boundary`.
See ``docs/design.md``.
"""

from tplayers.comm.accounting import CollectiveRecord, CommLog, count_collectives, record_collective
from tplayers.comm.all_to_all import AllToAllDim, repartition
from tplayers.comm.collectives import (
    CopyManyToParallelRegion,
    CopyToParallelRegion,
    GatherAlongDim,
    ReduceFromParallelRegion,
    SplitAlongDim,
    all_gather_along_dim,
    all_reduce_sum,
    copy_many_to_parallel_region,
    copy_to_parallel_region,
    exchange_sizes,
    gather_along_dim,
    reduce_from_parallel_region,
    run_p2p,
    split_along_dim,
)
from tplayers.comm.halo_grad import halo_exchange
from tplayers.comm.sequence import (
    GatherFromSequenceRegion,
    ReduceScatterToSequenceRegion,
    gather_from_sequence_region,
    reduce_scatter_along_dim,
    reduce_scatter_to_sequence_region,
)

__all__ = [
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
    "halo_exchange",
    "AllToAllDim",
    "repartition",
]
