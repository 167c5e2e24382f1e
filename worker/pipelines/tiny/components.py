"""Pieces the tiny families share: the seeded-construction rule, the 8x KL VAE, tiny TAESD,
and the CLIP, T5 and Qwen3 text-encoder configs, with the sizes that must agree across them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import torch
from diffusers import AutoencoderKL, AutoencoderTiny
from transformers import (
    CLIPTextConfig,
    Qwen2Tokenizer,
    Qwen3Config,
    T5Config,
    T5Tokenizer,
    UMT5Config,
)

from worker.pipelines.tiny.tokenizers import CLIP_MAX_LENGTH, token_id

_T = TypeVar("_T")

# Hidden sizes shared by the components that must agree with each other.
CLIP_HIDDEN: Final = 32
CLIP_PROJECTION: Final = 32
T5_HIDDEN: Final = 64
QWEN_HIDDEN: Final = 16
# Four VAE levels give the real 8x downscale, so 128 px images use 16x16 latents.
VAE_CHANNELS: Final = (8, 16, 16, 16)
VAE_GROUPS: Final = 8
LATENT_SIZE: Final = 16
# FLUX.1's VAE (which Z-Image also ships): 16 latent channels, this scale and shift.
FLUX_VAE_SCALING: Final = 0.3611
FLUX_VAE_SHIFT: Final = 0.1159


def seeded(seed: int, make: Callable[[], _T]) -> _T:
    """make() under torch.manual_seed(seed), so a rebuild gives the same weights byte for byte."""
    # Fork the RNG so building never disturbs the caller's global torch random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def kl_vae(
    latent_channels: int, scaling_factor: float, shift_factor: float | None = None
) -> AutoencoderKL:
    """An AutoencoderKL with the real four levels (8x) but a few channels a level."""
    # SD3's and FLUX's VAEs drop the quant convs and add a shift; sd15/sdxl keep them.
    flow = shift_factor is not None
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_CHANNELS),
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=VAE_GROUPS,
        sample_size=LATENT_SIZE * 8,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=not flow,
        use_post_quant_conv=not flow,
    )


def taesd(latent_channels: int, scaling_factor: float, shift_factor: float) -> AutoencoderTiny:
    """An AutoencoderTiny with TAESD's layout (8x, four levels) but a few channels a level.

    Its last convolution is set to answer mid-grey with a visible spread: at random weights the
    decoder answers about 0, which AutoencoderTiny maps to -1, and every live preview was black
    (mean 0.02/255), reading as a broken preview rather than a tiny model's noise."""
    vae = AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=latent_channels,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )
    last = vae.decoder.layers[-1]
    with torch.no_grad():
        last.bias.fill_(0.5)  # TAESD answers 0-1; 0.5 is mid-grey
        last.weight.mul_(4)
    return vae


def clip_config(vocab_size: int, hidden_act: str) -> CLIPTextConfig:
    # Specials sit at the top of the vocab; pad is eos as in SD's CLIP tokenizer, and the text
    # model pools at the first eos_token_id, so the ids must be the tokenizer's.
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=CLIP_HIDDEN,
        intermediate_size=37,
        projection_dim=CLIP_PROJECTION,
        num_hidden_layers=5,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )


def t5_config(
    tokenizer: T5Tokenizer,
    kind: type[T5Config] | type[UMT5Config] = T5Config,
    d_model: int = T5_HIDDEN,
    d_kv: int = 16,
    d_ff: int = 128,
) -> Any:
    """T5's shape (gated GELU, relative position buckets, not a table, so any prompt length the
    pipelines pass works), shrunk; kind UMT5Config gives umT5's (a bias in every layer)."""
    return kind(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def qwen3_config(tokenizer: Qwen2Tokenizer, num_layers: int) -> Qwen3Config:
    """Qwen3-4B's shape (grouped-query attention, tied embeddings, rope theta 1e6), shrunk."""
    # Rope, not a table: the 512-token prompts the pipelines pad to need no positional limit,
    # but max_position_embeddings is Qwen3-4B's so a reader of the config sees the real one.
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=QWEN_HIDDEN,
        intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=token_id(tokenizer, "<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
