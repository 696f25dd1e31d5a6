"""The domain-parallel core: everything spatial twins and domain regions share.

* :mod:`~tplayers.domain.shard` - take / scatter / gather a rank's slice of a global tensor;
* :mod:`~tplayers.domain.window_plan` - the partition rule and the window-op axis plans (which
  global input rows each owned output row reads: conv, pooling, interpolation);
* :mod:`~tplayers.domain.route`, :mod:`~tplayers.domain.halo`, :mod:`~tplayers.domain.window` -
  the N-d halo exchange and window gathers built on those plans;
* :mod:`~tplayers.domain.boundary`, :mod:`~tplayers.domain.reductions` - where sharded data meets
  replicated data, and the global sums / means of losses and metrics;
* :mod:`~tplayers.domain.layout`, :mod:`~tplayers.domain.guard`, :mod:`~tplayers.domain.rules` and
  :mod:`~tplayers.domain.scope` - the region guard: which tensors are sharded, what each op on them
  does (local, routed to :mod:`tplayers.functional`, or refused), where it is on.

The spatial twins in :mod:`tplayers.layers` are thin modules over these pieces.
"""

from tplayers.domain.boundary import ReplicatedToSharded, ShardedToReplicated, replicated_to_sharded, sharded_to_replicated
from tplayers.domain.reductions import domain_mean, domain_sum
from tplayers.domain.shard import gather, reset_layouts, resolve_domain, scatter, shard

__all__ = ["shard", "scatter", "gather", "resolve_domain", "reset_layouts", "domain_sum", "domain_mean",
           "ShardedToReplicated", "ReplicatedToSharded", "sharded_to_replicated", "replicated_to_sharded"]
