"""Tiny random LoRAs for the tiny pipelines, made with peft and saved as diffusers saves any
LoRA, so per-job adapters run end to end with no hub: <pipeline>/loras/<name>/.

Two per pipeline, on different layers and ranks: `detail` on all four attention projections at
rank 4, `style` on to_q and to_v at rank 8. A worker's adapter slots must then cover the union
of both and pad to the larger rank, which is the case a real manifest's list of LoRAs makes."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Final

from diffusers import DiffusionPipeline

from worker.pipelines.tiny.components import seeded
from worker.pipelines.tiny.files import save_model_files

# name -> (seed, rank, target modules)
TINY_LORAS: Final[dict[str, tuple[int, int, tuple[str, ...]]]] = {
    "detail": (51, 4, ("to_q", "to_k", "to_v", "to_out.0")),
    "style": (52, 8, ("to_q", "to_v")),
}
WEIGHT_NAME: Final = "pytorch_lora_weights.safetensors"


def save_tiny_loras(pipe: DiffusionPipeline, directory: Path) -> None:
    """Write each of TINY_LORAS for pipe's denoiser under directory/<name>/."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    attr = "unet" if hasattr(pipe, "unet") else "transformer"
    denoiser: Any = getattr(pipe, attr)
    for name, (seed, rank, targets) in TINY_LORAS.items():
        # init_lora_weights=False draws both A and B at random (peft's default zeroes B, which
        # would make every adapter a no-op), so each adapter visibly changes the image.
        config = LoraConfig(
            r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False
        )
        seeded(seed, functools.partial(denoiser.add_adapter, config, name))
        layers = {
            key: tensor.detach().clone().contiguous()
            for key, tensor in get_peft_model_state_dict(denoiser, adapter_name=name).items()
        }
        denoiser.delete_adapters(name)
        type(pipe).save_lora_weights(directory / name, **{f"{attr}_lora_layers": layers})
    # The same weights as self-hosters' files hold them (a kohya LoRA, single-file checkpoints).
    save_model_files(directory.parent, WEIGHT_NAME)
