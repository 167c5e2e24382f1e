"""Tiny Z-Image (ZImagePipeline): Qwen3's second-to-last hidden states, one unpadded sequence
a prompt, into the Z-Image single-stream DiT, over FLUX.1's 16-channel VAE.
"""

from __future__ import annotations

from typing import Final

from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import Qwen3Model

from worker.pipelines.tiny.components import (
    FLUX_VAE_SCALING,
    FLUX_VAE_SHIFT,
    QWEN_HIDDEN,
    kl_vae,
    qwen3_config,
    seeded,
)
from worker.pipelines.tiny.tokenizers import qwen3_tokenizer

ZIMAGE_LATENT_CHANNELS: Final = 16


def zimage() -> ZImagePipeline:
    tokenizer = qwen3_tokenizer()
    transformer = seeded(
        71,
        lambda: ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=ZIMAGE_LATENT_CHANNELS,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=QWEN_HIDDEN,
            rope_theta=256.0,
            t_scale=1000.0,
            # (caption/frame, row, column) rope dims summing to the head dim, the real 32:48:48
            # shrunk. The first axis' 1024 positions hold a 512-token caption and the image
            # after it; 512 rows and columns of 2x2 patches are 8192 px.
            axes_dims=[4, 6, 6],
            axes_lens=[1024, 512, 512],
        ),
    )
    # hidden_states[-2] is what the pipeline reads, so two layers put a real layer behind it.
    text_encoder = seeded(72, lambda: Qwen3Model(qwen3_config(tokenizer, num_layers=2)))
    vae = seeded(
        73,
        lambda: kl_vae(ZIMAGE_LATENT_CHANNELS, FLUX_VAE_SCALING, shift_factor=FLUX_VAE_SHIFT),
    )
    return ZImagePipeline(
        scheduler=_zimage_turbo_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _zimage_turbo_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a static shift of 3; the
    # pipeline always passes a resolution mu, which the scheduler ignores without dynamic
    # shifting.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
    )
