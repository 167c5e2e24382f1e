"""Tiny random ControlNets for the tiny pipelines, saved as diffusers saves any ControlNet, so
per-job controls run end to end with no hub: <pipeline>/controlnets/<name>/.

diffusers zero-initialises a ControlNet's output layers (the "zero convolutions" and the
conditioning embedding's last conv), so a ControlNet built from a config changes nothing: those
layers get random weights here, and each tiny ControlNet visibly changes the image."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch
from diffusers import (
    ControlNetModel,
    ControlNetUnionModel,
    DiffusionPipeline,
    FluxControlNetModel,
    QwenImageControlNetModel,
    SD3ControlNetModel,
    ZImageControlNetModel,
)

from worker.pipelines.families import FamilySpec
from worker.pipelines.tiny.components import seeded

# The layers diffusers zero-initialises, by name prefix: SD's zero convs and conditioning
# embedding's last conv (SDXL union's too, and its projection of the control features); the
# transformers' per-block output projections and the control latents' embedders (FLUX.1,
# SD3, Qwen-Image).
ZERO_INITIALISED: Final = (
    "controlnet_down_blocks.",
    "controlnet_mid_block.",
    "controlnet_cond_embedding.conv_out.",
    "spatial_ch_projs.",
    "controlnet_blocks.",
    "controlnet_single_blocks.",
    "controlnet_x_embedder.",
    "pos_embed_input.",
)
# Z-Image's are inside each control block: its projections in (before_proj) and out (after_proj).
ZERO_INITIALISED_IN_BLOCKS: Final = ("control_layers.", (".before_proj.", ".after_proj."))


def _sd(pipe: Any) -> ControlNetModel:
    # Four conditioning channels widths: the control image goes down 8x to the latents' size.
    return ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=(8, 8, 16, 16))


def _sdxl_union(pipe: Any) -> ControlNetUnionModel:
    """xinsir's union layout on the tiny UNet's encoder half. Not from_unet: it leaves the control
    features' width (num_trans_channel, num_proj_channel) at the real 320, and they are added to
    the conditioning embedding, which is block_out_channels[0] wide."""
    unet = pipe.unet
    keys = ControlNetUnionModel._get_init_keys(ControlNetUnionModel)
    width = unet.config.block_out_channels[0]
    model = ControlNetUnionModel(
        **{k: v for k, v in unet.config.items() if k in keys},
        conditioning_embedding_out_channels=(8, 8, 16, 16),
        num_trans_channel=width,
        num_trans_head=2,
        num_trans_layer=1,
        num_proj_channel=width,
    )
    # The encoder starts as the UNet's, as a ControlNet trained from it does (the blocks'
    # ControlNet-only layers are not in the UNet: strict=False).
    model.conv_in.load_state_dict(unet.conv_in.state_dict())
    model.time_embedding.load_state_dict(unet.time_embedding.state_dict())
    model.add_embedding.load_state_dict(unet.add_embedding.state_dict())
    model.down_blocks.load_state_dict(unet.down_blocks.state_dict(), strict=False)
    model.mid_block.load_state_dict(unet.mid_block.state_dict(), strict=False)
    return model


def _flux(pipe: Any) -> FluxControlNetModel:
    """InstantX's layout (no input hint block: the control image is VAE-encoded), one double
    and one single block, the tiny transformer's sizes."""
    config = pipe.transformer.config
    return FluxControlNetModel(
        patch_size=config.patch_size,
        in_channels=config.in_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.joint_attention_dim,
        pooled_projection_dim=config.pooled_projection_dim,
        guidance_embeds=config.guidance_embeds,
        axes_dims_rope=config.axes_dims_rope,
    )


def _sd3(pipe: Any) -> SD3ControlNetModel:
    """InstantX's and Stability's layout: one block, the control latents the VAE's 16 channels.
    Not from_transformer: it writes num_layers into the transformer's own config, and its default
    extra conditioning channel makes a 17-channel input the pipeline never feeds."""
    return _from_transformer(
        SD3ControlNetModel,
        pipe.transformer,
        ("pos_embed", "time_text_embed", "context_embedder"),
        num_layers=1,
        extra_conditioning_channels=0,
    )


def _qwenimage(pipe: Any) -> QwenImageControlNetModel:
    """InstantX's layout, one block. Not from_transformer: its head sizes default to the real
    model's (24 heads of 128), and it hands the ControlNet the transformer's whole config, whose
    guidance_embeds the ControlNet then warns of at every load."""
    return _from_transformer(
        QwenImageControlNetModel,
        pipe.transformer,
        ("time_text_embed", "img_in", "txt_in"),
        num_layers=1,
    )


def _from_transformer(cls: Any, transformer: Any, parts: tuple[str, ...], **config: Any) -> Any:
    """cls on the transformer's sizes (its config as cls takes it, with config's changes), its
    embedders (parts) and first blocks starting as the transformer's, as a ControlNet trained from
    it does (the blocks' ControlNet-only layers are not in the transformer: strict=False)."""
    keys = cls._get_init_keys(cls)
    model = cls(**{k: v for k, v in transformer.config.items() if k in keys} | config)
    for part in parts:
        getattr(model, part).load_state_dict(getattr(transformer, part).state_dict())
    blocks = transformer.transformer_blocks.state_dict()
    model.transformer_blocks.load_state_dict(blocks, strict=False)
    return model


def _zimage(pipe: Any) -> ZImageControlNetModel:
    """The control branch only, as alibaba-pai's Fun ControlNet ships it: ZImageControlNetPipeline
    lends it the transformer's embedders and refiners when it is built (from_transformer), so the
    model is saved before any such pipeline exists. A control block beside each of the tiny
    transformer's two layers; the control latents are the VAE's 16 channels."""
    config = pipe.transformer.config
    return ZImageControlNetModel(
        control_layers_places=list(range(config.n_layers)),
        control_in_dim=config.in_channels,
        all_patch_size=tuple(config.all_patch_size),
        all_f_patch_size=tuple(config.all_f_patch_size),
        dim=config.dim,
        n_refiner_layers=config.n_refiner_layers,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        norm_eps=config.norm_eps,
        qk_norm=config.qk_norm,
    )


# A ControlNet model class (ControlFamily.model_class) -> its tiny ControlNet on a tiny pipeline.
BUILDERS: Final[dict[str, Callable[[Any], Any]]] = {
    "ControlNetModel": _sd,
    "ControlNetUnionModel": _sdxl_union,
    "FluxControlNetModel": _flux,
    "SD3ControlNetModel": _sd3,
    "QwenImageControlNetModel": _qwenimage,
    "ZImageControlNetModel": _zimage,
}


def save_tiny_controlnets(pipe: DiffusionPipeline, spec: FamilySpec, directory: Path) -> None:
    """Write each of the spec's tiny ControlNets (TinyModel.controlnets: name -> seed) under
    directory/<name>/, built for its ControlFamily's model class; none where it has none."""
    if spec.tiny is None or not spec.tiny.controlnets or spec.control is None:
        return
    model_class = spec.control.model_class
    if model_class not in BUILDERS:
        raise ValueError(
            f"tiny {spec.tiny.name}: no tiny ControlNet builder for {model_class}; known:"
            f" {', '.join(sorted(BUILDERS))}"
        )
    for name, seed in spec.tiny.controlnets.items():
        model = seeded(seed, lambda: randomised(BUILDERS[model_class](pipe)))
        model.save_pretrained(directory / name, safe_serialization=True)


def _zero_initialised(name: str) -> bool:
    block, parts = ZERO_INITIALISED_IN_BLOCKS
    if name.startswith(ZERO_INITIALISED):
        return True
    return name.startswith(block) and any(part in name for part in parts)


def randomised(model: Any) -> Any:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if _zero_initialised(name):
                parameter.normal_(0.0, 0.2)
    return model
