"""The model zoo (issue 31): third-party vision models at tiny configs, random init, no downloads, each
built the same way on every rank (seeded) in fp64, with how to call it and what its output is.

``ZOO[name] = Entry(package, build, side, out)``: ``build()`` returns the serial model, ``side`` the
image's height and width (every rank's share of it a multiple of the model's total stride at 2 ranks
and on a 2x2 mesh), ``out`` what ``call`` returns: ``"image"`` (per-pixel output at the input's
resolution, sharded like it) or ``"vector"`` (pooled logits, the same on every rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class Entry:
    package: str
    build: Callable[[], torch.nn.Module]
    side: int
    out: str  # "image" | "vector"
    call: Callable = staticmethod(lambda m, x: m(x))
    channels: int = 3
    meshes: tuple = ((2,), (2, 2))  # the meshes it is exact on (the others: tests say why)


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        return fn().double()

    return build


def _timm(name, **kw):
    def fn():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=3, **kw)

    return _seeded(fn)


def _checkpointed(build):
    """``build``'s model with its own activation checkpointing switched on (timm's
    ``set_grad_checkpointing()``): every block recomputed in backward, inside the region."""

    def fn():
        model = build()
        model.set_grad_checkpointing(True)
        return model

    return fn


def _smp(arch, **kw):
    def fn():
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)("tu-test_resnet", encoder_weights=None, classes=2, **kw)

    return _seeded(fn)


def _diffusers_unet(attention):
    def fn():
        from diffusers import UNet2DModel

        return UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("DownBlock2D", "AttnDownBlock2D" if attention else "DownBlock2D"),
            up_block_types=("AttnUpBlock2D" if attention else "UpBlock2D", "UpBlock2D"),
            add_attention=attention,
            attention_head_dim=8,
            norm_num_groups=4,
        )

    return _seeded(fn)


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )


def _vq():
    from diffusers import VQModel

    return VQModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        num_vq_embeddings=16,
        norm_num_groups=4,
        sample_size=16,
    )


def _monai(name, **kw):
    def fn():
        import monai.networks.nets as nets

        return getattr(nets, name)(**kw)

    return _seeded(fn)


def _unetr(flash=True):
    """MONAI's UNETR (2-D, patch 16, its 12-layer ViT), its blocks' attention through SDPA (``flash``: routed
    to the full-attention core) or its default einsum scores (keys and values gathered whole)."""
    from monai.networks.nets import UNETR

    model = UNETR(
        in_channels=3,
        out_channels=2,
        img_size=(64, 64),
        feature_size=4,
        hidden_size=16,
        mlp_dim=16,
        num_heads=2,
        spatial_dims=2,
    )
    for block in model.vit.blocks:
        block.attn.use_flash_attention = flash
    return model


def _hf(config_name, model_name, sdpa=False, **kw):
    def fn():
        import transformers

        config = getattr(transformers, config_name)(**kw)
        if sdpa:
            config._attn_implementation = "sdpa"
        return getattr(transformers, model_name)(config)

    return _seeded(fn)


def _t(x, *_):
    return x


_VIT = _hf(
    "ViTConfig",
    "ViTForImageClassification",
    sdpa=True,
    image_size=32,
    patch_size=4,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=24,
    num_labels=3,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)

ZOO = {
    # timm: its own test-sized models and tiny configs of real families
    "timm test_resnet": Entry("timm", _timm("test_resnet"), 64, "vector"),
    "timm test_efficientnet": Entry("timm", _timm("test_efficientnet"), 64, "vector"),
    "timm test_convnext": Entry("timm", _timm("test_convnext"), 64, "vector"),
    "timm test_nfnet": Entry("timm", _timm("test_nfnet"), 64, "vector"),
    "timm test_byobnet": Entry("timm", _timm("test_byobnet"), 64, "vector"),
    "timm tf_efficientnet_b0": Entry("timm", _timm("tf_efficientnet_b0"), 64, "vector"),
    "timm nf_resnet26": Entry("timm", _timm("nf_resnet26"), 64, "vector"),
    "timm mobilenetv3_small_050": Entry("timm", _timm("mobilenetv3_small_050"), 64, "vector"),
    "timm regnetx_002": Entry("timm", _timm("regnetx_002"), 64, "vector"),
    "timm ghostnet_050": Entry("timm", _timm("ghostnet_050"), 64, "vector"),
    "timm densenet121": Entry("timm", _timm("densenet121"), 64, "vector"),
    "timm test_efficientnet (checkpointing)": Entry("timm", _checkpointed(_timm("test_efficientnet")), 64, "vector"),
    "timm test_resnet (checkpointing)": Entry("timm", _checkpointed(_timm("test_resnet")), 64, "vector"),
    "timm test_convnext (checkpointing)": Entry("timm", _checkpointed(_timm("test_convnext")), 64, "vector"),
    "timm test_vit": Entry("timm", _timm("test_vit", img_size=32, patch_size=4), 32, "vector"),
    # segmentation_models_pytorch on timm's tiny ResNet encoder
    "smp Unet": Entry("smp", _smp("Unet", encoder_depth=4, decoder_channels=(16, 8, 8, 8)), 64, "image"),
    "smp UnetPlusPlus": Entry(
        "smp", _smp("UnetPlusPlus", encoder_depth=4, decoder_channels=(16, 8, 8, 8)), 64, "image"
    ),
    "smp FPN": Entry(
        "smp", _smp("FPN", encoder_depth=4, decoder_pyramid_channels=32, decoder_segmentation_channels=32), 64, "image"
    ),
    "smp DeepLabV3": Entry("smp", _smp("DeepLabV3", encoder_depth=4, decoder_channels=8), 64, "image"),
    "smp DeepLabV3Plus": Entry("smp", _smp("DeepLabV3Plus", encoder_depth=4, decoder_channels=8), 64, "image"),
    "smp Linknet": Entry("smp", _smp("Linknet", encoder_depth=4), 64, "image"),
    "smp PSPNet": Entry("smp", _smp("PSPNet", encoder_depth=3, psp_out_channels=8), 64, "image"),
    "smp PAN": Entry("smp", _smp("PAN", decoder_channels=8), 128, "image"),
    # its position attention's (B, HW, C) -> (B, C, H, W) reshape: channels sharded, realigned at 2 ranks; on
    # 2x2 refused (test_guard_eager_attention.py)
    "smp MAnet": Entry(
        "smp", _smp("MAnet", encoder_depth=4, decoder_channels=(16, 8, 8, 8)), 64, "image", meshes=((2,),)
    ),
    # diffusers
    "diffusers UNet2DModel": Entry("diffusers", _diffusers_unet(False), 32, "image", lambda m, x: m(x, 3).sample),
    "diffusers UNet2DModel (attention)": Entry(
        "diffusers", _diffusers_unet(True), 32, "image", lambda m, x: m(x, 3).sample
    ),
    "diffusers AutoencoderKL": Entry("diffusers", _seeded(_vae), 32, "image", lambda m, x: m(x).sample),
    "diffusers VQModel": Entry("diffusers", _seeded(_vq), 32, "image", lambda m, x: m(x).sample),
    # MONAI (2-D)
    "monai UNet": Entry(
        "monai",
        _monai(
            "UNet", spatial_dims=2, in_channels=3, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1
        ),
        32,
        "image",
    ),
    "monai BasicUNet": Entry(
        "monai",
        _monai("BasicUNet", spatial_dims=2, in_channels=3, out_channels=2, features=(4, 4, 8, 8, 16, 4)),
        32,
        "image",
    ),
    "monai DynUNet": Entry(
        "monai",
        _monai(
            "DynUNet",
            spatial_dims=2,
            in_channels=3,
            out_channels=2,
            kernel_size=(3, 3, 3),
            strides=(1, 2, 2),
            upsample_kernel_size=(2, 2),
            filters=(4, 8, 16),
        ),
        32,
        "image",
    ),
    "monai SegResNet": Entry(
        "monai", _monai("SegResNet", spatial_dims=2, in_channels=3, out_channels=2, init_filters=8), 32, "image"
    ),
    "monai AttentionUnet": Entry(
        "monai",
        _monai("AttentionUnet", spatial_dims=2, in_channels=3, out_channels=2, channels=(4, 8, 16), strides=(2, 2)),
        32,
        "image",
    ),
    "monai UNETR": Entry("monai", _seeded(_unetr), 64, "image"),
    "monai UNETR (einsum attention)": Entry("monai", _seeded(lambda: _unetr(flash=False)), 64, "image"),
    # transformers (vision)
    "transformers ResNetForImageClassification": Entry(
        "transformers",
        _hf(
            "ResNetConfig",
            "ResNetForImageClassification",
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_labels=3,
        ),
        32,
        "vector",
        lambda m, x: m(x).logits,
    ),
    "transformers ConvNextForImageClassification": Entry(
        "transformers",
        _hf(
            "ConvNextConfig",
            "ConvNextForImageClassification",
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_labels=3,
        ),
        32,
        "vector",
        lambda m, x: m(x).logits,
    ),
    "transformers SegformerForSemanticSegmentation": Entry(
        "transformers",
        _hf(
            "SegformerConfig",
            "SegformerForSemanticSegmentation",
            sdpa=True,
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[8, 16],
            num_attention_heads=[1, 2],
            decoder_hidden_size=16,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
            drop_path_rate=0.0,
        ),
        32,
        "image",
        lambda m, x: m(x).logits,
    ),
    "transformers ViTForImageClassification": Entry(
        "transformers",
        _VIT,
        32,
        "vector",
        lambda m, x: m(x, interpolate_pos_encoding=True).logits,
    ),
    "transformers ViTForImageClassification (fixed size)": Entry(
        "transformers",
        _VIT,
        32,
        "vector",
        lambda m, x: m(x).logits,
    ),
}
