"""A tiny random IP-Adapter and image encoder for the tiny SD1.5 and SDXL pipelines, laid out as
h94/IP-Adapter lays out its files, so reference images run end to end with no hub:
<pipeline>/ip_adapter/ip-adapter.safetensors (the image projection, `image_proj.*`, and each
cross-attention's key and value projections, `ip_adapter.<n>.to_k_ip` / `to_v_ip`) and
<pipeline>/ip_adapter/image_encoder/ (a CLIPVisionModelWithProjection)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from api_client.families import FAMILIES
from worker.pipelines.tiny.components import seeded

WEIGHTS: Final = "ip-adapter.safetensors"
# ViT-H's shape at a tiny size: 32 px images in 8 px patches, a 32-wide projection.
ENCODER: Final[dict[str, Any]] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 32,
}
TOKENS: Final = 4  # the image tokens of IP-Adapter's projection (diffusers reads "proj.weight" so)
_SEED: Final = 60


def save_tiny_ip_adapter(pipe: DiffusionPipeline, family: str, directory: Path) -> None:
    """The family's tiny IP-Adapter under directory where its row runs one (sd15 and sdxl: UNets);
    nothing for others."""
    row = FAMILIES.get(family)
    if row is not None and row.reference_modes:
        save_ip_adapter(pipe.unet, directory, ENCODER, _SEED)


def save_ip_adapter(unet: Any, directory: Path, encoder: dict[str, Any], seed: int) -> None:
    """A random IP-Adapter for this UNet (its config and attention layers' shapes are read; a
    meta-device UNet will do) and a random image encoder of this CLIPVisionConfig under
    directory (WEIGHTS and image_encoder/), as kiln's manifests name them; built on torch's
    default device and dtype (bench/gpu_check.py builds the real ViT-H so)."""
    config = CLIPVisionConfig(**encoder)
    model = seeded(seed, lambda: CLIPVisionModelWithProjection(config))
    model.save_pretrained(directory / "image_encoder", safe_serialization=True)
    tensors = seeded(seed + 1, lambda: _weights(unet, config.projection_dim))
    save_file(tensors, str(directory / WEIGHTS))


def _weights(unet: Any, embed_dim: int) -> dict[str, torch.Tensor]:
    """The adapter's tensors as diffusers' load_ip_adapter reads them: an ImageProjection from
    the encoder's embedding to TOKENS text-width tokens, and for the n-th cross-attention
    processor (self-attentions skipped, numbered 1, 3, 5, ... as h94's files number them)
    key and value projections shaped as its own to_k and to_v, initialised as nn.Linear is."""
    width = unet.config.cross_attention_dim
    width = width[0] if isinstance(width, (list, tuple)) else width
    projection = torch.nn.Linear(embed_dim, TOKENS * width)
    tensors = {
        "image_proj.proj.weight": projection.weight.detach(),
        "image_proj.proj.bias": projection.bias.detach(),
        "image_proj.norm.weight": torch.ones(width),
        "image_proj.norm.bias": torch.zeros(width),
    }
    key = 1
    for name in unet.attn_processors:
        if not name.endswith("attn2.processor"):
            continue
        attention = unet.get_submodule(name.removesuffix(".processor"))
        for part in ("k", "v"):
            own = getattr(attention, f"to_{part}").weight
            layer = torch.nn.Linear(own.shape[1], own.shape[0], bias=False)
            tensors[f"ip_adapter.{key}.to_{part}_ip.weight"] = layer.weight.detach()
        key += 2
    return {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}
