"""The property test that hunts silent paths (issue 33 item 6), bounded for CI: random small models,
plans and uneven partitions (``tests/guard_property.py``), each exact against the serial model in fp64
or refused with a ``ValueError`` on every rank. ``benchmarks/guard_property.py`` is the long run."""

import pytest
from guard_property import run_graphs
from harness import run_ranks


@pytest.mark.parametrize(
    "world,mesh_shape,count,seed", [(2, None, 40, 0), (3, None, 25, 10_000), (4, (2, 2), 25, 20_000)]
)
def test_random_graphs_are_exact_or_refused_on_every_rank(world, mesh_shape, count, seed):
    counts, cases = run_ranks(run_graphs, world, args=(seed, count, mesh_shape), timeout=600)[0]
    print(f"{world} ranks {mesh_shape or ''}: {counts}")
    bad = {k: cases[k] for k in ("silent", "crash", "split") if counts[k]}
    assert not bad, bad
    assert counts["exact"] >= count // 4, counts  # the generator still builds mostly runnable graphs
