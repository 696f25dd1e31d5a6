"""One twin taking two tensors whose local shapes coincide on some ranks only (smp's PSPNet: the same
``F.interpolate`` route for its 2x2 and 3x3 pooled maps; a shared head applied to both). On 8 rows over
2 ranks the maps are 1 + 1 and 2 + 1 rows: rank 1's local shape repeats, rank 0's does not. A layout
cached by local shape would let rank 1 reuse the first map's plan while rank 0 exchanges (a hang, or the
wrong rows); the twin notices in the partition's first call and exchanges every time. Exact in fp64 over
three calls (the first checks the partition, later ones reuse what they may), also on a 2x2 mesh.
"""

import copy

import torch
import torch.nn.functional as F
from harness import run_ranks
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-10, atol=1e-12)


class Pyramid(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 4, 3, padding=1)  # shared by both pooled maps
        self.pools = nn.ModuleList([nn.AdaptiveAvgPool2d(2), nn.AdaptiveAvgPool2d(3)])

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        height, width = h.shape[2:]
        outs = [h]
        for pool in self.pools:
            p = self.head(pool(h))
            outs.append(F.interpolate(p, size=(height, width), mode="bilinear", align_corners=True))
        return torch.cat(outs, 1)


def _parity(rank, world, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    torch.manual_seed(0)
    serial = Pyramid().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 2, 8, 8, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yp = serial(xs), parallel(xl)
        torch.testing.assert_close(yp, local(ys), **TIGHT)
        cot = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
        backward_step_match(
            (ys * cot).sum(),
            tplayers.domain_sum(yp * local(cot), mesh),
            xs,
            xl,
            local,
            serial,
            parallel,
            opt_s,
            opt_p,
            **TIGHT,
        )
    return True


def test_a_twin_whose_inputs_coincide_on_one_rank_only_is_exact_and_never_hangs():
    run_ranks(_parity, 2, args=((2,), [[4, 4]]), timeout=60)
    run_ranks(_parity, 4, args=((2, 2), [[4, 4], [4, 4]]), timeout=60)
