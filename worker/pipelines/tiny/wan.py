"""Tiny Wan 2.2 TI2V-5B (WanPipeline, and WanImageToVideoPipeline from the same modules): umT5
prompt tokens into one Wan DiT that denoises Wan 2.2's 48-channel, 16x-compressed latents, with
per-token timesteps (expand_timesteps) so an input image's latents can hold the first frame clean.

The real model's shapes come from diffusers' scripts/convert_wan_to_diffusers.py
("Wan2.2-TI2V-5B" and vae22_diffusers_config); the tiny sizes follow diffusers'
tests/pipelines/wan/test_wan_22_image_to_video.py (Wan225BImageToVideoPipelineFastTests).
TI2V has no CLIP image encoder and no second (low-noise) transformer, so image_encoder,
image_processor and transformer_2 stay None and from_pipe serves image-to-video as it is.
"""

from __future__ import annotations

from typing import Final

import torch
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from worker.pipelines.tiny.components import seeded, t5_config
from worker.pipelines.tiny.tokenizers import umt5_tokenizer

# Wan 2.2's VAE: 48 latent channels; 2x2 pixel patches then three 2x downsamples make 16x
# spatially, two causal 2x temporal downsamples 4x (frames 4k+1).
WAN22_LATENT_CHANNELS: Final = 48
# umT5-XXL's 4096 shrunk; the DiT's text_dim must equal it.
UMT5_HIDDEN: Final = 32


def wan() -> WanPipeline:
    tokenizer = umt5_tokenizer()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(72, lambda: UMT5EncoderModel(_umt5_config(tokenizer))),
        vae=seeded(73, _wan22_vae),
        scheduler=wan22_ti2v_scheduler(),
        transformer=seeded(71, _transformer),
        # TI2V-5B denoises each latent token at its own timestep, so the image-to-video
        # pipeline can keep the first frame's tokens at t=0 (WanPipeline's txt2video sets all).
        expand_timesteps=True,
    )


def _transformer() -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        # TI2V-5B's 24 heads of 128 shrunk to diffusers' test size; a head of 12 splits into
        # (time, row, column) rope dims of 4 each.
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=WAN22_LATENT_CHANNELS,
        out_channels=WAN22_LATENT_CHANNELS,
        text_dim=UMT5_HIDDEN,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )


def _wan22_vae() -> AutoencoderKLWan:
    """Wan 2.2's residual VAE with its real levels and channel ratios (base 160, decoder 256,
    multipliers 1, 2, 4, 4) at a few channels a level."""
    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=WAN22_LATENT_CHANNELS,
        # 2x2 patches of RGB in and out: 12 channels.
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        # Spread away from 0 and 1 so a decode that skips the denormalisation reads wrong.
        latents_mean=_spread(WAN22_LATENT_CHANNELS, -0.3, 0.3),
        latents_std=_spread(WAN22_LATENT_CHANNELS, 0.5, 2.0),
    )


def _spread(count: int, low: float, high: float) -> list[float]:
    # Rounded, so config.json reads as the numbers written here.
    return [round(v, 4) for v in torch.linspace(low, high, count).tolist()]


def _umt5_config(tokenizer: T5Tokenizer) -> UMT5Config:
    """umT5-XXL's shape (gated GELU, a relative position bias in every layer), shrunk."""
    config: UMT5Config = t5_config(tokenizer, UMT5Config, d_model=UMT5_HIDDEN, d_kv=8, d_ff=64)
    return config


def wan22_ti2v_scheduler() -> UniPCMultistepScheduler:
    # convert_wan_to_diffusers.py: UniPC on flow sigmas, shift 5.0 for TI2V (3.0 for Wan 2.1
    # T2V, 16.0 for FLF2V).
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=5.0,
    )
