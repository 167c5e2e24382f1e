"""Tiny Qwen-Image (QwenImagePipeline): Qwen2.5-VL's last hidden states (text only) into the
Qwen-Image MMDiT, over its Wan-style causal 3D VAE with per-channel latent mean and std.
"""

from __future__ import annotations

from typing import Final

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from worker.pipelines.tiny.components import QWEN_HIDDEN, seeded
from worker.pipelines.tiny.tokenizers import qwen2_vl_tokenizer, token_id

QWEN_LATENT_CHANNELS: Final = 16


def qwenimage() -> QwenImagePipeline:
    tokenizer = qwen2_vl_tokenizer()
    transformer = seeded(
        61,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            # The pipeline packs 2x2 patches itself: 4x the channels in, the VAE's out.
            in_channels=4 * QWEN_LATENT_CHANNELS,
            out_channels=QWEN_LATENT_CHANNELS,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=QWEN_HIDDEN,
            guidance_embeds=False,
            # (frame, row, column) rope dims summing to the head dim, Qwen-Image's 16:56:56 shrunk.
            axes_dims_rope=(4, 6, 6),
        ),
    )
    text_encoder = seeded(62, lambda: Qwen2_5_VLForConditionalGeneration(_qwen25vl(tokenizer)))
    vae = seeded(
        63,
        lambda: AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=QWEN_LATENT_CHANNELS,
            # Four levels and three spatial downsamples: the real 8x (vae_scale_factor is
            # 2 ** len(temperal_downsample)). latents_mean / latents_std stay the real defaults.
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
    )
    return QwenImagePipeline(
        scheduler=_qwenimage_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _qwen25vl(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL-7B-Instruct's shape shrunk; the vision tower is built but never fed."""
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": QWEN_HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        # Rope over the pipeline's 1024 + 34 padded tokens needs no table; this is the real one.
        "max_position_embeddings": 128000,
        # Multimodal rope: (time, height, width) sections of the 4 frequencies of a head of 8.
        "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
        "bos_token_id": token_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": QWEN_HIDDEN,
        "fullatt_block_indexes": [1],
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_id(tokenizer, "<|image_pad|>"),
        video_token_id=token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=token_id(tokenizer, "<|vision_end|>"),
    )


def _qwenimage_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # Qwen/Qwen-Image scheduler/scheduler_config.json: exponential dynamic shift (base 0.5 at 256
    # tokens, max 0.9 at 8192) stretched to end at 0.02; diffusers' qwenimage.md quotes the
    # same layout for its Lightning variant. With shift_terminal a one-step schedule is NaN
    # (stretch_shift_to_terminal divides 0 by 0), in the real model as here.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
