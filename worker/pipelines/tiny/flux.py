"""Tiny FLUX.1 (FluxPipeline): CLIP-L pooled text and T5 tokens into a FLUX MMDiT with
embedded guidance, as in FLUX.1-dev, over FLUX's 16-channel VAE; and tiny FLUX.1 Kontext
(FluxKontextPipeline), the same architecture with its own weights, which reads an input image's
latents as extra tokens beside the ones it denoises.
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import CLIPTextModel, T5EncoderModel

from worker.pipelines.tiny.components import (
    CLIP_HIDDEN,
    FLUX_VAE_SCALING,
    FLUX_VAE_SHIFT,
    T5_HIDDEN,
    clip_config,
    kl_vae,
    seeded,
    t5_config,
)
from worker.pipelines.tiny.tokenizers import FLUX_T5_MAX_LENGTH, clip_tokenizer, t5_tokenizer

# FLUX.1's VAE latents; the pipeline packs each 2x2 patch into one token of 4x the channels.
FLUX_LATENT_CHANNELS = 16


def flux() -> FluxPipeline:
    return FluxPipeline(**_components(seed=31))


def flux_kontext() -> FluxKontextPipeline:
    """FLUX.1 Kontext [dev] is FLUX.1 [dev]'s architecture and scheduler (its transformer config
    differs only in weights): the input image's latents are concatenated along the sequence, so
    in_channels stay 64. Seeds of its own, as a checkpoint of its own."""
    return FluxKontextPipeline(**_components(seed=131))


def _components(seed: int) -> dict[str, Any]:
    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer(FLUX_T5_MAX_LENGTH)
    transformer = seeded(
        seed,
        lambda: FluxTransformer2DModel(
            # Patching is the pipeline's (_pack_latents), so the model sees 1x1 patches.
            patch_size=1,
            in_channels=4 * FLUX_LATENT_CHANNELS,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            # The pooled prompt is CLIPTextModel's pooler_output: the hidden size, not a projection.
            pooled_projection_dim=CLIP_HIDDEN,
            # FLUX.1-dev is guidance-distilled: guidance_scale goes in as an embedding.
            guidance_embeds=True,
            # (time, row, column) rope dims summing to the head dim, FLUX's 16:56:56 shrunk.
            axes_dims_rope=(4, 6, 6),
        ),
    )
    text_encoder = seeded(
        seed + 1, lambda: CLIPTextModel(clip_config(len(tokenizer), "quick_gelu"))
    )
    text_encoder_2 = seeded(seed + 2, lambda: T5EncoderModel(t5_config(tokenizer_2)))
    vae = seeded(
        seed + 3,
        lambda: kl_vae(FLUX_LATENT_CHANNELS, FLUX_VAE_SCALING, shift_factor=FLUX_VAE_SHIFT),
    )
    return {
        "scheduler": flux1_dev_scheduler(),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
    }


def flux1_dev_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json: the shift grows with the
    # image's token count (mu from base_shift at 256 tokens to max_shift at 4096).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
