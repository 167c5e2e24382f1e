"""Tiny sd15, sdxl and sd3: the Stable Diffusion families, UNet (1.5, XL) and MMDiT (3).

Seeds and configs here fix the weights kiln's tests were written against; change them only
with a BUILDER_VERSION bump.
"""

from __future__ import annotations

from diffusers import (
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

from worker.pipelines.tiny.components import (
    CLIP_HIDDEN,
    CLIP_PROJECTION,
    LATENT_SIZE,
    T5_HIDDEN,
    clip_config,
    kl_vae,
    seeded,
    t5_config,
)
from worker.pipelines.tiny.tokenizers import clip_tokenizer, t5_tokenizer


def sd15() -> StableDiffusionPipeline:
    tokenizer = clip_tokenizer()
    unet = seeded(
        1,
        lambda: UNet2DConditionModel(
            sample_size=LATENT_SIZE,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=CLIP_HIDDEN,
            attention_head_dim=8,
            norm_num_groups=8,
        ),
    )
    text_encoder = seeded(2, lambda: CLIPTextModel(clip_config(len(tokenizer), "quick_gelu")))
    vae = seeded(3, lambda: kl_vae(latent_channels=4, scaling_factor=0.18215))
    # SD 1.5's own scheduler config (PNDM with PLMS only).
    scheduler = PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        skip_prk_steps=True,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def sdxl() -> StableDiffusionXLPipeline:
    tokenizer = clip_tokenizer()
    time_embed_dim = 8
    unet = seeded(
        11,
        lambda: UNet2DConditionModel(
            sample_size=LATENT_SIZE,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            # The two encoders' hidden states are concatenated for cross-attention.
            cross_attention_dim=2 * CLIP_HIDDEN,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_embed_dim,
            # Six micro-conditioning ids (original size, crop, target size) plus the pooled text.
            projection_class_embeddings_input_dim=6 * time_embed_dim + CLIP_PROJECTION,
            norm_num_groups=8,
        ),
    )
    text_encoder = seeded(12, lambda: CLIPTextModel(clip_config(len(tokenizer), "quick_gelu")))
    text_encoder_2 = seeded(
        13, lambda: CLIPTextModelWithProjection(clip_config(len(tokenizer), "gelu"))
    )
    vae = seeded(14, lambda: kl_vae(latent_channels=4, scaling_factor=0.13025))
    # SDXL base's own scheduler config.
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


def sd3() -> StableDiffusion3Pipeline:
    tokenizer = clip_tokenizer()
    tokenizer_3 = t5_tokenizer()
    transformer = seeded(
        21,
        lambda: SD3Transformer2DModel(
            sample_size=LATENT_SIZE,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            # Context tokens are CLIP states zero-padded to T5's width, then T5 states.
            joint_attention_dim=T5_HIDDEN,
            # Pooled prompt is the two CLIP projections concatenated.
            pooled_projection_dim=2 * CLIP_PROJECTION,
        ),
    )
    text_encoder = seeded(
        22, lambda: CLIPTextModelWithProjection(clip_config(len(tokenizer), "quick_gelu"))
    )
    text_encoder_2 = seeded(
        23, lambda: CLIPTextModelWithProjection(clip_config(len(tokenizer), "gelu"))
    )
    text_encoder_3 = seeded(24, lambda: T5EncoderModel(t5_config(tokenizer_3)))
    vae = seeded(25, lambda: kl_vae(latent_channels=16, scaling_factor=1.5035, shift_factor=0.0609))
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
