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
from diffusers import ControlNetModel, DiffusionPipeline, FluxControlNetModel

from worker.pipelines.tiny.components import seeded

# The layers diffusers zero-initialises, by name prefix: SD's zero convs and conditioning
# embedding's last conv; FLUX's per-block output projections and the control image's embedder.
ZERO_INITIALISED: Final = (
    "controlnet_down_blocks.",
    "controlnet_mid_block.",
    "controlnet_cond_embedding.conv_out.",
    "controlnet_blocks.",
    "controlnet_single_blocks.",
    "controlnet_x_embedder.",
)


def _sd(pipe: Any) -> ControlNetModel:
    # Four conditioning channels widths: the control image goes down 8x to the latents' size.
    return ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=(8, 8, 16, 16))


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


# family -> (ControlNet builder, {name: seed}): tiny-sd15 has two, so a job can stack them.
TINY_CONTROLNETS: Final[dict[str, tuple[Callable[[Any], Any], dict[str, int]]]] = {
    "sd15": (_sd, {"canny": 61, "depth": 62}),
    "flux": (_flux, {"canny": 63}),
}


def save_tiny_controlnets(pipe: DiffusionPipeline, family: str, directory: Path) -> None:
    """Write each of the family's tiny ControlNets under directory/<name>/ (none for others)."""
    if family not in TINY_CONTROLNETS:
        return
    build, seeds = TINY_CONTROLNETS[family]
    for name, seed in seeds.items():
        model = seeded(seed, lambda: _randomised(build(pipe)))
        model.save_pretrained(directory / name, safe_serialization=True)


def _randomised(model: Any) -> Any:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(ZERO_INITIALISED):
                parameter.normal_(0.0, 0.2)
    return model
