"""Tiny random ESRGAN for the upscaler paths: spandrel's own ESRGAN architecture (RRDBNet, as
RealESRGAN and 4x-UltraSharp are) at 8 filters and one block, 2x, saved as a single safetensors
file the way upscalers are published, so spandrel detects it from its state dict as it detects
theirs: <dir>/tiny-upscaler-x2.safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from worker.pipelines.tiny.components import seeded

FILE: Final = "tiny-upscaler-x2.safetensors"
SCALE: Final = 2


class TinyUpscaler:
    """What the tiny build saves for manifest tiny-upscaler."""

    def __init__(self) -> None:
        from spandrel.architectures.ESRGAN import ESRGAN

        # Random weights make a grey-ish noise image; the output's size and the paths are real.
        self.model = seeded(71, lambda: ESRGAN(num_filters=8, num_blocks=1, scale=SCALE))

    def save_pretrained(self, directory: Path, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self.model.state_dict().items()}
        save_file(tensors, str(directory / FILE))
