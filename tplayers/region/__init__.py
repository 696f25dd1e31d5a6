"""Domain regions: the guard that sees every op on domain-sharded data inside a region call.

* :mod:`~tplayers.region.scope` - a region's hooks on its root module (agreement, guard, buckets);
* :mod:`~tplayers.region.members` - the modules under a root: paths for messages, and a region call opened
  where one is called outside it; :func:`~tplayers.region.members.bind_region`;
* :mod:`~tplayers.region.outside` - ops on a region's ``DomainTensor`` outputs outside its calls;
* :mod:`~tplayers.region.compiled` - what a region does under ``torch.compile`` (refused at trace time);
* :mod:`~tplayers.region.guard` - the ``TorchFunctionMode`` of one region call;
* :mod:`~tplayers.region.dispatch` - which rule handles an op; the rules themselves in
  :mod:`~tplayers.region.rules` (pointwise, values, shared helpers), :mod:`~tplayers.region.rules_views`
  (views, indexing, ``cat``, ops along a dim), :mod:`~tplayers.region.rules_ops`
  (reductions, norms, cat, ...), :mod:`~tplayers.region.rules_index` (indexing) and
  :mod:`~tplayers.region.rules_route` (routes to :mod:`tplayers.functional`).

Above the layers and :mod:`tplayers.functional`, below :mod:`tplayers.parallelize`. Users reach it
through ``DomainParallel`` and ``tplayers.domain_region``. See ``docs/design.md`` (the region guard).
"""
