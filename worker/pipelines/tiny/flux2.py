"""Tiny FLUX.2 klein (Flux2KleinPipeline): Qwen3 hidden states from three layers into a FLUX.2
MMDiT, over FLUX.2's 32-channel VAE with its batch-norm latent statistics.
"""

from __future__ import annotations

from typing import Final

import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3ForCausalLM

from worker.pipelines.tiny.components import (
    LATENT_SIZE,
    QWEN_HIDDEN,
    VAE_CHANNELS,
    VAE_GROUPS,
    qwen3_config,
    seeded,
)
from worker.pipelines.tiny.flux import flux1_dev_scheduler
from worker.pipelines.tiny.tokenizers import qwen3_tokenizer

FLUX2_LATENT_CHANNELS: Final = 32
# Flux2KleinPipeline stacks hidden_states[9], [18] and [27] by default; 28 layers is the fewest
# that keep all three inside the stack, as they are in Qwen3-4B's 36.
_TEXT_LAYERS: Final = (9, 18, 27)


def flux2() -> Flux2KleinPipeline:
    tokenizer = qwen3_tokenizer()
    transformer = seeded(
        51,
        lambda: Flux2Transformer2DModel(
            # The VAE patchifies 2x2 (4x the channels) and the pipeline packs; the model sees 1x1.
            patch_size=1,
            in_channels=4 * FLUX2_LATENT_CHANNELS,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=len(_TEXT_LAYERS) * QWEN_HIDDEN,
            timestep_guidance_channels=256,
            mlp_ratio=3.0,
            # (time, row, column, layer) rope dims summing to the head dim; klein's theta.
            axes_dims_rope=(4, 4, 4, 4),
            rope_theta=2000,
            eps=1e-6,
            # klein is not guidance-embedded: its guidance is classifier-free, or none if distilled.
            guidance_embeds=False,
        ),
    )
    text_encoder = seeded(
        52, lambda: Qwen3ForCausalLM(qwen3_config(tokenizer, _TEXT_LAYERS[-1] + 1))
    )
    vae = seeded(53, _flux2_vae)
    return Flux2KleinPipeline(
        # diffusers' scripts/convert_flux2_to_diffusers.py gives FLUX.2 FLUX.1-dev's scheduler
        # config; klein is taken to ship the same. The pipeline passes its own empirical mu
        # (compute_empirical_mu), so base/max_shift go unread.
        scheduler=flux1_dev_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        # klein base (not the step-distilled klein): guidance_scale > 1 runs classifier-free
        # guidance against the empty prompt, = 1 runs the conditional pass alone.
        is_distilled=False,
    )


def _flux2_vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=FLUX2_LATENT_CHANNELS,
        norm_num_groups=VAE_GROUPS,
        sample_size=LATENT_SIZE * 8,
    )
    # The pipeline un-normalises latents with the VAE's batch-norm running statistics before
    # decoding; fresh ones (mean 0, var 1) would let a decoder that skips that step pass.
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae
