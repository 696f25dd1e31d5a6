import random

import pytest
import torch

from tplayers import ShardSpec, shard_range, shard_sizes
from tplayers.sharding import offsets_from_sizes


def test_documented_examples():
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(2, 4) == [1, 1, 0, 0]
    assert shard_sizes(0, 3) == [0, 0, 0]
    assert shard_range(10, 4, 0) == (0, 3)
    assert shard_range(10, 4, 3) == (8, 10)


@pytest.mark.parametrize("seed", range(5))
def test_sizes_and_ranges_agree_randomly(seed):
    rng = random.Random(seed)
    for _ in range(200):
        n, parts = rng.randrange(0, 50), rng.randrange(1, 9)
        sizes = shard_sizes(n, parts)
        assert sum(sizes) == n
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)
        offs = offsets_from_sizes(sizes)
        for i in range(parts):
            assert shard_range(n, parts, i) == (offs[i], offs[i] + sizes[i])


@pytest.mark.parametrize(
    "args, exc", [((-1, 2), ValueError), ((3, 0), ValueError), ((3.0, 2), TypeError), ((3, True), TypeError)]
)
def test_bad_arguments(args, exc):
    with pytest.raises(exc):
        shard_sizes(*args)


def test_shard_range_index_out_of_range():
    with pytest.raises(ValueError, match="index"):
        shard_range(5, 2, 2)


def test_shard_spec_take_and_shapes():
    full = torch.arange(40.0).reshape(10, 4)
    spec = ShardSpec.balanced((10, 4), 0, 4, 1)
    assert spec.local_shape == (3, 4)
    assert torch.equal(spec.take(full), full[3:6])
    col = ShardSpec.balanced((10, 4), 1, 3, 2)
    assert torch.equal(col.take(full), full[:, 3:4])
    rep = ShardSpec.replicated((10, 4))
    assert rep.is_replicated and rep.take(full) is full
    with pytest.raises(ValueError, match="global shape"):
        spec.take(full[:9])


def test_module_doctests():
    import doctest

    import tplayers.sharding

    result = doctest.testmod(tplayers.sharding)
    assert result.attempted >= 5 and result.failed == 0
