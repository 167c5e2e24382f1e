"""GPU acceptance check: random-weight pipelines with the real SD1.5, SDXL, SD3.5-medium,
FLUX.1-dev and Qwen-Image architectures (bench/configs, never downloaded) through kiln's own
renderer and ladder.

Reports per-phase timings and peak memory at each rung (FLUX.1 and Qwen-Image against the memory
their published manifests claim), float8 against int8 for the FLUX.1 and Qwen-Image transformers,
regional against whole compile for both, the compile speedup after warm-up of the SD families, the
int8 memory drop (SDXL's text_encoder_2, SD3's T5), a real out-of-memory
(torch.cuda.set_per_process_memory_fraction) that the ladder survives, the card against
kiln's device profile of it (memory, native bf16, fp8, compute capability), and issue 30's
controls: a ControlNet's extra time per step (SD1.5's, SDXL's union, FLUX.1's union, in their
published layouts: bench/control_builds.py), RealESRGAN x4plus's seconds per megapixel and its
tiles, and SDXL's hires pass against a direct render at its final size; issue 41's video:
Wan2.2-TI2V-5B at real size, each rung's seconds a step and peak at 480p and 720p, 33 frames (a
CUDA device only: on a CPU the section is reported skipped unless --video-on-cpu runs it
shrunk). Runs offline on an NVIDIA GPU:

    python bench/gpu_check.py [--out DIR]
    python bench/gpu_check.py --dry-run      # CPU, shrunken configs, drilled OOM: 1-2 minutes
    python bench/gpu_check.py --families qwenimage          # one family's sections
    python bench/gpu_check.py --families flux --sections rungs,compile_methods --rungs full
    python bench/gpu_check.py --sections controls            # ControlNets, upscaler, hires
    python bench/gpu_check.py --sections video --families wan  # Wan2.2-TI2V-5B's rungs

Checkpoints are written under $TMPDIR (a real Qwen-Image is 56 GB, FLUX.1 34 GB): point it at a
disk that holds one of them at least; the check deletes the others when the next does not fit.
"""

# Where bench/configs/flux and bench/configs/qwenimage come from: the hub config.json files of
# black-forest-labs/FLUX.1-dev and Qwen/Qwen-Image. Those cannot be read from here (no hub
# access), so each value is from public copies of the files, checked against the classes'
# defaults in diffusers 0.42.1 / transformers 5.24 and against the parameter counts the manifests
# list (component_gb):
# - flux: transformer/, text_encoder/, text_encoder_2/, vae/config.json and
#   scheduler/scheduler_config.json. FluxTransformer2DModel's defaults are the same except
#   guidance_embeds (dev: true). BFL's own flux repo (configs/config-dev.json) has the same depth
#   19 + 38, axes 16/56/56, 16 latent channels, scale 0.3611 and shift 0.1159. The CLIP is
#   openai/clip-vit-large-patch14's text tower, the T5 google/t5-v1_1-xxl's encoder (as in SD3's
#   text_encoder_3.json), the scheduler as worker/pipelines/tiny/flux.py copies it. Built at bf16
# they come to   23.80 + 9.52 + 0.25 + 0.17 GB, flux1-dev.yaml's component_gb exactly.
# - qwenimage: the transformer and VAE configs are QwenImageTransformer2DModel's and
#   AutoencoderKLQwenImage's defaults (latents_mean/std are Wan 2.1's), 40.86 + 0.25 GB at bf16.
#   Copies of the hub transformer config also carry pooled_projection_dim 768, which the 0.42
#   class does not take: left out. The text encoder is Qwen2.5-VL-7B-Instruct's config in
#   transformers 5 spelling (rope_scaling + rope_theta became rope_parameters); unconfirmed that
#   Qwen-Image's text_encoder/config.json is that file unchanged. The scheduler is as
#   worker/pipelines/tiny/qwenimage.py copies it.
# - wan (Wan2.2-TI2V-5B, the video section): its configs are written below (VIDEO_CONFIGS), not
#   in bench/configs. The transformer's and VAE's numbers are diffusers' own conversion script's
#   (scripts/convert_wan_to_diffusers.py @ 58eb52c: get_transformer_config("Wan2.2-TI2V-5B") and
#   vae22_diffusers_config, less its clip_output, a key diffusers 0.42.1's AutoencoderKLWan does
#   not take), the scheduler the UniPC (flow shift 5.0) that script saves, the text encoder
#   google/umt5-xxl's config (the script loads it whole). Built they come to 4.9998 B + 0.7047 B
#   + 5.6809 B parameters: 10.00 + 1.41 + 11.36 GB at bf16, wan2.2-ti2v-5b.yaml's component_gb
#   (10.0, 1.41, 11.4); Comfy-Org's fp16 transformer file is 9,999,658,848 bytes.

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the path fix so `python bench/gpu_check.py` finds kiln

from api_client.controls import ControlNetSpec  # noqa: E402
from api_client.families import family_row  # noqa: E402
from api_client.manifest import Manifest, load_manifest_file  # noqa: E402
from api_client.schema import RUNGS, RenderResult, Rung  # noqa: E402
from worker.memory.faults import FaultPlan  # noqa: E402
from worker.memory.ladder import rung_need_gb  # noqa: E402
from worker.memory.peaks import PeakBook  # noqa: E402
from worker.pipelines.families import spec_of  # noqa: E402
from worker.pipelines.loading import load_pipeline  # noqa: E402
from worker.pipelines.quantize import unsupported_reason, weight_summary  # noqa: E402
from worker.pipelines.resident import LoadedPipeline  # noqa: E402

# the same offline tokenizers as kiln's tiny models
from worker.pipelines.tiny.tokenizers import (  # noqa: E402
    FLUX_T5_MAX_LENGTH,
    clip_tokenizer,
    qwen2_vl_tokenizer,
    t5_tokenizer,
    token_id,
    umt5_tokenizer,
)
from worker.render.context import LocalContext  # noqa: E402
from worker.render.renderer import Renderer  # noqa: E402
from worker.render.timings import TimingRecord  # noqa: E402
from worker.settings import Settings  # noqa: E402

CONFIGS = ROOT / "bench" / "configs"
MANIFESTS = ROOT / "manifests"
MB, GB = 1e6, 1e9

# Dry-run shrinks every width and depth so a CPU builds and renders each case in seconds, while
# keeping the block layout (down/up block types, SDXL's text_time conditioning, FLUX's double and
# single blocks) of the real thing. Widths that must agree across components agree here too.
_SMALL_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "projection_dim": 32,
}
_SMALL_T5 = {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2}
_SMALL_VAE = {"block_out_channels": [8, 16, 16, 16], "norm_num_groups": 8, "layers_per_block": 1}
DRY_RUN: dict[str, dict[str, dict[str, Any]]] = {
    "sd15": {
        "unet": {
            "block_out_channels": [32, 32, 64, 64],
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "cross_attention_dim": 32,
            "sample_size": 16,
        },
        "text_encoder": _SMALL_CLIP,
        "vae": _SMALL_VAE,
    },
    "sdxl": {
        "unet": {
            "block_out_channels": [32, 64, 64],
            "attention_head_dim": [2, 4, 4],
            "transformer_layers_per_block": [1, 1, 2],
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "cross_attention_dim": 64,
            "addition_time_embed_dim": 8,
            # six micro-conditioning ids x 8 plus text_encoder_2's 32-wide projection
            "projection_class_embeddings_input_dim": 80,
            "sample_size": 16,
        },
        "text_encoder": _SMALL_CLIP,
        "text_encoder_2": _SMALL_CLIP,
        "vae": _SMALL_VAE,
    },
    "sd3": {
        "transformer": {
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "num_layers": 2,
            "dual_attention_layers": [0],
            # T5's width; the two CLIPs' 32 + 32 are zero-padded up to it
            "joint_attention_dim": 64,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 64,  # the two CLIP projections, concatenated
            "pos_embed_max_size": 32,
            "sample_size": 16,
        },
        "text_encoder": _SMALL_CLIP,
        "text_encoder_2": _SMALL_CLIP,
        "text_encoder_3": _SMALL_T5,
        "vae": _SMALL_VAE,
    },
    "flux": {
        "transformer": {
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,  # T5's d_model
            "pooled_projection_dim": 32,  # CLIP's pooled output: its hidden size
            "axes_dims_rope": [4, 6, 6],  # sums to the head dim, as 16 + 56 + 56 does to 128
        },
        "text_encoder": _SMALL_CLIP,
        "text_encoder_2": _SMALL_T5,
        "vae": _SMALL_VAE,
        "controlnet": {"num_layers": 1, "num_single_layers": 1},  # as its transformer's
    },
    "qwenimage": {
        "transformer": {
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,  # the text model's hidden size
            "axes_dims_rope": [4, 6, 6],
        },
        "text_encoder": {
            "text_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                # (time, height, width) sections of a 16-wide head's 8 frequencies
                "rope_parameters": {
                    "rope_type": "default",
                    "mrope_section": [2, 3, 3],
                    "rope_theta": 1000000.0,
                },
            },
            "vision_config": {"out_hidden_size": 32},
        },
        "vae": {"base_dim": 8, "num_res_blocks": 1},
    },
    # tiny-wan's sizes (worker/pipelines/tiny/wan.py): a head of 12 splits into rope dims of 4
    "wan": {
        "transformer": {
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "ffn_dim": 32,
            "num_layers": 2,
            "text_dim": 32,  # the text encoder's d_model
        },
        "text_encoder": {
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "relative_attention_max_distance": 32,
        },
        "vae": {"base_dim": 4, "decoder_base_dim": 8, "num_res_blocks": 1},
    },
    # the controls section's ESRGAN, and its manifest: a 128 px image in 64 px tiles, as the
    # card's 1024 px one runs in realesrgan-x4plus.yaml's 512 px tiles
    "upscaler": {"model": {"num_filters": 4, "num_blocks": 1}, "manifest": {"tile": 64}},
}
# On the card too: kiln only encodes text with Qwen2.5-VL, so its vision tower (0.67 B parameters,
# 1.3 GB more on a disk that a real Qwen-Image nearly fills) is one narrow block. Its merger still
# projects to the text width, so the model builds, saves and loads as the real class; the text
# encoder weighs 15.2 GB instead of the 16.6 GB that qwen-image.yaml's component_gb lists.
ALWAYS: dict[str, dict[str, dict[str, Any]]] = {
    "qwenimage": {
        "text_encoder": {
            "vision_config": {
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 32,
                "num_heads": 2,
                "fullatt_block_indexes": [0],
            }
        }
    }
}

# Each family's tokenizers, named as its pipeline takes them; text_encoder_N reads tokenizer_N.
TOKENIZERS: dict[str, dict[str, Callable[[], Any]]] = {
    "sd15": {"tokenizer": clip_tokenizer},
    "sdxl": {"tokenizer": clip_tokenizer, "tokenizer_2": clip_tokenizer},
    "sd3": {
        "tokenizer": clip_tokenizer,
        "tokenizer_2": clip_tokenizer,
        "tokenizer_3": t5_tokenizer,
    },
    "flux": {"tokenizer": clip_tokenizer, "tokenizer_2": lambda: t5_tokenizer(FLUX_T5_MAX_LENGTH)},
    "qwenimage": {"tokenizer": qwen2_vl_tokenizer},
    "wan": {"tokenizer": umt5_tokenizer},
}
PIPELINE_EXTRAS: dict[str, dict[str, Any]] = {
    "sd15": {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
    "sdxl": {"add_watermarker": False},
    # TI2V-5B's model_index: each latent token at its own timestep (the first frame's held at 0
    # for image-to-video), as the conversion script builds its WanPipeline.
    "wan": {"expand_timesteps": True},
}
# Wan2.2-TI2V-5B's components (sources in the comment at the top). Its VAE: Wan 2.2's residual
# one, 2x2 pixel patches (12 channels) then three 2x downsamples (16x), two causal 2x temporal
# ones (4x), 48 latent channels with their published means and deviations.
VIDEO_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "wan": {
        "transformer": {
            "_class_name": "WanTransformer3DModel",
            "added_kv_proj_dim": None,
            "attention_head_dim": 128,
            "cross_attn_norm": True,
            "eps": 1e-06,
            "ffn_dim": 14336,
            "freq_dim": 256,
            "in_channels": 48,
            "num_attention_heads": 24,
            "num_layers": 30,
            "out_channels": 48,
            "patch_size": [1, 2, 2],
            "qk_norm": "rms_norm_across_heads",
            "text_dim": 4096,
        },
        "vae": {
            "_class_name": "AutoencoderKLWan",
            "base_dim": 160,
            "decoder_base_dim": 256,
            "z_dim": 48,
            "is_residual": True,
            "in_channels": 12,
            "out_channels": 12,
            "patch_size": 2,
            "scale_factor_temporal": 4,
            "scale_factor_spatial": 16,
            "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": 2,
            "temperal_downsample": [False, True, True],
            # vae22_diffusers_config's, in channel order
            "latents_mean": [
                *(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557),
                *(-0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825),
                *(-0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502),
                *(-0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230),
                *(-0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748),
                *(0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
            ],
            "latents_std": [
                *(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013),
                *(0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978),
                *(0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659),
                *(0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093),
                *(0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887),
                *(0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744),
            ],
        },
        # google/umt5-xxl: T5 v1.1's gated GELU, a relative position bias in every layer
        "text_encoder": {
            "_class_name": "UMT5EncoderModel",
            "vocab_size": 256384,
            "d_model": 4096,
            "d_kv": 64,
            "d_ff": 10240,
            "num_layers": 24,
            "num_heads": 64,
            "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128,
            "feed_forward_proj": "gated-gelu",
            "layer_norm_epsilon": 1e-06,
        },
        "scheduler": {
            "_class_name": "UniPCMultistepScheduler",
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "num_train_timesteps": 1000,
            "flow_shift": 5.0,
        },
    }
}


@dataclass(frozen=True)
class Case:
    """One family as the check builds it, with the memory figures its manifest plans with."""

    family: str
    size: int  # square, on the card; a dry run renders 128
    min_vram_gb: float = 0.0  # measured-style estimates for full residency in 16-bit
    rung_vram_gb: dict[str, float] = field(default_factory=dict)
    quantize: dict[str, list[str]] = field(default_factory=dict)
    # A published manifest whose min_vram_gb, rung_vram_gb and component_gb replace the figures
    # above, so the rungs measure what kiln plans the real model with.
    claims_from: str | None = None
    guidance: tuple[float, float] = (5.0, 10.0)  # default, max
    true_cfg: tuple[float, float] | None = None
    # Rough seconds each item takes on the card (build: configs to checkpoint; a rung or a
    # quantized variant: its load, a cold and a warm job; compile: one method's four jobs;
    # controls: a ControlNet built and saved (and for sd15 and sdxl an IP-Adapter with its ViT-H
    # encoder), a load, then 2 + 2 x ROUNDS jobs (3 + 3 x ROUNDS with a reference); hires: a load
    # and 3 + 2 x ROUNDS jobs, half of them at twice the size). An item is skipped when less is
    # left of the budget.
    gpu_s: dict[str, float] = field(
        default_factory=lambda: {
            "build": 20.0,
            "full": 60.0,
            "partial": 60.0,
            "model_offload": 60.0,
            "group_offload": 60.0,
            "quant": 60.0,
            "compile": 150.0,
            "step_cache": 120.0,
            "controls": 60.0,
            "hires": 60.0,
        }
    )


CASES = (
    Case("sd15", 512, 4.0, {"model_offload": 2.5, "group_offload": 1.0}),
    Case("sdxl", 1024, 10.0, {"model_offload": 6.0, "group_offload": 3.0}),
    # sd35-medium's manifest: T5-XXL in int8, compiled at full.
    Case(
        "sd3",
        1024,
        14.0,
        {"model_offload": 12.5, "group_offload": 3.0},
        {"text_encoder_3": ["int8"]},
    ),
)
# FLUX.1 and Qwen-Image render unquantized on the rungs: with component_gb, their manifests'
# min_vram_gb and rung_vram_gb are the figures with nothing quantized (float8 and int8 have their
# own section). Their gpu_s are bandwidth arithmetic for an H200, not yet measured (build: 34 and
# 56 GB written; a load: read back, then across PCIe; group offload: a pinned host copy, then
# every weight streamed each step); the first card run's build_s, load_s and timings replace them.
FLUX = Case(
    "flux",
    1024,
    claims_from="flux1-dev.yaml",
    guidance=(3.5, 10.0),
    gpu_s={
        "build": 45.0,
        "full": 30.0,
        "partial": 45.0,
        "model_offload": 40.0,
        "group_offload": 60.0,
        "quant": 50.0,
        "compile": 150.0,
        # 3 prompts x 2 jobs of 28 steps at 1024 px, bf16, eager: ~0.3 s a step unquantized.
        "step_cache": 60.0,
        # its 6.2 GB union ControlNet built and written, the load, 8 jobs of 10 steps
        "controls": 90.0,
    },
)
QWEN = Case(
    "qwenimage",
    1024,
    claims_from="qwen-image.yaml",
    guidance=(0.0, 0.0),  # no guidance embedding: its CFG is true CFG
    true_cfg=(4.0, 10.0),
    gpu_s={
        "build": 75.0,
        "full": 45.0,
        "partial": 70.0,
        "model_offload": 60.0,
        "group_offload": 90.0,
        "quant": 80.0,
        "compile": 240.0,
        # 3 prompts x 2 jobs of 28 steps, two 60-block passes a step (true CFG) at 1024 px.
        "step_cache": 150.0,
    },
)
# The controls section's upscaler: RealESRGAN x4plus at input sides of size/4, size/2 and size
# (its manifest's 512 px tiles: the largest runs in nine). gpu_s: a 67 MB file written; three
# sizes' 1 + ROUNDS jobs, the largest a 4096^2 output.
UPSCALER = Case(
    "upscaler",
    1024,
    claims_from="realesrgan-x4plus.yaml",
    gpu_s={"build": 5.0, "upscale": 30.0},
)
# The video section: Wan2.2-TI2V-5B against wan2.2-ti2v-5b.yaml's memory figures. Its gpu_s are
# arithmetic for an H100, not yet measured (build: 23 GB written; a rung: the load, then a cold
# and a warm job of 33 frames at each of two sizes, a 720p step ~0.5 s with CFG and its decode
# several seconds; group offload streams the 10 GB transformer every step); the first card run's
# figures replace them.
VIDEO = Case(
    "wan",
    1280,
    claims_from="wan2.2-ti2v-5b.yaml",
    guidance=(5.0, 20.0),
    gpu_s={
        "build": 60.0,
        "full": 60.0,
        "partial": 70.0,
        "model_offload": 80.0,
        "group_offload": 100.0,
    },
)
# Its sizes: 480p, Wan's 832x480 (26 x 15 cells of TI2V's 32 px grid: its 16x VAE by the 2x2
# patch; TI2V-5B publishes 720p only, Wan2.2 wan/configs SUPPORTED_SIZES['ti2v-5B']), and that
# 720p, 1280x704; and its frames, 4k+1 (k = 8; the model's own default is 121). A dry run's are
# tiny-wan's.
VIDEO_SIZES = {False: ((832, 480), (1280, 704)), True: ((64, 64), (96, 64))}
VIDEO_FRAMES = {False: 33, True: 9}
NO_CUDA_VIDEO = (
    "needs a CUDA device (Wan2.2-TI2V-5B at real size: 480p and 720p, 33 frames); this is cpu"
    " (--video-on-cpu runs it shrunk in a dry run)"
)
# The compile case's second size: a new shape after warm-up, ~1 MP on the 16 px grid like 1024^2.
SECOND_SIZE = {False: (1152, 896), True: (144, 112)}  # keyed by dry run
# Timed jobs of each kind in the controls section, after a warm-up, keyed by dry run.
ROUNDS = {False: 3, True: 1}
QUANT_TYPES = {"float8": "Float8Tensor", "int8": "Int8Tensor"}
FAMILIES = (
    FLUX.family,
    QWEN.family,
    *(case.family for case in CASES),
    UPSCALER.family,
    VIDEO.family,
)
# One card run (about 8 minutes) does not hold them all: --families, --sections and --rungs cut
# a run down to what fits, e.g. FLUX.1's compile methods against its eager full rung alone.
SECTIONS = (
    "rungs",
    "float8_int8",
    "compile_methods",
    "step_cache",
    "compile",
    "int8",
    "oom",
    "controls",
    "video",
)


@dataclass
class Report:
    device: str
    dry_run: bool
    options: dict[str, Any] = field(default_factory=dict)  # what this run was asked to cover
    build_s: dict[str, float] = field(default_factory=dict)
    checkpoint_gb: dict[str, float] = field(default_factory=dict)
    evicted: list[str] = field(default_factory=list)  # checkpoints deleted to free the disk
    claims: dict[str, Any] = field(default_factory=dict)  # memory figures each case planned with
    rungs: list[dict[str, Any]] = field(default_factory=list)
    float8_int8: dict[str, Any] = field(default_factory=dict)
    compile_methods: list[dict[str, Any]] = field(default_factory=list)
    step_cache: list[dict[str, Any]] = field(default_factory=list)
    compile: list[dict[str, Any]] = field(default_factory=list)
    int8: dict[str, Any] = field(default_factory=dict)
    int8_t5: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    oom: dict[str, Any] = field(default_factory=dict)
    # issue 30's: "controlnet" (one entry a family), "upscaler" and "hires"
    controls: dict[str, Any] = field(default_factory=dict)
    # issue 41's: Wan2.2-TI2V-5B's parameters as built, and a row a rung and size (or skipped)
    video: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    total_s: float = 0.0
    finished: bool = False  # false in a file a killed run left: what it measured before


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for option, known in (("families", FAMILIES), ("sections", SECTIONS), ("rungs", RUNGS)):
        unknown = sorted(set(getattr(args, option).split(",")) - set(known))
        if unknown:
            parser.error(f"--{option}: no {', '.join(unknown)}; choose from {','.join(known)}")
    started = time.perf_counter()
    _quiet()
    cuda = torch.cuda.is_available() and not args.dry_run
    report = Report(device=torch.cuda.get_device_name(0) if cuda else "cpu", dry_run=args.dry_run)
    report.options = {key: value for key, value in vars(args).items() if key != "out"}
    work = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    settings = Settings(
        models_dir=work / "models",
        manifests=work / "manifests",
        output_dir=work / "out",
        timings_log=work / "out" / "timings.jsonl",
        device="cuda" if cuda else "cpu",
        **({"inductor_cache_dir": args.out / "inductor"} if args.dry_run else {}),
    )
    run = Run(
        report, settings, Shelf(report, settings.models_dir, args.dry_run, cuda), args, started
    )
    try:
        # 1. The card against kiln's profile of it: no model, no time.
        _check_profile(report, settings, cuda)
        # 2. FLUX.1 and Qwen-Image first, what a first card run is for: every rung, then float8
        #    against int8, each family's pair back to back so one checkpoint is on disk at a time.
        for case in (FLUX, QWEN):
            _check_rungs(run, case)
            _check_float8_int8(run, case)
        # 3. Regional against whole compile (FLUX.1 rebuilt if Qwen-Image pushed it off the disk).
        for case in (FLUX, QWEN):
            _check_compile_methods(run, case)
        # 4. Their published step caches against none, at the same seeds (bench/step_cache.py).
        for case in (FLUX, QWEN):
            _check_step_cache(run, case)
        # 5. The SD families as before: rungs, compile, int8 text encoders, a real OOM.
        for case in CASES:
            _check_rungs(run, case)
        _check_compile(run)
        report.int8 = _check_int8(run, CASES[1], "text_encoder_2")
        report.int8_t5 = _check_int8(run, CASES[2], "text_encoder_3")
        _check_oom(run, CASES[1])
        # 6. Issue 30's controls: a ControlNet's extra time per step (SD1.5, SDXL, FLUX.1), the
        #    upscaler's seconds per megapixel, SDXL's hires pass against a direct render.
        for case in (CASES[0], CASES[1], FLUX):
            _check_controlnet(run, case)
        _check_upscaler(run)
        _check_hires(run, CASES[1])
        # 7. Issue 41's video: Wan2.2-TI2V-5B's rungs at 480p and 720p, 33 frames (CUDA only).
        _check_video(run)
        report.finished = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        path = run.write()
    _print(report, path)
    return 1 if report.failures else 0


def _quiet() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, shrunken configs, drilled OOM")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "out", help="where gpu_check.json goes"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="denoising steps per job (default 10)"
    )
    parser.add_argument(
        "--qwen-steps",
        type=int,
        default=5,
        help="Qwen-Image's steps per job (default 5: each step is two passes of 60 blocks at"
        " 1024 px, true CFG at 4.0)",
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated families to check (default {','.join(FAMILIES)}); the sections"
        " of the others are reported skipped",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default {','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--rungs",
        default=",".join(RUNGS),
        help=f"comma-separated rungs the rungs section renders (default {','.join(RUNGS)})",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=420.0,
        help="later sections are skipped (and reported) past this many seconds",
    )
    parser.add_argument(
        "--cache-steps",
        type=int,
        default=28,
        help="steps of the step_cache section's jobs (default 28: ParaAttention's FLUX figure)",
    )
    parser.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="also run the compile sections in a dry run (minutes on CPU)",
    )
    parser.add_argument(
        "--video-steps",
        type=int,
        default=4,
        help="steps of the video section's jobs (default 4: 33 frames at 720p, CFG at 5.0)",
    )
    parser.add_argument(
        "--video-on-cpu",
        action="store_true",
        help="also run the video section in a dry run (tiny-wan's sizes, 9 frames)",
    )
    return parser


@dataclass
class Run:
    """What every section shares: the report, kiln's settings, the checkpoints, the clock."""

    report: Report
    settings: Settings
    shelf: Shelf
    args: argparse.Namespace
    started: float = field(default_factory=time.perf_counter)

    def steps(self, case: Case) -> int:
        if self.args.dry_run:
            return 2
        if case.family == VIDEO.family:
            return int(self.args.video_steps)
        return int(self.args.qwen_steps if case.family == "qwenimage" else self.args.steps)

    def has_time(self, label: str, need_s: float) -> bool:
        """Whether need_s seconds of the budget are left; if not, the item is reported skipped."""
        left = self.args.time_budget_s - (time.perf_counter() - self.started)
        if left >= need_s:
            return True
        self.report.skipped.append(
            f"{label}: time budget spent ({left:.0f} s left of ~{need_s:.0f})"
        )
        return False

    def write(self) -> Path:
        """The report so far, after each item: a run the kernel kills (host memory, at a Qwen-Image
        group offload: a pinned copy of every weight beside the loaded one) leaves what it had."""
        self.report.total_s = round(time.perf_counter() - self.started, 1)
        path: Path = self.args.out / "gpu_check.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(asdict(self.report), indent=2) + "\n")
        partial.replace(path)
        return path

    def rungs(self) -> list[Rung]:
        return [rung for rung in RUNGS if rung in self.args.rungs.split(",")]

    def selected(self, section: str, family: str, label: str) -> bool:
        """Whether --sections and --families cover an item; if not, it is reported skipped."""
        if section not in self.args.sections.split(","):
            self.report.skipped.append(f"{label}: {section} is not in --sections")
            return False
        if family not in self.args.families.split(","):
            self.report.skipped.append(f"{label}: {family} is not in --families")
            return False
        return True

    def manifest(
        self, case: Case, section: str, first: str, label: str | None = None
    ) -> Manifest | None:
        """The case's checkpoint for a section, built if it is not on disk and there is time to
        build it and run the first item (a gpu_s key) after it; None, reported, if not."""
        label = label or f"{section} {case.family}"
        if not self.selected(section, case.family, label):
            return None
        build = 0.0 if self.shelf.has(case) else case.gpu_s["build"]
        if not self.has_time(label, build + case.gpu_s[first]):
            return None
        try:
            return self.shelf.get(case)
        except NoRoom as exc:
            self.report.skipped.append(f"{label}: {exc}")
            return None


# 1. Random-weight pipelines from the configs, saved like any diffusers model


class NoRoom(Exception):
    """A checkpoint the disk cannot hold even with every other one deleted."""


class Shelf:
    """The random-weight checkpoints on disk, each built the first time a section asks for it.

    When the disk cannot take the next one, the least recently used others are deleted first: a
    real Qwen-Image is 56 GB and FLUX.1 34 GB, more than the 64 GiB card machine holds at once."""

    def __init__(
        self,
        report: Report,
        models_dir: Path,
        dry_run: bool,
        cuda: bool,
        free_bytes: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free,
    ) -> None:
        self.report, self.models_dir, self.dry_run, self.cuda = report, models_dir, dry_run, cuda
        self.free_bytes = free_bytes
        self._built: OrderedDict[str, Manifest] = OrderedDict()

    def has(self, case: Case) -> bool:
        return case.family in self._built

    def get(self, case: Case) -> Manifest:
        if case.family in self._built:
            self._built.move_to_end(case.family)
            return self._built[case.family]
        started = time.perf_counter()
        pipe = _pipeline(case, self.dry_run, self.cuda)
        self._make_room(case.family, _nbytes(pipe))
        target = self.models_dir / f"check-{case.family}"
        pipe.save_pretrained(target, safe_serialization=True)
        del pipe
        _release(self.cuda)
        self.report.build_s[case.family] = round(time.perf_counter() - started, 2)
        on_disk = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        self.report.checkpoint_gb[case.family] = round(on_disk / GB, 3)
        manifest = _manifest(case, target.name, self.dry_run)
        self.report.claims[case.family] = {
            "from": f"manifests/{case.claims_from}" if case.claims_from else "bench/gpu_check.py",
            "min_vram_gb": manifest.min_vram_gb,
            "rung_vram_gb": dict(manifest.rung_vram_gb),
            "component_gb": dict(manifest.component_gb),
        }
        self._built[case.family] = manifest
        return manifest

    def check_room(self, what: str, need: int) -> None:
        """NoRoom unless what, need bytes of tensors, fits on the disk as it is."""
        want, free = _on_disk(need), self.free_bytes(self.models_dir)
        if free < want:
            raise NoRoom(
                f"{what} needs {want / GB:.1f} GB; {free / GB:.1f} GB free under"
                f" {self.models_dir} (set TMPDIR to a bigger disk)"
            )

    def _make_room(self, family: str, need: int) -> None:
        self.models_dir.mkdir(parents=True, exist_ok=True)
        while self.free_bytes(self.models_dir) < _on_disk(need) and self._built:
            other = next(iter(self._built))
            del self._built[other]
            shutil.rmtree(self.models_dir / f"check-{other}", ignore_errors=True)
            self.report.evicted.append(f"{other}: deleted to make room for {family}")
        self.check_room(f"{family}'s checkpoint", need)


def _on_disk(need: int) -> int:
    """Disk bytes for need bytes of tensors: safetensors files are the tensors' bytes plus a small
    header; the margin covers config and tokenizer files and whatever else writes meanwhile."""
    return int(need * 1.02) + int(0.5 * GB)


def _pipeline(case: Case, dry_run: bool, cuda: bool) -> Any:
    """The family's diffusers pipeline from its configs, weights random, where it will run."""
    import diffusers

    tokenizers = {name: make() for name, make in TOKENIZERS[case.family].items()}
    spec = spec_of(case.family)
    components: dict[str, Any] = {}
    # Built in 16-bit where they will run: a Qwen-Image is 20 B parameters plus a 7 B encoder,
    # 108 GB in fp32 (torch's default dtype, which every __init__ here allocates in).
    with _building(case.family, cuda):
        for name, config in _configs(case.family).items():
            class_name = config.pop("_class_name")
            config = _merged(config, ALWAYS.get(case.family, {}).get(name, {}))
            if dry_run:
                config = _merged(config, DRY_RUN[case.family].get(name, {}))
            if name.startswith("text_encoder"):
                tokenizer = tokenizers[name.replace("text_encoder", "tokenizer")]
                # A dry run's encoders read the tokenizer's few hundred ids only: the real
                # vocab's logits (Qwen's 152064 a token) would be most of a CPU encode.
                vocab = len(tokenizer) if dry_run else None
                components[name] = _text_encoder(class_name, config, tokenizer, vocab)
            else:
                components[name] = getattr(diffusers, class_name).from_config(config)
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    pipeline_cls = getattr(diffusers, spec.pipeline_class)
    return pipeline_cls(**components, **tokenizers, **PIPELINE_EXTRAS.get(case.family, {}))


def _configs(family: str) -> dict[str, dict[str, Any]]:
    """A family's component configs by component name: bench/configs/<family>'s files, or the
    video model's written here (VIDEO_CONFIGS); each a fresh copy the caller may change."""
    if family in VIDEO_CONFIGS:
        written: dict[str, dict[str, Any]] = json.loads(json.dumps(VIDEO_CONFIGS[family]))
        return written
    files = sorted((CONFIGS / family).glob("*.json"))
    return {file.stem: json.loads(file.read_text()) for file in files}


@contextmanager
def _building(family: str, cuda: bool) -> Iterator[None]:
    """Modules built inside on the device they will run on, in the 16-bit type kiln picks there
    (sd3 and the flow transformers overflow in fp16; kiln casts at load anyway); fp32 on a CPU."""
    fp16 = spec_of(family).fp16_safe
    dtype = (torch.float16 if fp16 else torch.bfloat16) if cuda else torch.float32
    with torch.device("cuda" if cuda else "cpu"), _default_dtype(dtype):
        yield


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype inside a with block, as torch.device is its default device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _merged(config: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """config with changes over it; nested configs (Qwen2.5-VL's text and vision) key by key."""
    out = dict(config)
    for key, value in changes.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if nested else value
    return out


def _text_encoder(
    class_name: str, config: dict[str, Any], tokenizer: Any, vocab: int | None
) -> torch.nn.Module:
    """A transformers text encoder whose special token ids are its tokenizer's.

    vocab None keeps the configs' real vocab sizes (49408, 32128, 152064), so the weights are the
    real model's size; the offline tokenizers' few hundred ids all fall inside them."""
    import transformers

    if vocab is not None:  # Qwen2.5-VL's vocab is its text model's
        change = {"vocab_size": vocab}
        config = _merged(config, {"text_config": change} if "text_config" in config else change)
    built = _encoder_config(class_name, config, tokenizer)
    size = getattr(built, "text_config", built).vocab_size
    if len(tokenizer) > size:
        raise ValueError(f"{class_name}: vocab_size {size} < the tokenizer's {len(tokenizer)} ids")
    module: torch.nn.Module = getattr(transformers, class_name)(built)
    return module


def _encoder_config(class_name: str, config: dict[str, Any], tokenizer: Any) -> Any:
    import transformers

    if class_name.startswith("CLIP"):
        # CLIP pools at the first eos_token_id, so it must be the tokenizer's.
        ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        return transformers.CLIPTextConfig(**config, **ids)
    if class_name in ("T5EncoderModel", "UMT5EncoderModel"):
        kind = transformers.T5Config if class_name == "T5EncoderModel" else transformers.UMT5Config
        return kind(
            **config, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
        )
    # Qwen2_5_VLForConditionalGeneration: its config names the vision markers' ids too.
    text = {
        **config["text_config"],
        "bos_token_id": token_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return transformers.Qwen2_5_VLConfig(
        **{key: value for key, value in config.items() if key != "text_config"},
        text_config=text,
        image_token_id=token_id(tokenizer, "<|image_pad|>"),
        video_token_id=token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=token_id(tokenizer, "<|vision_end|>"),
    )


def _nbytes(pipe: Any) -> int:
    """Bytes of every tensor the pipeline's modules hold: what its safetensors files take."""
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors)


def _manifest(case: Case, source: str, dry_run: bool) -> Manifest:
    size = 128 if dry_run else case.size
    shape: dict[str, Any] = {"resolutions": [(size, size)]}
    if family_row(case.family).video:
        shape = {
            "resolutions": list(VIDEO_SIZES[dry_run]),
            "frames": {"default": VIDEO_FRAMES[dry_run], "max": 121},
            "fps": 24,
            "modes": ["txt2video", "img2video"],
            # UMT5's 512 tokens (Wan's text_len); a dry run's encoder reads tiny-wan's 64
            "max_sequence_length": 64 if dry_run else 512,
        }
    return Manifest(
        id=f"check-{case.family}",
        family=case.family,  # type: ignore[arg-type]
        source=source,
        steps={"default": 10, "max": 50},  # type: ignore[arg-type]
        guidance={"default": case.guidance[0], "max": case.guidance[1]},  # type: ignore[arg-type]
        true_cfg=(
            None
            if case.true_cfg is None
            else {"default": case.true_cfg[0], "max": case.true_cfg[1]}  # type: ignore[arg-type]
        ),
        quantize=case.quantize,  # type: ignore[arg-type]
        **shape,
        **_claims(case),
    )


def _claims(case: Case) -> dict[str, Any]:
    """The memory figures the case's manifest plans with: its published manifest's, if any."""
    if case.claims_from is None:
        return {"min_vram_gb": case.min_vram_gb, "rung_vram_gb": case.rung_vram_gb}
    published = load_manifest_file(MANIFESTS / case.claims_from)
    return {
        "min_vram_gb": published.min_vram_gb,
        "rung_vram_gb": dict(published.rung_vram_gb),
        "component_gb": dict(published.component_gb),
    }


def _variant(manifest: Manifest, **changes: Any) -> Manifest:
    """manifest with changes, validated again (model_copy would let a bare scheme string in)."""
    return Manifest.model_validate({**manifest.model_dump(), **changes})


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# 2. Each rung: a cold job (load, cache fill) then a warm one, timed by kiln's own stopwatch


class _Recorder:
    """A renderer for one manifest, and every timing record it hands to its listener."""

    def __init__(self, settings: Settings, manifest: Manifest) -> None:
        self.records: list[TimingRecord] = []
        self.renderer = Renderer(settings, {manifest.id: manifest}, on_record=self.records.append)

    def evict_all(self) -> None:
        cache = self.renderer.cache
        for model_id in cache.model_ids():
            cache.evict(model_id)


def _job(
    recorder: _Recorder,
    manifest: Manifest,
    steps: int,
    tag: str,
    size: tuple[int, int] | None = None,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One job (fields: the request's others, or over these), and what kiln's record says of it."""
    width, height = size or manifest.default_size
    payload = {
        "model": manifest.id,
        "prompt": "a lighthouse on a cliff at dusk",
        "steps": steps,
        "width": width,
        "height": height,
        "seed": 1,
        **(fields or {}),
    }
    ctx = LocalContext(job_id=f"{manifest.id}-{tag}-{time.time_ns()}")
    result = recorder.renderer.render(payload, ctx)
    record = recorder.records[-1]
    image = (result.images or result.videos)[0]  # a video job's one video
    return {
        "rung": result.rung,
        "size": f"{image.width}x{image.height}",  # the image's: a hires job's final size
        "frames": record.frames,
        "attempts": [a.model_dump(exclude_none=True) for a in result.attempts],
        "timings": {k: round(v, 4) for k, v in result.timings.model_dump().items()},
        "per_step_s": round(record.per_step_s or 0.0, 4),
        "steps_denoised": record.steps_denoised,
        "passes": record.passes,
        "controls": [control.name for control in record.controls],
        "reference": record.reference is not None,
        "peak_mb": round((record.peak_memory_bytes or 0) / MB, 1),
        "compiled": result.compiled,
        "recompiles": record.recompiles,
        "compile_s": record.compile_s,
        "compile_source": record.compile_source,
    }


def _weights(loaded: LoadedPipeline | None, component: str) -> dict[str, Any]:
    """What a loaded pipeline holds: one component's linear weight types and bytes, the device
    bytes its load took, and what its quantize switch reported."""
    if loaded is None:
        return {}
    kinds, weight_bytes = weight_summary(getattr(loaded.pipe, component))
    notes = [
        {"kind": kind, **note.model_dump()}
        for kind in ("applied", "skipped")
        for note in getattr(loaded.settings, kind)
        if note.name.startswith("quantize")
    ]
    return {
        "component": component,
        "weight_types": sorted(kinds),
        "weight_bytes": weight_bytes,
        "weight_mb": round(weight_bytes / MB, 3),
        "pipeline_device_mb": round(loaded.device_bytes / MB, 1),
        "quantize": notes,
    }


def _check_rungs(run: Run, case: Case) -> None:
    rungs = run.rungs()
    manifest = run.manifest(case, "rungs", rungs[0]) if rungs else None
    if manifest is None:
        return
    for rung in rungs:
        label = f"{case.family}@{manifest.default_size[0]} {rung}"
        if not run.has_time(f"rung {label}", case.gpu_s[rung]):
            continue
        try:
            row = {"case": label, **_rung(run, case, manifest, rung)}
            run.report.rungs.append(row)
            if row["warm"]["rung"] != rung:
                run.report.failures.append(f"rung {label}: rendered at {row['warm']['rung']}")
        except Exception as exc:  # a rung that cannot render is the failure this check exists for
            run.report.failures.append(f"rung {label}: {type(exc).__name__}: {exc}")
        finally:
            run.write()


def _rung(run: Run, case: Case, manifest: Manifest, rung: Rung) -> dict[str, Any]:
    pinned = run.settings.model_copy(update={"memory_mode": rung, "compile": "off"})
    recorder = _Recorder(pinned, manifest)
    try:
        cold = _job(recorder, manifest, run.steps(case), "cold")
        warm = _job(recorder, manifest, run.steps(case), "warm")
        weights = _weights(recorder.renderer.cache.get(manifest.id), spec_of(case.family).denoiser)
    finally:
        recorder.evict_all()
    return {
        "rung": rung,
        "load_s": cold["timings"]["load"],
        # what kiln's ladder plans this rung with, to read against the measured peak
        "claimed_gb": round(rung_need_gb(manifest, rung), 2),
        "denoiser": weights,
        "cold": cold,
        "warm": warm,
    }


# 3. float8 against int8 on the FLUX.1 and Qwen-Image transformers, at full, next to bf16


def _check_float8_int8(run: Run, case: Case) -> None:
    component = "transformer"
    manifest = run.manifest(case, "float8_int8", "quant")
    if manifest is None:
        return
    label = f"{case.family}@{manifest.default_size[0]}"
    full = next((r for r in run.report.rungs if r["case"] == f"{label} full"), None)
    figures: dict[str, Any] = {"case": label, "component": component}
    run.report.float8_int8[case.family] = figures
    if full is not None:  # the rungs section rendered it unquantized at full already
        figures["unquantized"] = {
            **full["denoiser"],
            "warm_denoise_s": full["warm"]["timings"]["denoise"],
        }
    for scheme in ("float8", "int8") if full is not None else (None, "float8", "int8"):
        name = scheme or "unquantized"
        if not run.has_time(f"float8_int8 {label} {name}", case.gpu_s["quant"]):
            continue
        variant = _variant(manifest, quantize={component: [scheme]} if scheme else {})
        try:
            figures[name] = _quantized(run, case, variant, component)
        except Exception as exc:
            run.report.failures.append(f"float8_int8 {label} {name}: {type(exc).__name__}: {exc}")
        finally:
            run.write()
    for scheme in ("float8", "int8"):
        _expect_scheme(run, label, figures, scheme)


def _quantized(run: Run, case: Case, variant: Manifest, component: str) -> dict[str, Any]:
    """One variant at full: its weights, load and warm denoise. A scheme kiln says this card
    cannot run is loaded for kiln's report of that and not rendered: it would run unquantized,
    a second measure of the baseline."""
    from worker.memory.device import probe

    info = probe(run.settings)
    schemes = variant.quantize.get(component, [])
    why = {scheme: unsupported_reason(scheme, info) for scheme in schemes}
    if schemes and all(why.values()):
        loaded = load_pipeline(variant, "full", info, run.settings, FaultPlan())
        figures = {**_weights(loaded, component), "load_s": round(loaded.load_s, 4)}
        loaded.pipe = None
        del loaded
        _release(run.shelf.cuda)
        return {**figures, "unsupported_reason": why, "warm_denoise_s": None}
    recorder = _Recorder(
        run.settings.model_copy(update={"memory_mode": "full", "compile": "off"}), variant
    )
    try:
        cold = _job(recorder, variant, run.steps(case), "quant-cold")
        warm = _job(recorder, variant, run.steps(case), "quant-warm")
        weights = _weights(recorder.renderer.cache.get(variant.id), component)
    finally:
        recorder.evict_all()
    return {
        **weights,
        "unsupported_reason": why,
        "load_s": cold["timings"]["load"],
        "warm_denoise_s": warm["timings"]["denoise"],
        "warm_peak_mb": warm["peak_mb"],
    }


def _expect_scheme(run: Run, label: str, figures: dict[str, Any], scheme: str) -> None:
    """A scheme applies where kiln says the card runs it, and its weights are torchao's and
    smaller; where kiln says it cannot, it is reported skipped with that reason."""
    got, base = figures.get(scheme), figures.get("unquantized")
    if got is None or base is None:
        return
    base_bytes = base["weight_bytes"]
    why = got["unsupported_reason"].get(scheme)
    note = next((n for n in got["quantize"] if n["name"] == f"quantize:{got['component']}"), None)
    outcome = note["kind"] if note else None
    got["outcome"] = outcome
    if why is not None:
        if outcome != "skipped" or why not in note["reason"]:  # type: ignore[index]
            run.report.failures.append(f"{scheme} {label}: expected skipped ({why}), got {note}")
        return
    if outcome != "applied":
        run.report.failures.append(f"{scheme} {label}: not applied: {note}")
    elif got["weight_types"] != [QUANT_TYPES[scheme]] or got["weight_bytes"] >= base_bytes:
        run.report.failures.append(
            f"{scheme} {label}: weights {got['weight_types']} {got['weight_bytes']} bytes,"
            f" unquantized {base_bytes}"
        )
    got["weight_drop_mb"] = round((base_bytes - got["weight_bytes"]) / MB, 3)
    got["device_drop_mb"] = round(base["pipeline_device_mb"] - got["pipeline_device_mb"], 1)
    if got["warm_denoise_s"]:
        got["speedup"] = round(base["warm_denoise_s"] / got["warm_denoise_s"], 2)


# 4. Regional against whole compile at full, across two sizes, against the eager warm job


def _check_compile_methods(run: Run, case: Case) -> None:
    if run.args.dry_run and not run.args.compile_on_cpu:
        run.report.skipped.append(
            f"compile_methods {case.family}: dry run on CPU (Inductor takes minutes here);"
            " --compile-on-cpu"
        )
        return
    manifest = run.manifest(case, "compile_methods", "compile")
    if manifest is None:
        return
    first, second = manifest.default_size, SECOND_SIZE[bool(run.args.dry_run)]
    label = f"{case.family}@{first[0]}"
    eager = next((r["warm"] for r in run.report.rungs if r["case"] == f"{label} full"), None)
    for method in ("regional", "whole"):
        if not run.has_time(f"compile_methods {label} {method}", case.gpu_s["compile"]):
            continue
        variant = _variant(manifest, compile_method=method, resolutions=[first, second])
        try:
            entry = {"case": label, "method": method, **_compiled(run, case, variant, second)}
            if eager is not None and entry["warm_denoise_s"] > 0:
                entry["eager_warm_denoise_s"] = eager["timings"]["denoise"]
                entry["speedup"] = round(eager["timings"]["denoise"] / entry["warm_denoise_s"], 2)
            run.report.compile_methods.append(entry)
            if not entry["compiled"]:
                run.report.failures.append(f"compile {label} {method}: did not compile")
        except Exception as exc:
            run.report.failures.append(f"compile {label} {method}: {type(exc).__name__}: {exc}")
        finally:
            run.write()


def _check_step_cache(run: Run, case: Case) -> None:
    """The published manifest's step cache on the real architecture at its size, eager at full:
    each prompt uncached then cached at one seed, the speed-up of the medians, steps reused, and
    PSNR and SSIM of cached against uncached (random weights: the pixels are noise, so quality
    figures here bound the drift, they do not judge images). A dry run forces the cache on at
    4 steps to run the path."""
    from bench.step_cache import PROMPTS, compare, summary

    manifest = run.manifest(case, "step_cache", "step_cache")
    if manifest is None or case.claims_from is None:
        return
    published = load_manifest_file(MANIFESTS / case.claims_from).step_cache
    if published is None:
        run.report.skipped.append(f"step_cache {case.family}: {case.claims_from} declares none")
        return
    variant = _variant(manifest, step_cache=published.model_dump(exclude_none=True))
    steps = 4 if run.args.dry_run else run.args.cache_steps
    recorder = _Recorder(run.settings.model_copy(update={"memory_mode": "full"}), variant)
    try:
        pairs = compare(recorder.renderer, variant.id, None, PROMPTS[:3], steps)
        entry = {"case": f"{case.family}@{manifest.default_size[0]}", "from": case.claims_from}
        entry |= summary(variant.id, published.threshold, pairs)
        entry["pairs"] = [asdict(p) for p in pairs]
        run.report.step_cache.append(entry)
    except Exception as exc:
        run.report.failures.append(f"step_cache {case.family}: {type(exc).__name__}: {exc}")
    finally:
        recorder.evict_all()
        run.write()


def _compiled(run: Run, case: Case, variant: Manifest, second: tuple[int, int]) -> dict[str, Any]:
    # Each method's cold compile starts from nothing, not from the graphs the other one left.
    torch._dynamo.reset()
    recorder = _Recorder(
        run.settings.model_copy(update={"memory_mode": "full", "compile": "on"}), variant
    )
    steps = run.steps(case)
    try:
        cold = _job(recorder, variant, steps, "compile-cold")
        warm = _job(recorder, variant, steps, "compile-warm")
        resized = _job(recorder, variant, steps, "compile-resized", second)
        resized_warm = _job(recorder, variant, steps, "compile-resized-warm", second)
        loaded = recorder.renderer.cache.get(variant.id)
        applied = loaded.settings.applied if loaded is not None else []
        how = next((n.reason for n in applied if n.name == "compile"), None)
    finally:
        recorder.evict_all()
    return {
        "how": how,
        "compiled": cold["compiled"],
        "load_s": cold["timings"]["load"],
        "cold_job_s": cold["timings"]["total"],
        "cold_denoise_s": cold["timings"]["denoise"],
        # seconds in torch.compile, and cold or local (this process's Inductor cache directory)
        "cold_compile_s": cold["compile_s"],
        "cold_compile_source": cold["compile_source"],
        "warm_denoise_s": warm["timings"]["denoise"],
        "second_size": resized["size"],
        "second_cold_denoise_s": resized["timings"]["denoise"],
        "second_warm_denoise_s": resized_warm["timings"]["denoise"],
        # graphs rebuilt after the first job: the new size's, then none at it again
        "recompiles_after_warmup": warm["recompiles"],
        "recompiles_at_second_size": resized["recompiles"],
        "recompiles_total": resized_warm["recompiles"],
        "recompile_causes": [c for r in recorder.records for c in r.recompile_causes],
    }


# 5. The SD families' compile at full: speedup of warm denoise over the eager warm job


def _check_compile(run: Run) -> None:
    if run.args.dry_run and not run.args.compile_on_cpu:
        run.report.skipped.append(
            "compile: dry run on CPU (Inductor takes minutes here); --compile-on-cpu"
        )
        return
    for case in CASES:
        manifest = run.manifest(case, "compile", "compile")
        if manifest is None:
            continue
        label = f"{case.family}@{manifest.default_size[0]}"
        eager = next((r["warm"] for r in run.report.rungs if r["case"] == f"{label} full"), None)
        recorder = _Recorder(
            run.settings.model_copy(update={"memory_mode": "full", "compile": "on"}), manifest
        )
        try:
            cold = _job(recorder, manifest, run.steps(case), "compile-cold")
            warm = [_job(recorder, manifest, run.steps(case), f"compile-warm{i}") for i in range(2)]
        except Exception as exc:
            run.report.failures.append(f"compile {label}: {type(exc).__name__}: {exc}")
            continue
        finally:
            recorder.evict_all()
        best = min(w["timings"]["denoise"] for w in warm)
        entry = {
            "case": label,
            "compiled": cold["compiled"],
            "cold_denoise_s": cold["timings"]["denoise"],
            "warm_denoise_s": best,
            "recompiles_after_warmup": warm[-1]["recompiles"],
        }
        if eager is not None and best > 0:
            entry["eager_warm_denoise_s"] = eager["timings"]["denoise"]
            entry["speedup"] = round(eager["timings"]["denoise"] / best, 2)
        run.report.compile.append(entry)
        if not cold["compiled"]:
            run.report.failures.append(f"compile {label}: did not compile")


# 6. int8 of a big text encoder (SDXL's second CLIP, SD3's T5): weight bytes and device memory


def _check_int8(run: Run, case: Case, component: str) -> dict[str, Any]:
    from worker.memory.device import probe

    manifest = run.manifest(case, "int8", "quant", f"int8 {component}")
    if manifest is None:
        return {}
    info = probe(run.settings)
    figures: dict[str, Any] = {"component": component}
    for label, quantize in (("bf16_or_fp32", {}), ("int8", {component: ["int8"]})):
        variant = _variant(manifest, quantize=quantize)
        _release(run.shelf.cuda)
        loaded = load_pipeline(variant, "full", info, run.settings, FaultPlan())
        kinds, weight_bytes = weight_summary(getattr(loaded.pipe, component))
        figures[label] = {
            "weight_types": sorted(kinds),
            "weight_bytes": weight_bytes,
            "weight_mb": round(weight_bytes / MB, 3),
            "pipeline_device_mb": round(loaded.device_bytes / MB, 1),
            "report": [
                n.model_dump() for n in loaded.settings.applied if n.name.startswith("quantize")
            ],
        }
        loaded.pipe = None
        del loaded
        _release(run.shelf.cuda)
    before, after = figures["bf16_or_fp32"]["weight_bytes"], figures["int8"]["weight_bytes"]
    figures["weight_drop_mb"] = round((before - after) / MB, 3)
    figures["device_drop_mb"] = round(
        figures["bf16_or_fp32"]["pipeline_device_mb"] - figures["int8"]["pipeline_device_mb"], 1
    )
    if figures["int8"]["weight_types"] != ["Int8Tensor"] or after >= before:
        run.report.failures.append(f"int8 {component}: weights did not shrink: {before} -> {after}")
    return figures


# 7. The card against kiln's profile of it: what KILN_DEVICE_PROFILE decides with is what it has


def _check_profile(report: Report, settings: Settings, cuda: bool) -> None:
    from worker.memory.device import probe_real
    from worker.profiles import GIB, PROFILES, profile_for

    if not cuda:
        report.profile = {"skipped": "no GPU: nothing to compare a profile with"}
        return
    info = probe_real(settings)
    name = profile_for(info.name)
    reported = {
        "card": info.name,
        "backend": info.backend,
        "total_gib": round(info.total_bytes / GIB, 2),
        "free_gib": round(info.free_bytes / GIB, 2),
        "bf16": info.bf16,
        "fp8": info.fp8,
        "capability": list(info.capability or ()),
    }
    if name is None:
        report.profile = {"reported": reported, "profile": None}
        report.skipped.append(f"profile: no kiln profile for {info.name}")
        return
    p = PROFILES[name]
    profiled = {
        "backend": p.backend,
        "total_gib": p.total_gib,
        "free_gib": round(p.free_gib, 2),
        "bf16": p.bf16,
        "fp8": p.fp8,
        "capability": list(p.capability or ()),
    }
    report.profile = {"profile": name, "reported": reported, "profiled": profiled}
    for key in ("backend", "bf16", "fp8", "capability"):
        if reported[key] != profiled[key]:
            report.failures.append(
                f"profile {name}: {key} {profiled[key]} but the card says {reported[key]}"
            )
    # Datasheet memory vs what the driver reports: within 10 % (a T4's 16 GB shows as about
    # 15 GiB, less with ECC on: the driver keeps the rest), else the profile is wrong.
    if abs(reported["total_gib"] - p.total_gib) > 0.10 * p.total_gib:
        report.failures.append(
            f"profile {name}: total {p.total_gib} GiB but the card reports {reported['total_gib']}"
        )


# 8. A real OOM: cap this process's share of the card below SDXL's full-rung need


def _check_oom(run: Run, case: Case) -> None:
    manifest = run.manifest(case, "oom", "full", "oom")
    if manifest is None:
        return
    auto = run.settings.model_copy(update={"memory_mode": "auto", "compile": "off"})
    cuda = run.shelf.cuda
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        # 16-bit SDXL is ~7 GB of weights (UNet 5.1 GB): full cannot load and model_offload
        # cannot hold the UNet, so the ladder walks down past full (partial may hold it).
        cap_gb = 4.0
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap_gb * 1e9 / total, 0)
        how = f"real: set_per_process_memory_fraction to {cap_gb} GB of {total / 1e9:.0f} GB"
    else:
        # No allocator cap on CPU: drill the same sequence with KILN_FAULTS.
        drill = "oom@load:full,oom@load:partial,oom@denoise:model_offload*2"
        auto = auto.model_copy(update={"faults": drill})
        how = f"drilled: KILN_FAULTS={drill} (no GPU)"
    recorder = _Recorder(auto, manifest)
    # The drill walks the ladder from the declared figures: what this run measured so far
    # (worker.memory.peaks) would place the model below the rungs it means to fail.
    recorder.renderer.planner.peaks = PeakBook(None, "gpu-check oom drill")
    try:
        job = _job(recorder, manifest, run.steps(case), "oom")
        run.report.oom = {"how": how, **job}
        if job["rung"] == "full" or not any(a["outcome"] == "oom" for a in job["attempts"]):
            run.report.failures.append(f"oom: no out-of-memory happened ({job['attempts']})")
    except Exception as exc:
        records = recorder.records
        attempts = (
            [a.model_dump(exclude_none=True) for a in records[-1].attempts] if records else []
        )
        run.report.oom = {"how": how, "error": f"{type(exc).__name__}: {exc}", "attempts": attempts}
        run.report.failures.append(f"oom: the ladder did not survive: {exc}")
    finally:
        recorder.evict_all()
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)


# 9. Issue 30's controls: a ControlNet's extra time per step, the upscaler's seconds per
#    megapixel, a hires pass against a direct render at its final size


def _check_controlnet(run: Run, case: Case) -> None:
    """The family's published ControlNet layout, random weights, beside its checkpoint, at full:
    the plain job and the controlled one, each warmed up, then ROUNDS of each in turn; per-step
    seconds of each, the extra and the ratio, and the ControlNet's calls (one a denoised step)."""
    from bench.control_builds import square_png

    label = f"controls {case.family} controlnet"
    manifest = run.manifest(case, "controls", "controls", label)
    if manifest is None:
        return
    pinned = run.settings.model_copy(update={"memory_mode": "full", "compile": "off"})
    recorder: _Recorder | None = None
    try:
        # 1. The ControlNet beside the checkpoint, and the manifest entry that serves it.
        spec, built = _controlnet(run, case, manifest)
        variant = _variant(manifest, controlnets={"canny": spec})
        # 2. What each extra adds to the plain job: its request fields, and where the family has
        #    an IP-Adapter, a reference image through one (its manifest entry beside the
        #    ControlNet's).
        image = square_png(*variant.default_size)
        extras: dict[str, dict[str, Any]] = {
            "controlnet": {"controls": [{"name": "canny", "image": image}]}
        }
        adapter = _ip_adapter(run, case, manifest)
        if adapter is not None:
            variant = _variant(variant, ip_adapter=adapter[0])
            extras["reference"] = {"reference": {"image": square_png(256, 256)}}
        recorder = _Recorder(pinned, variant)
        steps, rounds = run.steps(case), ROUNDS[run.args.dry_run]
        jobs = {
            name: partial(_job, recorder, variant, steps, fields=fields)
            for name, fields in {"none": {}, **extras}.items()
        }
        for name, job in jobs.items():
            job(f"{name}-warm")
        with _forward_calls(_loaded_controlnet(recorder, variant, spec.source)) as calls:
            timed = _alternating(jobs, rounds)
        # 3. Per-step seconds of each against none, and the evidence the ControlNet ran.
        entry: dict[str, Any] = {"case": f"{case.family}@{variant.default_size[0]}"}
        entry |= {"steps": steps, "rounds": rounds, **_step_costs(timed)}
        denoised = sum(job["steps_denoised"] for job in timed["controlnet"])
        entry["controlnet"] |= {**built, "calls": calls[0], "steps_denoised": denoised}
        if adapter is not None:  # and every reference job ran with it
            engaged = all(job["reference"] for job in timed["reference"])
            entry["reference"] |= {**adapter[1], "engaged": engaged}
        run.report.controls.setdefault("controlnet", []).append(entry)
        if calls[0] < denoised:
            run.report.failures.append(f"{label}: {calls[0]} calls in {denoised} denoised steps")
    except NoRoom as exc:
        run.report.skipped.append(f"{label}: {exc}")
    except Exception as exc:
        run.report.failures.append(f"{label}: {type(exc).__name__}: {exc}")
    finally:
        if recorder is not None:
            recorder.evict_all()
        run.write()


def _controlnet(run: Run, case: Case, manifest: Manifest) -> tuple[ControlNetSpec, dict[str, Any]]:
    """The family's ControlNet (bench/control_builds.py) built where its pipeline runs, saved
    beside the checkpoint as kiln's tiny ones are (<checkpoint>/controlnets/canny/), and the
    entry serving it: the published manifest's canny entry where there is one (kind, union mode),
    with the size measured here; NoRoom when the disk cannot take it."""
    from bench.control_builds import PUBLISHED, controlnet

    started = time.perf_counter()
    spec = spec_of(case.family)
    assert spec.control is not None, f"{case.family} has no ControlNet in kiln"
    denoiser = run.settings.models_dir / manifest.source / spec.denoiser
    changes = DRY_RUN[case.family].get("controlnet", {}) if run.args.dry_run else {}
    with _building(case.family, run.shelf.cuda):
        config = json.loads((denoiser / "config.json").read_text())
        model = controlnet(case.family, spec.control.model_class, config, changes)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    run.shelf.check_room(f"{case.family}'s ControlNet", nbytes)
    source = f"{manifest.source}/controlnets/canny"
    model.save_pretrained(run.settings.models_dir / source, safe_serialization=True)
    built = {
        "class": type(model).__name__,
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 4),
        "gb": round(nbytes / GB, 3),  # as built: 16-bit on the card
        "build_s": round(time.perf_counter() - started, 2),
    }
    del model
    _release(run.shelf.cuda)
    published = PUBLISHED.get(case.family)
    if published is None:
        return ControlNetSpec(source=source, kind="canny", gb=built["gb"]), built
    entry = load_manifest_file(MANIFESTS / published).controlnets["canny"]
    built |= {"from": f"manifests/{published}", "published_gb": entry.gb}
    return entry.model_copy(update={"source": source, "gb": built["gb"]}), built


def _ip_adapter(
    run: Run, case: Case, manifest: Manifest
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Where the family runs an IP-Adapter (sd15, sdxl): one with random weights for the
    checkpoint's UNet and the real ViT-H image encoder (kiln's tiny one in a dry run), saved
    beside the checkpoint as kiln's tiny ones are (<checkpoint>/ip_adapter/), its manifest entry
    and what was built; None elsewhere. NoRoom when the disk cannot take it."""
    from diffusers import UNet2DConditionModel

    from api_client.references import REFERENCE_MODES
    from bench.control_builds import VIT_H
    from worker.pipelines.tiny import ip_adapter

    if case.family not in REFERENCE_MODES:
        return None
    started = time.perf_counter()
    source = f"{manifest.source}/ip_adapter"
    folder = run.settings.models_dir / source
    config = json.loads(
        (run.settings.models_dir / manifest.source / "unet/config.json").read_text()
    )
    with torch.device("meta"):  # its attention layers' shapes, no weights
        unet = UNet2DConditionModel.from_config(config)
    encoder = ip_adapter.ENCODER if run.args.dry_run else VIT_H
    run.shelf.check_room(f"{case.family}'s IP-Adapter", int(2 * GB))  # ViT-H and SDXL's: 1.96 GB
    with _building(case.family, run.shelf.cuda):
        ip_adapter.save_ip_adapter(unet, folder, encoder, seed=60)
    _release(run.shelf.cuda)
    nbytes = sum(path.stat().st_size for path in folder.rglob("*.safetensors"))
    entry = {
        "source": manifest.source,
        "subfolder": "ip_adapter",
        "weight_name": ip_adapter.WEIGHTS,
        "image_encoder": {"source": manifest.source, "subfolder": "ip_adapter/image_encoder"},
        "gb": round(nbytes / GB, 3),
    }
    built = {"gb": entry["gb"], "build_s": round(time.perf_counter() - started, 2)}
    return entry, built


def _loaded_controlnet(recorder: _Recorder, manifest: Manifest, source: str) -> torch.nn.Module:
    """The ControlNet module kiln keeps beside the resident pipeline, as its jobs call it."""
    loaded = recorder.renderer.cache.get(manifest.id)
    module = loaded.controlnets.get(source) if loaded is not None else None
    if module is None:
        raise RuntimeError(f"{source} is not beside {manifest.id} after a job that named it")
    return module


def _check_upscaler(run: Run) -> None:
    """RealESRGAN x4plus's architecture, random weights, through kiln's upscale mode at three
    input sides: the seconds per output megapixel of the median job, and the tile kiln ran it in
    and how many (the model's calls a job)."""
    from bench.control_builds import upscaler

    case, label = UPSCALER, "controls upscaler"
    if not run.selected("controls", case.family, label):
        return
    if not run.has_time(label, case.gpu_s["build"] + case.gpu_s["upscale"]):
        return
    assert case.claims_from is not None
    published = load_manifest_file(MANIFESTS / case.claims_from)
    dry = DRY_RUN[case.family] if run.args.dry_run else {}
    source = f"check-upscaler/{Path(published.source).name}"
    size, scale = (128 if run.args.dry_run else case.size), published.scale or 1
    try:
        started = time.perf_counter()
        written = upscaler(run.settings.models_dir / source, dry.get("model", {}))
        figures: dict[str, Any] = {
            "from": f"manifests/{case.claims_from}",
            "build_s": round(time.perf_counter() - started, 2),
            "weights_mb": round(written / MB, 1),
            "sides": [],
        }
        run.report.controls["upscaler"] = figures
        variant = _variant(published, id="check-upscaler", source=source, **dry.get("manifest", {}))
        recorder = _Recorder(run.settings, variant)
        for side in (size // 4, size // 2, size):
            row = _upscaled(recorder, variant, side, ROUNDS[run.args.dry_run])
            figures["sides"].append(row)
            if row["output"] != f"{side * scale}x{side * scale}":
                run.report.failures.append(f"{label} {side}: {row['output']}, not {scale}x")
            run.write()
    except Exception as exc:
        run.report.failures.append(f"{label}: {type(exc).__name__}: {exc}")
    finally:
        run.write()


def _upscaled(recorder: _Recorder, manifest: Manifest, side: int, rounds: int) -> dict[str, Any]:
    """One input side: a job to warm up (the load, the size's first calls), then rounds timed."""
    from bench.control_builds import square_png

    image = square_png(side, side)
    payload = {"model": manifest.id, "image": image, "width": side, "height": side}

    def job(tag: str) -> RenderResult:
        ctx = LocalContext(job_id=f"{manifest.id}-{tag}-{time.time_ns()}")
        return recorder.renderer.render(payload, ctx)

    job("warm")
    loaded = recorder.renderer.upscalers.get(manifest.id)
    assert loaded is not None, f"{manifest.id} is not resident after a job"
    with _forward_calls(loaded.model.model) as calls:
        done = [job(f"{side}-{index}") for index in range(rounds)]
    seconds = _median(result.timings.upscale for result in done)
    out = done[-1].images[0]
    return {
        "input": f"{side}x{side}",
        "output": f"{out.width}x{out.height}",
        "upscale_s": seconds,
        "s_per_output_mp": round(seconds / (out.width * out.height / 1e6), 4),
        "tile_px": loaded.tile,
        "tiles": calls[0] // rounds,
    }


def _check_hires(run: Run, case: Case) -> None:
    """A hires pass (scale 2, latent, kiln's defaults otherwise) against a direct render at its
    final size with as many steps as both passes denoised, at full: each warmed up, then ROUNDS
    of each in turn; total and denoise seconds of each, and their ratios."""
    label = f"controls {case.family} hires"
    manifest = run.manifest(case, "controls", "hires", label)
    if manifest is None:
        return
    first = manifest.default_size
    final = (first[0] * 2, first[1] * 2)
    variant = _variant(manifest, modes=["txt2img", "img2img"], resolutions=[first, final])
    pinned = run.settings.model_copy(update={"memory_mode": "full", "compile": "off"})
    recorder = _Recorder(pinned, variant)
    rounds = ROUNDS[run.args.dry_run]
    hires = {"hires": {"scale": 2, "upscaler": "latent"}}
    try:
        jobs = {"hires": partial(_job, recorder, variant, run.steps(case), fields=hires)}
        # The hires warm-up says how many steps its two passes denoise: the direct job's.
        steps = jobs["hires"]("hires-warm")["steps_denoised"]
        jobs["direct"] = partial(_job, recorder, variant, steps, size=final)
        jobs["direct"]("direct-warm")
        timed = _alternating(jobs, rounds)
        entry: dict[str, Any] = {"case": f"{case.family}@{first[0]}", "rounds": rounds}
        for name, done in timed.items():
            entry[name] = {
                "size": done[-1]["size"],
                "passes": done[-1]["passes"],
                "steps_denoised": done[-1]["steps_denoised"],
                "total_s": _median(job["timings"]["total"] for job in done),
                "denoise_s": _median(job["timings"]["denoise"] for job in done),
            }
        entry["total_ratio"] = round(entry["hires"]["total_s"] / entry["direct"]["total_s"], 2)
        entry["denoise_ratio"] = round(
            entry["hires"]["denoise_s"] / entry["direct"]["denoise_s"], 2
        )
        run.report.controls["hires"] = entry
        passes, size = entry["hires"]["passes"], entry["hires"]["size"]
        if (passes, size) != (2, f"{final[0]}x{final[1]}"):
            run.report.failures.append(
                f"{label}: {passes} pass(es) to {size}; expected 2 to {final[0]}x{final[1]}"
            )
    except Exception as exc:
        run.report.failures.append(f"{label}: {type(exc).__name__}: {exc}")
    finally:
        recorder.evict_all()
        run.write()


# 7. Issue 41's video: Wan2.2-TI2V-5B's rungs at 480p and 720p, 33 frames


def _check_video(run: Run) -> None:
    """Every rung of Wan2.2-TI2V-5B at real size with random weights: its seconds a step and
    peak at 480p and 720p, 33 frames. Its parameters, built on the meta device (no memory), are
    reported first on any machine, so a CPU run checks the configs; the renders need a CUDA
    device (a CPU renders the shrunk model with --video-on-cpu in a dry run)."""
    if not run.selected("video", VIDEO.family, "video"):
        return
    run.report.video = {"params_b": _video_params(), "skipped": None, "rows": []}
    if not run.shelf.cuda and not run.args.video_on_cpu:
        run.report.video["skipped"] = NO_CUDA_VIDEO
        run.report.skipped.append(f"video: {NO_CUDA_VIDEO}")
        return
    rungs = run.rungs()
    manifest = run.manifest(VIDEO, "video", rungs[0]) if rungs else None
    if manifest is None:
        return
    run.report.video.update(
        frames=VIDEO_FRAMES[run.args.dry_run],
        steps=run.steps(VIDEO),
        sizes=[f"{w}x{h}" for w, h in manifest.resolutions],
    )
    for rung in rungs:
        if not run.has_time(f"video {rung}", VIDEO.gpu_s[rung]):
            continue
        try:
            run.report.video["rows"].extend(_video_rung(run, manifest, rung))
        except Exception as exc:  # a rung that cannot render a video is what this looks for
            run.report.failures.append(f"video {rung}: {type(exc).__name__}: {exc}")
        finally:
            run.write()


def _video_params() -> dict[str, float]:
    """Billions of parameters of each real-size component, built on the meta device."""
    import diffusers
    import transformers

    params: dict[str, float] = {}
    for name, config in _configs(VIDEO.family).items():
        class_name = config.pop("_class_name")
        if name == "scheduler":
            continue
        with torch.device("meta"):
            if name == "text_encoder":
                module = getattr(transformers, class_name)(transformers.UMT5Config(**config))
            else:
                module = getattr(diffusers, class_name).from_config(config)
        params[name] = round(sum(p.numel() for p in module.parameters()) / 1e9, 4)
    return params


def _video_rung(run: Run, manifest: Manifest, rung: Rung) -> list[dict[str, Any]]:
    """At one rung: a cold and a warm job at each size (the first cold job is the load); a row a
    size with the warm job's seconds a step, phases and peak against what the rung plans with."""
    pinned = run.settings.model_copy(update={"memory_mode": rung, "compile": "off"})
    recorder = _Recorder(pinned, manifest)
    frames = {"frames": VIDEO_FRAMES[run.args.dry_run]}
    steps, rows = run.steps(VIDEO), []
    try:
        for size in manifest.resolutions:
            cold = _job(recorder, manifest, steps, "cold", size, frames)
            warm = _job(recorder, manifest, steps, "warm", size, frames)
            if warm["rung"] != rung:
                run.report.failures.append(f"video {rung} {warm['size']}: ran at {warm['rung']}")
            rows.append(
                {
                    "rung": rung,
                    "size": warm["size"],
                    "frames": warm["frames"],
                    "load_s": cold["timings"]["load"],
                    "per_step_s": warm["per_step_s"],
                    "peak_mb": warm["peak_mb"],
                    "claimed_gb": round(rung_need_gb(manifest, rung), 2),
                    "cold": cold,
                    "warm": warm,
                }
            )
    finally:
        recorder.evict_all()
    return rows


def _step_costs(timed: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The plain jobs' median seconds a step (none), and each extra's with what it adds to them."""
    none = _median(job["per_step_s"] for job in timed["none"])
    costs: dict[str, Any] = {"none_per_step_s": none}
    for name, jobs in timed.items():
        if name != "none":
            per_step = _median(job["per_step_s"] for job in jobs)
            extra, ratio = round(per_step - none, 4), round(per_step / none, 2)
            costs[name] = {"per_step_s": per_step, "extra_per_step_s": extra, "ratio": ratio}
    return costs


def _alternating(
    jobs: Mapping[str, Callable[[str], dict[str, Any]]], rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """rounds of every job in turn (the caller warmed each up): a drift in the card's clocks or
    temperature falls on all of them alike, where one batch after another would put it on one."""
    timed: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for index in range(rounds):
        for name, job in jobs.items():
            timed[name].append(job(f"{name}-{index}"))
    return timed


@contextmanager
def _forward_calls(module: torch.nn.Module) -> Iterator[list[int]]:
    """The module's forward calls inside the with block, counted in a one-item list."""
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    handle = module.register_forward_pre_hook(count)
    try:
        yield calls
    finally:
        handle.remove()


def _median(values: Iterable[float]) -> float:
    return round(statistics.median(values), 4)


def _print(report: Report, path: Path) -> None:
    print(f"kiln gpu check on {report.device}{' (dry run)' if report.dry_run else ''}")
    print(f"  built: {report.build_s} s; on disk {report.checkpoint_gb} GB")
    for line in report.evicted:
        print(f"  evicted: {line}")
    for row in report.rungs:
        t = row["warm"]["timings"]
        print(
            f"  {row['case']:<28} load {row['load_s']:.2f}s  encode {t['text_encode']:.3f}"
            f"  denoise {t['denoise']:.3f}  decode {t['decode']:.3f}  total {t['total']:.3f}"
            f"  peak {row['warm']['peak_mb']:.0f} MB (plans {row['claimed_gb']} GB)"
        )
    for family, figures in report.float8_int8.items():
        for name in ("unquantized", "float8", "int8"):
            got = figures.get(name)
            if not got:
                continue
            outcome = got.get("outcome", "") if name != "unquantized" else ""
            denoise = got["warm_denoise_s"]
            print(
                f"  {family} {figures['component']} {name:<11} {outcome:<8}"
                f" {got['weight_mb']} MB {got['weight_types']}"
                f"  device {got['pipeline_device_mb']} MB"
                f"  warm denoise {'not rendered' if denoise is None else f'{denoise}s'}"
            )
    for entry in report.compile_methods:
        print(
            f"  compile {entry['case']} {entry['method']}: cold job {entry['cold_job_s']:.1f}s,"
            f" warm {entry['warm_denoise_s']:.3f}s (eager {entry.get('eager_warm_denoise_s', '?')},"
            f" speedup {entry.get('speedup', '?')}x), at {entry['second_size']}"
            f" {entry['recompiles_at_second_size']} recompiles, {entry['recompiles_total']} in all"
        )
    for entry in report.step_cache:
        print(
            f"  step_cache {entry['case']} threshold {entry['threshold']}: denoise"
            f" {entry['plain_denoise_s']}s -> {entry['cached_denoise_s']}s"
            f" ({entry['denoise_speedup']}x), {entry['steps_reused']} of {entry['steps']} steps"
            f" reused, PSNR {entry['psnr_db']} dB, SSIM {entry['ssim']}"
        )
    for entry in report.compile:
        print(
            f"  compile {entry['case']}: cold {entry['cold_denoise_s']:.2f}s,"
            f" warm {entry['warm_denoise_s']:.3f}s,"
            f" speedup {entry.get('speedup', '?')}x, recompiles {entry['recompiles_after_warmup']}"
        )
    for i in (report.int8, report.int8_t5):
        if i:
            print(
                f"  int8 {i['component']}: {i['bf16_or_fp32']['weight_mb']} MB"
                f" -> {i['int8']['weight_mb']} MB"
                f" weights; device drop {i['device_drop_mb']} MB"
            )
    if report.profile:
        print(f"  profile: {report.profile}")
    if report.oom:
        print(f"  oom ({report.oom['how']}): attempts {report.oom.get('attempts')}")
    for entry in report.controls.get("controlnet", []):
        c = entry["controlnet"]
        print(
            f"  controlnet {entry['case']} {c['class']} ({c['params_b']} B params):"
            f" {entry['none_per_step_s']}s a step -> {c['per_step_s']}s"
            f" ({c['extra_per_step_s']:+}s, {c['ratio']}x)"
        )
        if "reference" in entry:
            r = entry["reference"]
            print(
                f"  ip-adapter {entry['case']} ({r['gb']} GB with its encoder):"
                f" {entry['none_per_step_s']}s a step -> {r['per_step_s']}s"
                f" ({r['extra_per_step_s']:+}s, {r['ratio']}x)"
            )
    for row in report.controls.get("upscaler", {}).get("sides", []):
        print(
            f"  upscaler {row['input']} -> {row['output']}: {row['upscale_s']}s,"
            f" {row['s_per_output_mp']} s/MP, {row['tiles']} tile(s) of {row['tile_px']} px"
        )
    if "hires" in report.controls:
        h = report.controls["hires"]
        print(
            f"  hires {h['case']} -> {h['hires']['size']}: {h['hires']['total_s']}s"
            f" ({h['hires']['steps_denoised']} steps) against direct {h['direct']['total_s']}s"
            f" ({h['direct']['steps_denoised']} steps): {h['total_ratio']}x,"
            f" denoise {h['denoise_ratio']}x"
        )
    video = report.video
    if video.get("params_b"):
        print(f"  video wan2.2-ti2v-5b parameters (B): {video['params_b']}")
    for row in video.get("rows", []):
        t = row["warm"]["timings"]
        print(
            f"  video {row['rung']:<13} {row['size']:>9} x {row['frames']} frames:"
            f" {row['per_step_s']:.3f} s/step, decode {t['decode']:.2f}s,"
            f" encode {t['video_encode']:.2f}s, total {t['total']:.2f}s,"
            f" peak {row['peak_mb']:.0f} MB (plans {row['claimed_gb']} GB)"
        )
    for line in report.skipped:
        print(f"  skipped: {line}")
    for line in report.failures:
        print(f"  FAILED: {line}")
    print(f"  {'FAIL' if report.failures else 'PASS'} in {report.total_s} s; details in {path}")


if __name__ == "__main__":
    sys.exit(main())
