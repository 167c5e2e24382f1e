"""The tiny pipelines' weights as self-hosters' files hold them, converted from the same tensors,
so a test can hold each loader to the pixels of the diffusers-layout pipeline it came from:

- <tiny-sd15>/loras/tiny-sd15-lora-kohya.safetensors: the `detail` LoRA in kohya / A1111 key
  names (lora_unet_<module path, dots as underscores>.lora_down/.lora_up/.alpha);
- <tiny-sd15>/tiny-sd15.safetensors: the whole pipeline in one LDM-layout file;
- <tiny-sdxl>/tiny-sdxl.safetensors: the whole pipeline in one SGM-layout file;
- <tiny-flux>/tiny-flux-transformer-Q8_0.gguf: the transformer in BFL's key layout, Q8_0.

diffusers ships the original-to-diffusers direction only; the layouts' tables here are the
inverse, ported from diffusers' scripts/convert_diffusers_to_original_stable_diffusion.py and
convert_diffusers_to_original_sdxl.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import torch
from safetensors.torch import load_file, save_file

KOHYA_LORA: Final = "tiny-sd15-lora-kohya.safetensors"
KOHYA_FROM: Final = "detail"  # the tiny PEFT LoRA the kohya file is converted from


def save_model_files(directory: Path, lora_weight_name: str) -> None:
    """Write a tiny pipeline's files as self-hosters hold them into its directory, converted
    from what save_pretrained and the LoRA builder wrote there (never the pipeline in memory,
    which the LoRA builder leaves wrapped)."""
    index = json.loads((directory / "model_index.json").read_text(encoding="utf-8"))
    pipeline = index["_class_name"]
    if pipeline == "StableDiffusionPipeline":
        peft_file = directory / "loras" / KOHYA_FROM / lora_weight_name
        kohya_lora(peft_file, directory / "loras" / KOHYA_LORA)


def kohya_lora(peft_file: Path, out: Path) -> None:
    """A diffusers / PEFT LoRA of a UNet (unet.<module>.lora_A/lora_B.weight) in kohya's key
    names: lora_unet_<module with dots as underscores>.lora_down (A), .lora_up (B) and .alpha,
    set to the rank so that kohya's scale alpha/rank is PEFT's lora_alpha/r (both 1 here)."""
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(peft_file).items():
        module, _, part = key.removeprefix("unet.").rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        if part == "A.weight":
            tensors[f"{name}.lora_down.weight"] = tensor
            tensors[f"{name}.alpha"] = torch.tensor(float(tensor.shape[0]))
        elif part == "B.weight":
            tensors[f"{name}.lora_up.weight"] = tensor
        else:
            raise ValueError(f"{peft_file}: {key} is no lora_A / lora_B weight of a UNet")
    save_file(tensors, out, metadata={"ss_network_module": "networks.lora"})
