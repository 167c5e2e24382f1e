"""torch.compile of the denoiser: regional where the model declares repeated blocks, with a
persistent Inductor cache so a restarted worker does not pay a cold compile again."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from worker.families import family_of
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.pipelines import LoadedPipeline


def use_persistent_cache(settings: Settings) -> None:
    """TORCHINDUCTOR_CACHE_DIR keeps its usual meaning; kiln only sets a default."""
    settings.inductor_cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(settings.inductor_cache_dir))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def compile_denoiser(loaded: LoadedPipeline, settings: Settings) -> str:
    use_persistent_cache(settings)
    denoiser = getattr(loaded.pipe, family_of(loaded.manifest.family).denoiser)
    if getattr(denoiser, "_repeated_blocks", None):
        denoiser.compile_repeated_blocks(fullgraph=True)
        return f"regional: torch.compile of repeated {', '.join(denoiser._repeated_blocks)} blocks"
    denoiser.compile()
    return "whole denoiser: torch.compile"
