"""Window-partitioned vision transformers under ``{"": DomainParallel(...)}`` (issue 31), their package's code
unchanged: timm's Swin (its default eager attention and its fused SDPA path; windows aligned with the shards,
and windows moved to whole-window shares where the balanced partition would cut them), transformers'
``SwinModel`` (also with ``gradient_checkpointing_enable()``: nested checkpoints), MONAI's ``SwinUNETR``
without shifted windows and timm's MobileViT, exact in fp64 against the
serial model at 2 ranks (H) and 2x2 (outputs, input gradient, every parameter gradient, and the outputs
again after an SGD step). Refused on every rank: fewer windows than ranks (naming the multiple), MONAI's
shifted windows (its mask is built from ``int(np.ceil(h / ws))``, a local number, naming the line). And a
1-row shard's views with lengths as read, exact.
"""

import copy

import pytest
import torch
from harness import run_ranks
from oracle import local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-10, atol=1e-10)


def _timm(hw, batch, fused=False):
    import timm

    timm.layers.set_fused_attn(fused, experimental=fused)  # fused=True: timm's experimental SDPA path
    model = timm.create_model(
        "swin_tiny_patch4_window7_224",
        pretrained=False,
        img_size=hw,
        window_size=4,
        embed_dim=8,
        depths=(2, 2),
        num_heads=(1, 2),
        num_classes=3,
        in_chans=2,
        drop_path_rate=0.0,
    ).double()
    return model, torch.randn(batch, 2, *hw, dtype=torch.float64), lambda y: y  # logits: replicated


def _timm_checkpointed(hw, batch):
    model, x, pick = _timm(hw, batch)
    model.set_grad_checkpointing(True)  # timm's own per-block activation checkpointing, recomputed under the guard
    return model, x, pick


def _hf(hw, batch):
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(
        image_size=hw[0],
        patch_size=4,
        num_channels=2,
        embed_dim=8,
        depths=[2, 2],
        num_heads=[1, 2],
        window_size=4,
        drop_path_rate=0.0,
    )
    model = SwinModel(config).double()
    return model, torch.randn(batch, 2, *hw, dtype=torch.float64), lambda y: y.pooler_output


def _hf_checkpointed(hw, batch):
    model, x, pick = _hf(hw, batch)
    # nested checkpoints (SwinStage and SwinLayer), each body re-guarded by region_context_fn
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": tplayers.region_context_fn}
    )
    return model.train(), x, pick


def _monai(hw, batch, depths=(1, 1, 1, 1), window=2):
    from monai.networks.nets import SwinUNETR

    model = SwinUNETR(
        in_channels=1,
        out_channels=2,
        feature_size=12,
        depths=depths,
        num_heads=(1, 1, 1, 1),
        window_size=window,
        spatial_dims=len(hw),
    ).double()
    return model, torch.randn(batch, 1, *hw, dtype=torch.float64), None  # a segmentation: sharded like the input


def _mobilevit(hw, batch):
    import timm

    model = timm.create_model("mobilevit_xxs", pretrained=False, num_classes=3, in_chans=2).double()
    return model, torch.randn(batch, 2, *hw, dtype=torch.float64), lambda y: y  # attention across patches


BUILD = {
    "timm": _timm,
    "timm_fused": lambda hw, b: _timm(hw, b, True),
    "timm_checkpointed": _timm_checkpointed,
    "hf": _hf,
    "hf_checkpointed": _hf_checkpointed,
    "monai": _monai,
    # 3-D, windows of 4: the deepest stage's window covers its whole sharded depth (keys and values gathered
    # for MONAI's eager window attention), its bias table sliced [:n, :n] by a length read: the serial one
    "monai3d": lambda hw, b: _monai(hw, b, window=4),
    "mobilevit": _mobilevit,
}


def _exact(rank, world, which, mesh_shape, hw, batch, rows=None):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    dims = (2,) if len(mesh_shape) == 1 else (2, 3)
    torch.manual_seed(0)
    serial, x, pick = BUILD[which](hw, batch)
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh)
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    layouts = rows or [[hw[i] // mesh_shape[i]] * mesh_shape[i] for i in range(len(dims))]
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    xl = local(x).clone().requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    for step in range(2):
        y, ys = par(xl), serial(xs)
        if pick is None:  # sharded output: this rank's rows, and this rank's part of the serial loss
            torch.testing.assert_close(y, local(ys), **TIGHT)
            w = torch.randn_like(ys)
            loss_p, loss_s = (y * local(w)).sum(), (ys * w).sum()
        else:
            y, ys = pick(y), pick(ys)
            torch.testing.assert_close(y, ys, **TIGHT)  # replicated: the whole result on every rank
            w = torch.randn_like(ys)
            loss_p, loss_s = (y * w).sum(), (ys * w).sum()
        if step:
            return True
        loss_p.backward()
        loss_s.backward()
        torch.testing.assert_close(xl.grad, local(xs.grad), **TIGHT)
        for (n, p), (_, q) in zip(par.named_parameters(), serial.named_parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=lambda m, n=n: f"{n}: {m}")
        with torch.no_grad():  # one SGD step on both, then the outputs again
            for p, q in zip(par.parameters(), serial.parameters()):
                if q.grad is not None:
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
    return True


CASES = [
    ("timm", 2, (2,), (64, 32), 1),
    ("timm", 2, (2,), (64, 32), 2),  # a batch equal to the ranks: the window count is not the local batch
    ("timm", 4, (2, 2), (64, 64), 2),
    ("timm", 2, (2,), (96, 32), 1, [[64, 32]]),  # an uneven input (64 + 32 rows); the patch embedding's output
    # is balanced (12 + 12 patch rows: whole windows)
    ("timm", 2, (2,), (48, 32), 2),  # 6 + 6 patch rows: windows of 4 moved to 8 + 4; stage 2 padded 6 -> 8
    ("timm_fused", 2, (2,), (64, 32), 2),
    ("timm_checkpointed", 2, (2,), (48, 32), 1),  # windows moved to whole-window shares, recomputed in backward
    ("hf", 2, (2,), (64, 64), 2),
    ("hf", 4, (2, 2), (64, 64), 1),
    ("hf", 2, (2,), (48, 48), 1),  # windows moved to whole-window shares, as for timm
    ("hf_checkpointed", 2, (2,), (48, 48), 1),  # nested checkpoints recomputed from detached copies, windows moved
    ("hf_checkpointed", 4, (2, 2), (64, 64), 1),
    ("timm", 4, (2, 2), (48, 48), 1),
    ("monai", 2, (2,), (64, 32), 1),
    ("monai", 4, (2, 2), (64, 64), 1),
    ("monai3d", 2, (2,), (64, 32, 32), 1),
    ("mobilevit", 2, (2,), (128, 64), 1),
    ("mobilevit", 4, (2, 2), (128, 128), 1),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{c[0]}_{'x'.join(map(str, c[2]))}_{'x'.join(map(str, c[3]))}_b{c[4]}{'_uneven' * (len(c) > 5)}" for c in CASES
    ],
)
def test_window_transformers_are_exact(case):
    import monai  # noqa: F401 - the test extra installs them: a missing one fails, never skips
    import timm  # noqa: F401
    import transformers  # noqa: F401

    which, world = case[0], case[1]
    assert run_ranks(_exact, world, args=(which, *case[2:]), timeout=240) == [True] * world


def _refused(rank, world, which, hw, match, ranks=2):
    torch.manual_seed(0)
    if which == "monai_shifted":
        model, x, _ = _monai(hw, 1, depths=(2, 2, 2, 2), window=16)
    elif which == "monai_window7":
        model, x, _ = _monai(hw, 1, window=7)
    else:
        model, x, _ = _timm(hw, 1)
    model = tplayers.parallelize_module(model, {"": tplayers.DomainParallel(shard_dims=(2,))})
    with pytest.raises(ValueError, match=match) as info:
        model(tplayers.shard(x, 2))
    return str(info.value).split("Rank 0: ")[-1]


REFUSED = {
    # 8 patch rows at 3 ranks: 2 windows of 4 rows cannot give each rank one
    "crossing": ("timm", (32, 32), r"2 windows cannot give each of 3 ranks one.*multiple of 4 rows", 3),
    # one window per rank in the first stage, the mask MONAI builds from the local height
    "monai_shifted": ("monai_shifted", (64, 32), r"built after numpy.ceil of a length.*swin_unetr.py.*shifted-window"),
    # windows of 7 over an 8-deep stage: one rank would hold a whole window, the other none (it was a gloo
    # collective mismatch: the ranks read the view differently and went on to different collectives)
    "monai_window7": ("monai_window7", (64, 32, 32), r"reads differently on different ranks.*window multiples"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_window_refusals_are_raised_on_every_rank(key):
    import monai  # noqa: F401
    import timm  # noqa: F401

    args = REFUSED[key]
    outs = run_ranks(_refused, args[3] if len(args) > 3 else 2, args=args, timeout=120)
    assert len(set(outs)) == 1, outs


class _Tokens(torch.nn.Module):
    """Pixels as tokens and back with the lengths as read (``ShardLen``s), around two convolutions."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv1(x)
        n, c, rows, w = h.shape
        h = h.view(n, c, rows * w).view(n, c, rows, w)
        return self.conv2(torch.relu(h))


def _one_row(rank, world, sizes):
    torch.manual_seed(0)
    serial = _Tokens().double()
    par = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(1, 2, sum(sizes), 6, dtype=torch.float64)
    xl = x.narrow(2, sum(sizes[:rank]), sizes[rank])
    torch.testing.assert_close(par(xl), serial(x).narrow(2, sum(sizes[:rank]), sizes[rank]), **TIGHT)
    return True


def test_views_of_a_single_row_shard_with_read_lengths_are_exact():
    # x.view(n, c, h * w) of a 1-row shard is ambiguous from local shapes (refused with plain sizes:
    # test_guard_agreed.py); with h read from the tensor (a ShardLen) it is read as the serial view
    assert run_ranks(_one_row, 3, args=([3, 1, 2],), timeout=60) == [True] * 3


def _merged_factory(rank, world):
    mesh = tplayers.default_mesh()
    x = tplayers.shard(torch.randn(1, 2, 8, 4, dtype=torch.float64), 2, mesh)
    with pytest.raises(ValueError, match=r"a size read from a dim that merges a sharded dim with others") as info:
        with tplayers.domain_region(mesh, (2,), inputs=(x,)):
            tokens = x.flatten(2)  # (1, 2, H * W): a merged dim, its length a ShardLen of the serial 32
            torch.zeros(tokens.shape[2])
    return str(info.value)


def test_a_factory_sized_by_a_merged_length_is_refused_on_every_rank():
    outs = run_ranks(_merged_factory, 2, timeout=60)
    assert outs[0] == outs[1], outs


class GridView(nn.Module):
    """Tokens viewed with the configured global grid (MONAI UNETR's ``proj_feat``: plain sizes)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)

    def forward(self, x):
        t = self.conv(x).flatten(2).transpose(1, 2)  # (B, HW, C)
        return t.view(2, 4, 5, 3).permute(0, 3, 1, 2) * 2


def _grid_view(rank, world, rows):
    torch.manual_seed(0)
    serial = GridView().double()
    model = tplayers.parallelize_module(copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 2, 4, 5, dtype=torch.float64)
    start = sum(rows[:rank])
    torch.testing.assert_close(model(x[:, :, start : start + rows[rank]]), serial(x)[:, :, start : start + rows[rank]])
    return True


@pytest.mark.parametrize("rows", [[2, 2], [3, 1], [4, 0]], ids=["even", "uneven", "all_on_rank_0"])
def test_a_view_with_the_global_grid_is_exact_when_one_rank_holds_every_row(rows):
    """The plain sizes give every rank but the one holding all rows another count than its own: that rank
    reads the view serially too (it was read locally there while the others gathered: a collective mismatch)."""
    assert run_ranks(_grid_view, 2, args=(rows,), timeout=60) == [True, True]
