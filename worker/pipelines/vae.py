"""The VAE a pipeline decodes with: a manifest's `vae:` override, the fp32 upcast an fp16
SDXL VAE needs, made once at load so it holds at every rung, and the tiled VAE a decode retried
after out of memory runs with."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
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


NEITHER = "as it was (this VAE has neither tiling nor slicing)"


@dataclass(frozen=True)
class Tiles:
    """Tile sizes for a tiled decode, in the output's pixels and frames; None keeps the VAE's own
    (diffusers' defaults: AutoencoderKLWan 256 px tiles at a 192 px stride, AutoencoderKLLTXVideo
    512 / 448 px and 16 / 8 frames). A field is the keyword of the VAE's enable_tiling it sets."""

    tile_sample_min_height: int | None = None
    tile_sample_min_width: int | None = None
    tile_sample_stride_height: int | None = None
    tile_sample_stride_width: int | None = None
    # Temporal tiles, for a VAE that has them (LTX-Video's; Wan's decodes a latent frame at a time).
    tile_sample_min_num_frames: int | None = None
    tile_sample_stride_num_frames: int | None = None

    def given(self) -> dict[str, int]:
        return {name: value for name, value in asdict(self).items() if value is not None}


@contextmanager
def tiled(vae: Any, tiles: Tiles | None = None) -> Iterator[str]:
    """The VAE with tiling (and slicing, where it has it) on for one decode, then as it was: a
    decode retried after out of memory (worker.memory.ladder's decode rules) trades a little speed
    and seam blending for a bounded peak, and the next job decodes as its load's switches said.

    A video VAE tiles in space only. LTX-Video's runs temporal tiles with use_framewise_decoding
    on, which no diffusers method sets, and in 0.42.1 those frames after the first temporal join
    come one frame late (a repeated frame, the last one lost: tests/test_video_ladder.py holds it
    as a strict xfail, so a fixed diffusers shows): TIME_TILES stays off until then, since a
    retry must give the job's own frames. Wan's decoder always runs one latent frame at a time,
    so frames never add to its decode's peak beyond the output. tiles, where given,
    sets the tile sizes for this decode (a ValueError names a size the VAE's enable_tiling does
    not take). Yields what the retry ran with, for the attempt's detail."""
    sizes = tiles.given() if tiles is not None else {}
    _check_sizes(vae, sizes)
    flags = ("use_tiling", "use_slicing", "use_framewise_decoding", *sizes)
    was = {flag: getattr(vae, flag) for flag in flags if hasattr(vae, flag)}
    try:
        yield " and ".join(_switch_on(vae, sizes)) or NEITHER
    finally:
        for flag, value in was.items():
            setattr(vae, flag, value)


# LTX-Video's temporal tiles (use_framewise_decoding): off while diffusers shifts their frames.
TIME_TILES = False


def _switch_on(vae: Any, sizes: dict[str, int]) -> list[str]:
    """Tiling (in time too where the VAE has framewise decoding and TIME_TILES) and slicing; the
    words for it."""
    used = []
    if hasattr(vae, "enable_tiling"):
        vae.enable_tiling(**sizes)
        used.append("tiled")
        if TIME_TILES and hasattr(vae, "use_framewise_decoding"):
            vae.use_framewise_decoding = True
            used[-1] = "tiled (space and time)"
    if hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
        used.append("sliced")
    return used


def _check_sizes(vae: Any, sizes: dict[str, int]) -> None:
    if not sizes:
        return
    enable = getattr(vae, "enable_tiling", None)
    takes = set(inspect.signature(enable).parameters) if enable is not None else set()
    refused = sorted(set(sizes) - takes)
    if refused:
        raise ValueError(
            f"tiles {', '.join(refused)}: {type(vae).__name__}.enable_tiling takes"
            f" {', '.join(sorted(takes)) or 'no tile sizes'}"
        )
