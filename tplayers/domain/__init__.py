"""Domain-sharded data: its layout, where it meets replicated data, its global reductions.

The floor above :mod:`tplayers.comm` and below the layers:

* :mod:`~tplayers.domain.shard` - take / scatter / gather a rank's slice of a global tensor;
* :mod:`~tplayers.domain.window` - window gathers over the halo exchange, by the axis plans of
  :mod:`tplayers.window_plan`;
* :mod:`~tplayers.domain.boundary`, :mod:`~tplayers.domain.reductions` - where sharded data meets
  replicated data, and the one set of global reductions (``domain_sum``, ``domain_mean`` and the
  ``tplayers.functional`` reductions);
* :mod:`~tplayers.domain.layout` - the tag saying which dims of a tensor are sharded, and the
  layout algebra of views; :mod:`~tplayers.domain.active` - the hook by which code below the
  region guard (:mod:`tplayers.region`) finds it;
* :mod:`~tplayers.domain.moves` - ``tplayers.repartition`` (the all-to-alls of
  :mod:`tplayers.comm.all_to_all`), tagging its result inside a region.

See ``docs/design.md``.
"""

from tplayers.domain.boundary import (
    ReplicatedToSharded,
    ShardedToReplicated,
    replicated_to_sharded,
    sharded_to_replicated,
)
from tplayers.domain.moves import repartition
from tplayers.domain.reductions import domain_mean, domain_sum
from tplayers.domain.shard import gather, reset_layouts, resolve_domain, scatter, shard

__all__ = [
    "shard",
    "scatter",
    "gather",
    "resolve_domain",
    "reset_layouts",
    "domain_sum",
    "domain_mean",
    "ShardedToReplicated",
    "ReplicatedToSharded",
    "sharded_to_replicated",
    "replicated_to_sharded",
    "repartition",
]
