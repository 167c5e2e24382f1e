"""What differs between model families: the pipeline class, prompt encoding, latent decoding.

Rendering runs in three calls (encode, denoise to latents, decode) instead of one pipeline call
so each phase is timed, fault-injected and retried on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

Embeds = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FamilySpec:
    """How kiln renders one family (api_client.manifest.Family names them)."""

    pipeline_class: str  # attribute of the diffusers package
    encode: Callable[[Any, torch.device, str, str, int, bool], Embeds]
    decode: Callable[[Any, torch.Tensor], list[Image.Image]]
    fp16_safe: bool = True  # sd3 and flux overflow in fp16; they run bf16 or fp32
    denoiser: str = "unet"


def _encode_sd15(
    pipe: Any, device: torch.device, prompt: str, negative: str, count: int, cfg: bool
) -> Embeds:
    positive, negative_embeds = pipe.encode_prompt(
        prompt, device, count, cfg, negative_prompt=negative or None
    )
    embeds = {"prompt_embeds": positive}
    if cfg:
        embeds["negative_prompt_embeds"] = negative_embeds
    return embeds


def _encode_pooled(
    pipe: Any, device: torch.device, prompt: str, negative: str, count: int, cfg: bool
) -> Embeds:
    """sdxl and sd3 return (embeds, negative, pooled, negative pooled)."""
    positive, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
        prompt=prompt,
        device=device,
        num_images_per_prompt=count,
        do_classifier_free_guidance=cfg,
        negative_prompt=negative or None,
        **(
            {"prompt_2": None, "prompt_3": None}
            if hasattr(pipe, "tokenizer_3")
            else {"prompt_2": None}
        ),
    )
    embeds = {"prompt_embeds": positive, "pooled_prompt_embeds": pooled}
    if cfg:
        embeds["negative_prompt_embeds"] = negative_embeds
        embeds["negative_pooled_prompt_embeds"] = negative_pooled
    return embeds


def _vae_device(vae: Any) -> torch.device:
    return torch.device(next(iter(vae.parameters())).device)


def _decode_sd15(pipe: Any, latents: torch.Tensor) -> list[Image.Image]:
    vae = pipe.vae
    latents = latents.to(_vae_device(vae), vae.dtype) / vae.config.scaling_factor
    image = vae.decode(latents, return_dict=False)[0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def _decode_sdxl(pipe: Any, latents: torch.Tensor) -> list[Image.Image]:
    vae = pipe.vae
    # The SDXL VAE overflows in fp16 unless its config says otherwise; decode in fp32 then.
    upcast = vae.dtype == torch.float16 and vae.config.force_upcast
    if upcast:
        pipe.upcast_vae()
    try:
        latents = latents.to(_vae_device(vae), next(iter(vae.post_quant_conv.parameters())).dtype)
        mean, std = (
            getattr(vae.config, "latents_mean", None),
            getattr(vae.config, "latents_std", None),
        )
        if mean is not None and std is not None:
            mean_t = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std_t = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std_t / vae.config.scaling_factor + mean_t
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
    finally:
        if upcast:
            vae.to(dtype=torch.float16)
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def _decode_sd3(pipe: Any, latents: torch.Tensor) -> list[Image.Image]:
    vae = pipe.vae
    latents = latents.to(_vae_device(vae), vae.dtype)
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(latents, return_dict=False)[0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def decode_preview(pipe: Any, taesd: Any, latents: torch.Tensor) -> Image.Image:
    """The first image of the batch through TAESD, in the latent space its config describes."""
    latents = latents[:1].to(_vae_device(taesd), taesd.dtype)
    latents = latents / taesd.config.scaling_factor + taesd.config.shift_factor
    image = taesd.decode(latents, return_dict=False)[0]
    previews: list[Image.Image] = pipe.image_processor.postprocess(image, output_type="pil")
    return previews[0]


SPECS: dict[str, FamilySpec] = {
    "sd15": FamilySpec("StableDiffusionPipeline", _encode_sd15, _decode_sd15),
    "sd2": FamilySpec("StableDiffusionPipeline", _encode_sd15, _decode_sd15),
    "sdxl": FamilySpec("StableDiffusionXLPipeline", _encode_pooled, _decode_sdxl),
    "sd3": FamilySpec(
        "StableDiffusion3Pipeline",
        _encode_pooled,
        _decode_sd3,
        fp16_safe=False,
        denoiser="transformer",
    ),
}


def spec_of(name: str) -> FamilySpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(
            f"family {name!r} has no renderer in this worker; supported: {', '.join(sorted(SPECS))}"
        ) from None
