"""Tiny LTX-Video 0.9.1 (LTXPipeline, and LTXImageToVideoPipeline from the same modules): T5
prompt tokens into one LTX-Video DiT over the 32x spatial, 8x temporal VAE (frames 8k+1), whose
decoder is conditioned on a decode timestep (decode_timestep, decode_noise_scale).

The real shapes come from diffusers' scripts/convert_ltx_to_diffusers.py (get_vae_config
"0.9.1", its scheduler and TOKENIZER_MAX_LENGTH); the transformer's tiny size follows diffusers'
tests/pipelines/ltx/test_ltx.py (one layer). Unlike 0.9.1, the decoder injects no noise: its
resnets draw that noise from torch's global generator (vae.decode takes none), so renders would
not repeat from a seed.
"""

from __future__ import annotations

from typing import Final

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from transformers import T5EncoderModel

from worker.pipelines.tiny.components import T5_HIDDEN, seeded, t5_config
from worker.pipelines.tiny.tokenizers import t5_tokenizer

# LTX-Video's 128 latent channels, as the real VAE has them (previews read them through ComfyUI's
# 128-row table, worker.pipelines.latent_preview); the transformer reads them unpatched (patch 1).
LTX_LATENT_CHANNELS: Final = 128
# LTXPipeline's max_sequence_length and the real tokenizer's model_max_length.
LTX_T5_MAX_LENGTH: Final = 128


def ltx() -> LTXPipeline:
    tokenizer = t5_tokenizer(LTX_T5_MAX_LENGTH)
    return LTXPipeline(
        scheduler=ltx_scheduler(),
        vae=seeded(83, _ltx091_vae),
        text_encoder=seeded(82, lambda: T5EncoderModel(t5_config(tokenizer))),
        tokenizer=tokenizer,
        transformer=seeded(81, _transformer),
    )


def _transformer() -> LTXVideoTransformer3DModel:
    # 32 heads of 64 shrunk; cross-attention reads the captions after their projection to the
    # transformer's width, so cross_attention_dim is heads x head dim, as 2048 is in the real one.
    heads, head_dim = 2, 8
    return LTXVideoTransformer3DModel(
        in_channels=LTX_LATENT_CHANNELS,
        out_channels=LTX_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim,
        num_layers=2,  # two blocks: First Block Cache needs a block after its first
        caption_channels=T5_HIDDEN,
    )


def _ltx091_vae() -> AutoencoderKLLTXVideo:
    """0.9.1's VAE with its levels and width ratios at a few channels a level (encoder 128, 256,
    512, 512 and decoder 256, 512, 1024 in the real one): 4x4 pixel patches then three 2x
    spatio-temporal levels (32x, 8x). Each decoder level's residual upsampler halves the width,
    so the widths must double level by level, or an up block needs a channel-changing resnet,
    which diffusers hands the raw (unembedded) timestep and fails."""
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=LTX_LATENT_CHANNELS,
        block_out_channels=(8, 16, 32, 32),
        decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        timestep_conditioning=True,
        patch_size=4,
        patch_size_t=1,
        scaling_factor=1.0,
        encoder_causal=True,
        decoder_causal=False,
    )
    # Per-channel statistics are buffers of the checkpoint; spread away from 0 and 1 so a decode
    # that skips the denormalisation reads wrong.
    with torch.no_grad():
        vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, LTX_LATENT_CHANNELS))
        vae.latents_std.copy_(torch.linspace(0.5, 2.0, LTX_LATENT_CHANNELS))
    return vae


def ltx_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # convert_ltx_to_diffusers.py's: the shift grows with the latent token count, and the
    # schedule ends at sigma 0.1 before the last step to 0 (shift_terminal).
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
