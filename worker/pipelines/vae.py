"""The VAE a pipeline decodes with: a manifest's `vae:` override, the fp32 upcast an fp16
SDXL VAE needs, made once at load so it holds at every rung, and the tiled VAE a decode retried
after out of memory runs with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from api_client.manifest import Manifest
from worker.manifest import weights_source

if TYPE_CHECKING:
    from pathlib import Path

    from worker.pipelines.resident import LoadedPipeline


def load_vae_override(manifest: Manifest, models_dir: Path, dtype: torch.dtype) -> Any:
    """The manifest's `vae:` as an AutoencoderKL in dtype, for the pipeline's from_pretrained."""
    from diffusers import AutoencoderKL

    assert manifest.vae is not None
    source = weights_source(manifest, models_dir, manifest.vae, marker="config.json")
    return AutoencoderKL.from_pretrained(source.location, dtype=dtype)


def upcast_before_placement(loaded: LoadedPipeline) -> None:
    """An fp16 VAE whose config says force_upcast (the stock SDXL VAE overflows in fp16) goes to
    fp32 before placement, not at each decode: streamed group offload keeps pinned host copies
    of every weight and re-reads them at each onload, so a decode-time upcast would be undone
    by the next onload and the decode would run in fp16 after all."""
    vae, report = getattr(loaded.pipe, "vae", None), loaded.settings
    # Only a family whose pipeline honours force_upcast (FamilySpec.vae_upcast: SDXL's).
    if vae is None or loaded.dtype != torch.float16 or not loaded.spec.vae_upcast:
        return
    if not getattr(vae.config, "force_upcast", False):
        origin = f"manifest vae {loaded.manifest.vae}" if loaded.manifest.vae else "the VAE"
        report.add("skipped", "vae_upcast", f"{origin} is fp16-safe (force_upcast false)")
        return
    vae.to(dtype=torch.float32)
    report.add(
        "applied",
        "vae_upcast",
        "fp16 VAE overflows (force_upcast): kept in fp32 from load, at every rung;"
        " a manifest `vae:` such as madebyollin/sdxl-vae-fp16-fix avoids it",
    )


@contextmanager
def tiled(vae: Any) -> Iterator[str]:
    """The VAE with tiling (and slicing, where it has it) on for one decode, then as it was: a
    decode retried after out of memory (worker.memory.ladder's decode rules) trades a little speed
    and seam blending for a bounded peak, and the next job decodes as its load's switches said.
    Yields what the retry ran with, for the attempt's detail."""
    switches = (
        ("use_tiling", "enable_tiling", "tiled"),
        ("use_slicing", "enable_slicing", "sliced"),
    )
    was = {flag: getattr(vae, flag, None) for flag, _, _ in switches}
    used = []
    for _flag, enable, word in switches:
        if hasattr(vae, enable):
            getattr(vae, enable)()
            used.append(word)
    try:
        yield " and ".join(used) if used else "as it was (this VAE has neither tiling nor slicing)"
    finally:
        for flag, value in was.items():
            if value is not None:
                setattr(vae, flag, value)
