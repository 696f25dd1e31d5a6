"""Gradient buckets of a region call (tplayers.comm.buckets): the convolution twins' parameter
gradients are summed in one async all-reduce per bucket instead of one per layer, and every .grad
still equals the serial model's (fp64, uneven partitions, an optimizer step): a conv + transposed
conv net, a conv applied twice in one call, a weight also used outside the twin (a replicated
penalty), a branch whose backward never runs, two forwards before one backward, a 2-D mesh, the
convolutions' main-plus-strips path, and input-only gradients (no bucket posted, no hang)."""

import copy

import pytest
import torch
from harness import run_ranks
from oracle import assert_params_match, edge_convs
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers
import tplayers.comm.buckets as buckets_mod
import tplayers.layers.conv as conv_module
from tplayers.sharding import offsets_from_sizes

TIGHT = dict(rtol=1e-9, atol=1e-10)


class Net(nn.Module):
    """conv -> conv (applied twice) -> transposed conv -> conv; ``extra``: a penalty on a conv weight
    (a replicated use beside the twin's); ``skip``: a conv whose output does not reach the loss."""

    def __init__(self, extra=False, skip=False):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.c = nn.Conv2d(4, 1, 3, stride=2, padding=1)
        self.dead = nn.Conv2d(4, 4, 1)
        self.extra, self.skip = extra, skip

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(torch.tanh(self.b(h))))
        if self.skip:
            self.dead(h)  # computed, never used
        y = self.c(torch.tanh(self.up(h)))
        if self.extra:
            y = y + self.a.weight.pow(2).sum()
        return y


def _sizes(n, world):
    base = [n // world + (1 if i < n % world else 0) for i in range(world)]
    base[0] += 1  # uneven
    base[-1] -= 1
    return base


def _check(rank, world, extra=False, skip=False, twice=False, mesh_shape=None, edges=False):
    if edges:  # every slab takes the convolutions' main-plus-strips strategy (tplayers.layers._conv_fn)
        conv_module.EDGE_MIN_ELEMENTS = 0
    torch.manual_seed(0)
    serial = Net(extra, skip).double()
    if mesh_shape is None:
        mesh = tplayers.init_mesh(device_type="cpu")
        dims = (2,)
    else:
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
        dims = (2, 3)
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s, opt_p = torch.optim.SGD(serial.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    H = W = 12
    x = torch.randn(2, 2, H, W, dtype=torch.float64)
    if mesh_shape is None:
        sizes = _sizes(H, world)
        h0 = offsets_from_sizes(sizes)[rank]
        xl = x[:, :, h0 : h0 + sizes[rank]]
    else:
        xl = tplayers.shard(x, (2, 3), mesh)
    with tplayers.count_collectives() as log:
        loss_p = tplayers.domain_sum(model(xl) ** 2, mesh)
        if twice:
            loss_p = loss_p + tplayers.domain_sum(model(xl * 0.5) ** 2, mesh)
        loss_p.backward()
    loss_s = (serial(x) ** 2).sum()
    if twice:
        loss_s = loss_s + (serial(x * 0.5) ** 2).sum()
    loss_s.backward()
    torch.testing.assert_close(loss_p, loss_s, **TIGHT)
    assert_params_match(model, serial, grads=True, **TIGHT)
    opt_s.step(), opt_p.step()
    assert_params_match(model, serial, grads=False, **TIGHT)
    if edges:
        assert edge_convs(model) >= 2, edge_convs(model)  # a and b at least
    tags = [r.tag for r in log.records if r.kind == "all_reduce"]
    assert "conv.param_grads" not in tags and "replicated_grads" not in " ".join(tags), tags
    calls = 2 if twice else 1
    # one bucket per call (the params are tiny), on a 2-D mesh one all-reduce per mesh dim
    assert tags.count("region.param_grads") == calls * (1 if mesh_shape is None else 2), tags


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_grads_exact_one_all_reduce_per_call(world):
    run_ranks(_check, world)


def test_weight_also_used_outside_its_twin():
    run_ranks(_check, 2, kwargs=dict(extra=True))


def test_twin_whose_output_is_unused():
    run_ranks(_check, 2, kwargs=dict(skip=True))


def test_two_forwards_one_backward():
    run_ranks(_check, 2, kwargs=dict(twice=True))


def test_2d_mesh():
    run_ranks(_check, 4, kwargs=dict(mesh_shape=(2, 2)))


@pytest.mark.parametrize("world,mesh_shape", [(2, None), (4, (2, 2))])
def test_edge_path_partial_sums(world, mesh_shape):
    """The main-plus-strips convolutions hand the region their partial sums (``reduce=False``) too."""
    run_ranks(_check, world, kwargs=dict(mesh_shape=mesh_shape, edges=True))


def _pair():
    """The fp64 serial Net and its H-sharded parallel twin on the default 1-D mesh."""
    torch.manual_seed(0)
    serial = Net().double()
    mesh = tplayers.init_mesh(device_type="cpu")
    model = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))}, mesh=mesh
    )
    return serial, mesh, model


def _input_only(rank, world):
    serial, mesh, model = _pair()
    x = torch.randn(2, 2, 12, 12, dtype=torch.float64, requires_grad=True)
    xl = tplayers.shard(x.detach(), 2, mesh).requires_grad_(True)
    with tplayers.count_collectives() as log:
        (gl,) = torch.autograd.grad(tplayers.domain_sum(model(xl) ** 2, mesh), [xl])
    (gs,) = torch.autograd.grad((serial(x) ** 2).sum(), [x])
    torch.testing.assert_close(gl, tplayers.shard(gs, 2, mesh), **TIGHT)
    assert all(p.grad is None for p in model.parameters())
    assert not [r for r in log.records if r.tag == "region.param_grads"]


def test_input_gradient_only_posts_no_bucket():
    run_ranks(_input_only, 2)


def _small_buckets(rank, world):
    buckets_mod.BUCKET_BYTES = 8 * 40  # a few parameters per bucket: several buckets in flight
    serial, mesh, model = _pair()
    x = torch.randn(2, 2, 12, 12, dtype=torch.float64)
    with tplayers.count_collectives() as log:
        tplayers.domain_sum(model(tplayers.shard(x, 2, mesh)) ** 2, mesh).backward()
    (serial(x) ** 2).sum().backward()
    assert_params_match(model, serial, grads=True, **TIGHT)
    assert sum(r.tag == "region.param_grads" for r in log.records) > 2


def test_several_buckets():
    run_ranks(_small_buckets, 2)


def _explain(rank, world):
    torch.manual_seed(0)
    net = nn.Sequential(Net())
    exp = tplayers.explain(net, {"0": tplayers.DomainParallel(shard_dims=(2,))}, print_table=False)
    text = str(exp)
    assert "all_reduce (parameter-gradient bucket, conv weights+biases)" in text, text
    assert "weight+bias grads" not in text and "(parameter grads)" not in text, text  # no per-layer sums
    return text


def test_explain_counts_the_bucket_not_per_layer_sums():
    run_ranks(_explain, 2)


def _retain_graph(rank, world):
    serial, mesh, model = _pair()
    x = torch.randn(2, 2, 12, 12, dtype=torch.float64)
    loss_p = tplayers.domain_sum(model(tplayers.shard(x, 2, mesh)) ** 2, mesh)
    loss_s = (serial(x) ** 2).sum()
    for _ in range(2):  # the same graph twice: the gradients accumulate twice, as in the serial model
        loss_p.backward(retain_graph=True)
        loss_s.backward(retain_graph=True)
        assert_params_match(model, serial, grads=True, **TIGHT)


def test_second_backward_of_the_same_graph():
    run_ranks(_retain_graph, 2)
