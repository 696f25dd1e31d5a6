"""ViT-style token layouts under ``{"": DomainParallel(...)}`` (issue 31): prefix tokens (a CLS token,
DeiT's distillation token) concatenated before patch tokens sharded along the flattened pixels,
learned position embeddings resized to the patches with ``interpolate_pos_encoding`` (each rank keeps
its rows), attention over all tokens (SDPA, routed to the full-attention core) and pooling with
``x[:, 0]``.

transformers' ``ViTModel`` / ``ViTForImageClassification`` (tiny configs, random init, SDPA
attention) and a hand-written DeiT-like model (two prefix tokens, the patch tokens ``x[:, 2:]``
folded back to an image and convolved) are compared with the serial model in fp64 at 2 and 3 ranks
and on a 2x2 mesh: outputs (the last hidden state's local tokens, pooled outputs, logits), the input
gradient, every parameter gradient (CLS token and position embeddings included), after an SGD step.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from hf_util import require
from oracle import backward_step_match, local_slice
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tplayers

TIGHT = dict(rtol=1e-9, atol=1e-11)
PATCH = 4


def _vit(kind, image=20):
    transformers = require("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=image,
        patch_size=PATCH,
        num_channels=2,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    config._attn_implementation = "sdpa"
    cls = transformers.ViTModel if kind == "vit_model" else transformers.ViTForImageClassification
    return cls(config).double()


class DeiTish(nn.Module):
    """Two prefix tokens (CLS, distillation) before patch tokens, a full-size learned position embedding
    resized like ViT's ``interpolate_pos_encoding``, an encoder layer of SDPA attention, two heads on
    ``x[:, 0]`` / ``x[:, 1]``, and the patch tokens ``x[:, 2:]`` folded back to an image and convolved."""

    def __init__(self, grid=5, dim=8):
        super().__init__()
        self.grid, self.dim = grid, dim
        self.patch = nn.Conv2d(2, dim, PATCH, stride=PATCH)
        self.cls_token, self.dist_token = nn.Parameter(torch.randn(1, 1, dim)), nn.Parameter(torch.randn(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 2 + grid * grid, dim))
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.head, self.head_dist = nn.Linear(dim, 3), nn.Linear(dim, 3)
        self.conv = nn.Conv2d(dim, 2, 3, padding=1)

    def forward(self, x):
        n, _, h, w = x.shape
        t = self.patch(x).flatten(2).transpose(1, 2)
        prefix = torch.cat((self.cls_token.expand(n, -1, -1), self.dist_token.expand(n, -1, -1)), dim=1)
        t = torch.cat((prefix, t), dim=1)
        grid = self.pos[:, 2:].reshape(1, self.grid, self.grid, self.dim).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(h // PATCH, w // PATCH), mode="bicubic", align_corners=False)
        t = t + torch.cat((self.pos[:, :2], grid.permute(0, 2, 3, 1).reshape(1, -1, self.dim)), dim=1)
        q, k, v = self.qkv(self.norm(t)).view(n, -1, 3, 2, self.dim // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, -1, self.dim)
        t = t + self.proj(a)
        half = self.dim // 2  # channel slices of prefixed tokens, concatenated back: local
        t = t + 0.5 * torch.cat((t[:, :, half:], t[..., :half]), dim=2)
        logits = (self.head(t[:, 0]) + self.head_dist(t[:, 1, :])) / 2
        image = t[:, 2:].transpose(1, 2).unflatten(2, (h // PATCH, w // PATCH))
        return logits, self.conv(image)


def _token_rows(rank_coords, layouts, grid_w, prefix):
    """Global token indices this rank holds: the prefix on the first rank, then its patch block."""
    rows = [sum(layouts[0][: rank_coords[0]]) // PATCH, sum(layouts[0][: rank_coords[0] + 1]) // PATCH]
    cols = (
        [0, grid_w]
        if len(layouts) == 1
        else [sum(layouts[1][: rank_coords[1]]) // PATCH, sum(layouts[1][: rank_coords[1] + 1]) // PATCH]
    )
    first = all(c == 0 for c in rank_coords)
    idx = list(range(prefix)) if first else []
    idx += [prefix + r * grid_w + c for r in range(*rows) for c in range(*cols)]
    return torch.tensor(idx)


def _parity(rank, world, kind, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    serial = DeiTish().double() if kind == "deit" else _vit(kind)
    if kind == "deit":
        torch.manual_seed(0)
        serial = DeiTish().double()
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    side = sum(layouts[0])
    tokens = _token_rows(coords, layouts, side // PATCH, 2 if kind == "deit" else 1)
    for step in range(2):
        x = torch.randn(2, 2, side, side, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        if kind == "deit":
            (ls, imgs), (lp, imgp) = serial(xs), parallel(xl)
            patches = [[s // PATCH for s in sizes] for sizes in layouts]  # the image at patch resolution
            plocal = lambda t: local_slice(t, dims, patches, coords)  # noqa: E731
            torch.testing.assert_close(imgp, plocal(imgs), **TIGHT)
            t_img = torch.randn(imgs.shape, dtype=torch.float64, generator=gen)
            extra_s = F.mse_loss(imgs, t_img)
            extra_p = tplayers.domain_mean(F.mse_loss(imgp, plocal(t_img), reduction="none"), mesh)
        else:
            out_s = serial(xs, interpolate_pos_encoding=True)
            out_p = parallel(xl, interpolate_pos_encoding=True)
            if kind == "vit_model":
                torch.testing.assert_close(out_p.last_hidden_state, out_s.last_hidden_state[:, tokens], **TIGHT)
                ls, lp = out_s.pooler_output, out_p.pooler_output
            else:
                ls, lp = out_s.logits, out_p.logits
            extra_s = extra_p = 0.0
        torch.testing.assert_close(lp, ls, **TIGHT)
        target = torch.randn(ls.shape, dtype=torch.float64, generator=gen)
        backward_step_match(
            F.mse_loss(ls, target) + extra_s,
            F.mse_loss(lp, target) + extra_p,
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


# 4 x 4 patches, pixel partitions of whole patch rows as the patch embedding partitions its output
# (balanced): 20 x 20 pixels at 2 ranks (5 patch rows: 3 + 2; the 5 x 5 position grid kept), 28 x 28 at
# 3 ranks (7 patch rows: 3 + 2 + 2; the grid interpolated to 7 x 7 as in the serial model)
@pytest.mark.parametrize("kind", ["vit_classification", "vit_model", "deit"])
def test_prefix_tokens_are_exact_at_2_and_3_ranks(kind):
    run_ranks(_parity, 2, args=(kind, (2,), [[12, 8]]), timeout=180)
    run_ranks(_parity, 3, args=(kind, (3,), [[12, 8, 8]]), timeout=180)


@pytest.mark.parametrize("kind", ["vit_classification", "deit"])
def test_prefix_tokens_are_exact_on_a_2x2_mesh(kind):
    run_ranks(_parity, 4, args=(kind, (2, 2), [[12, 8], [12, 8]]), timeout=240)


# equal shares: 24 x 24 pixels, 6 patch rows (3 + 3): the grid's size is the same on every rank and a local
# length the code read, so the F.interpolate alone cannot tell; the sum with the sharded tokens decides
@pytest.mark.parametrize("kind", ["vit_classification", "vit_model", "deit"])
def test_prefix_tokens_with_equal_patch_shares_are_exact(kind):
    run_ranks(_parity, 2, args=(kind, (2,), [[12, 12]]), timeout=180)


def test_prefix_tokens_with_equal_patch_shares_are_exact_on_a_2x2_mesh():
    run_ranks(_parity, 4, args=("vit_classification", (2, 2), [[12, 12], [12, 12]]), timeout=240)


# ------------------------------------------------------------------ refused
class GridUsedAlone(nn.Module):
    """A position grid resized to the local patch rows (equal shares) and then summed on its own: the two
    readings differ in value (a 6-row grid resized to 3 rows, or to 6 and sliced); refused."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(2, 4, PATCH, stride=PATCH)
        self.grid = nn.Parameter(torch.randn(1, 4, 6, 6, dtype=torch.float64))

    def forward(self, x):
        t = self.patch(x)
        g = F.interpolate(self.grid, size=(x.shape[2] // PATCH, x.shape[3] // PATCH), mode="bicubic")
        return t + g.sum()


def _grid_alone(rank, world):
    model = tplayers.parallelize_module(GridUsedAlone().double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(1, 2, 12, 24, dtype=torch.float64)  # 3 + 3 patch rows
    with pytest.raises(ValueError, match=r"this op cannot tell \(sum\)"):
        model(x)
    return True


def test_a_resized_grid_with_equal_shares_used_alone_raises_on_every_rank():
    run_ranks(_grid_alone, 2, timeout=120)


class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.patch = nn.Conv2d(2, 4, PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.randn(1, 1, 4, dtype=torch.float64))
        self.fn = fn

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        return self.fn(torch.cat((self.cls.expand(t.shape[0], -1, -1), t), dim=1))


def _refused(rank, world, fn, what):
    model = tplayers.parallelize_module(Op(fn).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 2, [12, 8][rank], 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=what) as err:
        model(x)
    assert "domain region" in str(err.value)
    return True


@pytest.mark.parametrize(
    "name,fn,what",
    [
        ("past the prefix", lambda t: t[:, 1], r"indexing the token dim 1, which holds 1 prefix token"),
        ("negative", lambda t: t[:, -1], r"indexing the token dim 1, which holds 1 prefix token"),
        ("causal", lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True), "attention with a mask"),
        ("merged", lambda t: t.flatten(0, 1), "merges the token dim holding prefix tokens"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v and len(v) < 20 else None,
)
def test_unsupported_uses_of_prefix_tokens_raise_on_every_rank(name, fn, what):
    run_ranks(_refused, 2, args=(fn, what), timeout=60)


# ------------------------------------------------------------------ full-size replicated operands
class TimmViTish(nn.Module):
    """timm's ViT pattern (``_pos_embed``): the CLS token concatenated first, then the full-size learned
    position table ``(1, 1 + N, D)`` added as it is; a learned full-size bias map ``(1, C, H, W)`` added
    to the pixels first; mean pooling over the patch tokens ``x[:, 1:]`` beside the CLS head."""

    def __init__(self, side=20, dim=8):
        super().__init__()
        n = (side // PATCH) ** 2
        self.bias_map = nn.Parameter(0.1 * torch.randn(1, 2, side, side))
        self.patch = nn.Conv2d(2, dim, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + n, dim))
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.head = nn.Linear(2 * dim, 3)

    def forward(self, x):
        n = x.shape[0]
        t = self.patch(x + self.bias_map).flatten(2).transpose(1, 2)
        t = torch.cat((self.cls_token.expand(n, -1, -1), t), dim=1) + self.pos_embed
        q, k, v = self.qkv(self.norm(t)).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        t = t + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return self.head(torch.cat((t[:, 0], t[:, 1:].mean(dim=1)), dim=-1))


def _monai_vit(flash=True):
    from monai.networks.nets import ViT

    torch.manual_seed(0)
    model = ViT(
        in_channels=2,
        img_size=(20, 20),
        patch_size=(PATCH, PATCH),
        hidden_size=16,
        mlp_dim=24,
        num_layers=2,
        num_heads=2,
        classification=True,
        num_classes=3,
        spatial_dims=2,
        dropout_rate=0.0,
    ).double()
    for block in model.blocks:  # its SDPA path, or its default einsum scores (keys and values gathered, CLS too)
        block.attn.use_flash_attention = flash
    return model


def _full_size(rank, world, kind, mesh_shape, layouts):
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
    coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
    dims = tuple(range(2, 2 + mesh.ndim))
    if kind.startswith("monai_vit"):
        require("monai")
        serial, call = _monai_vit(kind == "monai_vit"), lambda m, x: m(x)[0]  # noqa: E731
    else:
        torch.manual_seed(0)
        serial, call = TimmViTish().double(), lambda m, x: m(x)  # noqa: E731
    parallel = tplayers.parallelize_module(
        copy.deepcopy(serial), {"": tplayers.DomainParallel(shard_dims=dims)}, mesh=mesh
    )
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.05, momentum=0.9)
    local = lambda t: local_slice(t, dims, layouts, coords)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 2, 20, 20, dtype=torch.float64, generator=gen)
        xs, xl = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
        ys, yl = call(serial, xs), call(parallel, xl)
        torch.testing.assert_close(yl, ys, **TIGHT)
        target = torch.randn(ys.shape, dtype=torch.float64, generator=gen)
        backward_step_match(
            F.mse_loss(ys, target), F.mse_loss(yl, target), xs, xl, local, serial, parallel, opt_s, opt_p, **TIGHT
        )
    return True


# position tables at their global size: each rank takes its tokens' rows; any partition of whole patch rows
@pytest.mark.parametrize("kind", ["timm_vit", "monai_vit"])
def test_full_size_position_tables_are_sliced_and_exact(kind):
    run_ranks(_full_size, 2, args=(kind, (2,), [[12, 8]]), timeout=180)
    run_ranks(_full_size, 2, args=(kind, (2,), [[8, 12]]), timeout=180)
    run_ranks(_full_size, 4, args=(kind, (2, 2), [[12, 8], [8, 12]]), timeout=240)


def test_monai_vit_with_its_default_einsum_attention_is_exact():
    """MONAI's ViT (a CLS token) with its default einsum scores: keys and values gathered whole, the CLS token
    from the first rank (tplayers/region/rules_linalg.py), at 2 ranks and on 2x2 (pixels sharded over both
    mesh dims)."""
    run_ranks(_full_size, 2, args=("monai_vit_einsum", (2,), [[12, 8]]), timeout=180)
    run_ranks(_full_size, 2, args=("monai_vit_einsum", (2,), [[8, 12]]), timeout=180)
    run_ranks(_full_size, 4, args=("monai_vit_einsum", (2, 2), [[12, 8], [8, 12]]), timeout=240)


def _wrong_length(rank, world):
    fn = lambda t: t + torch.randn(1, 7, 4, dtype=t.dtype)  # noqa: E731 - 7 rows: neither 1 nor the 11 tokens
    model = tplayers.parallelize_module(Op(fn).double(), {"": tplayers.DomainParallel(shard_dims=(2,))})
    x = torch.randn(2, 2, [12, 8][rank], 8, dtype=torch.float64)  # 3 + 2 patch rows of 2: 1 + 6 and 4 tokens
    with pytest.raises(ValueError, match="a replicated operand of shape"):
        model(x)
    return True


def test_a_replicated_operand_of_neither_size_one_nor_the_global_length_raises_on_every_rank():
    run_ranks(_wrong_length, 2, timeout=60)
