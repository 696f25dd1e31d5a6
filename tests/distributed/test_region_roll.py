"""``torch.roll`` along sharded dims inside a region (issue 31): a periodic exchange with the neighbours,
exact on uneven partitions (values and gradients against the serial roll in fp64), shifts of either
sign, several dims at once, ``Tensor.roll``, a 2x2 mesh; a shift larger than some rank's slice, a roll
over the flattened tensor and a roll along a merged dim are ``ValueError`` on every rank.
"""

import pytest
import torch
from harness import run_ranks
from oracle import local_slice
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-12, atol=1e-12)

CASES = [
    # (shifts, dims, method)
    (2, 2, False),
    (-3, 2, False),
    ((1, -2), (2, 3), False),
    ((-2, 3, 1), (2, 3, 1), True),  # the channel dim rolls locally
    (0, 2, False),
]


def _rolls(rank, world, mesh_shape, layouts, width):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    sizes = [sum(s) for s in layouts] + ([width] if mesh.ndim == 1 else [])
    for shifts, rdims, method in CASES:
        torch.manual_seed(0)
        full = torch.randn(2, 3, *sizes, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(2, 3, *sizes, dtype=torch.float64)
        x = local_slice(full.detach(), dims, layouts, coords).clone().requires_grad_(True)
        with tplayers.domain_region(mesh, dims, inputs=(x,)):
            y = x.roll(shifts, rdims) if method else torch.roll(x, shifts, rdims)
        loss = (y * local_slice(weight, dims, layouts, coords)).sum()  # this rank's part of the serial loss
        ys = torch.roll(full, shifts, rdims)
        torch.testing.assert_close(y, local_slice(ys.detach(), dims, layouts, coords), **TIGHT)
        loss.backward()
        (ys * weight).sum().backward()
        torch.testing.assert_close(x.grad, local_slice(full.grad, dims, layouts, coords), **TIGHT)
    return True


@pytest.mark.parametrize(
    "world,mesh_shape,layouts",
    [(2, (2,), [[5, 4]]), (3, (3,), [[3, 5, 4]]), (4, (2, 2), [[4, 3], [3, 5]])],
    ids=["2_uneven", "3_uneven", "2x2"],
)
def test_roll_along_sharded_dims_is_exact(world, mesh_shape, layouts):
    assert run_ranks(_rolls, world, args=(mesh_shape, layouts, 6), timeout=60) == [True] * world


REFUSED = {
    "shift beyond a shard": (
        (4,),
        (2,),
        r"rank\(s\) \[1\] raised.*roll\(shifts=\(4,\), dims=\(2,\)\) along sharded dim 2 by 4 rows, where this rank holds 3",
    ),
    "flattened": (3, None, r"over the flattened tensor"),
}


def _refused(rank, world, key):
    mesh = tplayers.default_mesh()
    shifts, dims, match = REFUSED[key]
    x = tplayers.shard(torch.randn(1, 2, 7, 4, dtype=torch.float64), 2, mesh)  # 4 + 3 rows
    with pytest.raises(ValueError, match=match):
        with tplayers.domain_region(mesh, (2,), inputs=(x,)):
            torch.roll(x, shifts, dims) if dims is not None else torch.roll(x, shifts)
    return True


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_roll_refusals_are_raised_on_every_rank(key):
    # the shift of 4: rank 0 holds 4 rows (enough), rank 1 holds 3: both raise
    assert run_ranks(_refused, 2, args=(key,), timeout=60) == [True, True]


def _merged(rank, world):
    mesh = tplayers.default_mesh()
    x = tplayers.shard(torch.randn(1, 2, 8, 4, dtype=torch.float64), 2, mesh)
    with pytest.raises(ValueError, match=r"merges a sharded dim with others"):
        with tplayers.domain_region(mesh, (2,), inputs=(x,)):
            torch.roll(x.flatten(2), 1, 2)
    return True


def test_roll_along_a_merged_dim_is_refused():
    assert run_ranks(_merged, 2, timeout=60) == [True, True]
