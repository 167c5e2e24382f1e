"""Tiny random-weight pipelines, one a family, built from configs with local tokenizers, and the
build that saves them: kiln's embedded default models.

They are ordinary diffusers directories, so they load through the same from_pretrained path as
hub models, with no hub access at build or load time. Each family's builder lives in its own
module (sd, flux, flux2, qwenimage, zimage, wan, ltx, upscaler), named by the family's worker row
(worker.pipelines.families.TinyModel, with its TAESD and ControlNets); this one owns the build,
the version stamp and the atomic swap into place.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from diffusers import DiffusionPipeline
from transformers.utils import logging as transformers_logging

from worker.pipelines.families import FamilySpec, TinyModel, tiny_models
from worker.pipelines.tiny.components import seeded, taesd
from worker.pipelines.tiny.controlnet import save_tiny_controlnets
from worker.pipelines.tiny.ip_adapter import save_tiny_ip_adapter
from worker.pipelines.tiny.lora import save_tiny_loras
from worker.pipelines.tiny.upscaler import TinyUpscaler

__all__ = [
    "BUILDER_VERSION",
    "STAMP_FILE",
    "TAESD_LATENTS",
    "TINY_BUILDS",
    "TINY_FAMILIES",
    "build_tiny_models",
    "is_current",
]

# Bump whenever a config, tokenizer or seed changes: existing builds are then replaced.
# 2: a tiny TAESD in <pipeline>/taesd for previews. 3: flux, flux2, qwenimage and zimage.
# 4: two tiny LoRAs in <pipeline>/loras (worker.pipelines.tiny.lora). 5: tiny ControlNets in
# <pipeline>/controlnets for sd15 and flux (worker.pipelines.tiny.controlnet). 6: for sdxl, sd3,
# qwenimage and zimage too, and tiny-upscaler (worker.pipelines.tiny.upscaler). 7: a tiny
# IP-Adapter in <pipeline>/ip_adapter for sd15 and sdxl (worker.pipelines.tiny.ip_adapter).
# 8: self-hosters' files of the same weights: single-file sd15/sdxl, a kohya LoRA, a GGUF flux
# transformer (worker.pipelines.tiny.files).
# 9: the tiny TAESD answers mid-grey with a spread, not black (tiny.components.taesd).
# 10: tiny-wan and tiny-ltx (worker.pipelines.tiny.wan, ltx), the video families; tiny-sd3's
# single file, tiny-flux's transformer in BFL's layout and in fp8 e4m3 (tiny.files).
BUILDER_VERSION: Final = 10
STAMP_FILE: Final = "kiln_tiny.json"

# Everything the build makes, from the families' rows: the tiny pipelines (one a family, and
# flux-kontext, an edit model of the flux family: manifest modes [txt2img, edit], its own
# checkpoint) with the spec each renders with, and tiny-upscaler, an ESRGAN file for spandrel
# (manifest tiny-upscaler, family upscaler), not a pipeline (no spec).
_TINIES: Final = tiny_models()
TINY_FAMILIES: tuple[str, ...] = tuple(n for n, (_, spec) in _TINIES.items() if spec is not None)
TINY_BUILDS: tuple[str, ...] = tuple(_TINIES)
# The builds that ship a TAESD (the others get no previews): TinyModel.taesd by name.
TAESD_LATENTS: Final = {n: tiny.taesd for n, (tiny, _) in _TINIES.items() if tiny.taesd}
_TAESD_SEED: Final = 40


def build_tiny_models(
    out_dir: Path, families: Iterable[str] = TINY_BUILDS, *, force: bool = False
) -> dict[str, Path]:
    """Build tiny-<family> pipelines (and tiny-upscaler) under out_dir (out_dir/tiny-sd15 ...).

    Skips a pipeline whose dir already has a model_index.json and a matching builder version
    stamp unless force. Returns {"tiny-sd15": path, ...}.
    """
    wanted = list(families)
    unknown = [f for f in wanted if f not in _TINIES]
    if unknown:
        raise ValueError(f"families: unknown {unknown!r}; must be among {list(TINY_BUILDS)!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    for family in wanted:
        name = f"tiny-{family}"
        target = out_dir / name
        if force or not is_current(target):
            _build_into(target, family, force=force)
        built[name] = target
    return built


def is_current(path: Path) -> bool:
    """Whether path holds a complete build stamped by this BUILDER_VERSION (the stamp is written
    last, and the directory swapped into place whole)."""
    stamp = path / STAMP_FILE
    if not stamp.is_file():
        return False
    try:
        version = json.loads(stamp.read_text(encoding="utf-8")).get("builder_version")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(version == BUILDER_VERSION)


def _build_into(target: Path, family: str, *, force: bool) -> None:
    # Build beside the target and rename, so readers never see a half-written pipeline.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        tiny, spec = _TINIES[family]
        pipe = _builder(tiny)()
        with _quiet_progress_bars():
            pipe.save_pretrained(tmp, safe_serialization=True)
            if isinstance(pipe, DiffusionPipeline) and spec is not None:
                _save_extras(pipe, tiny, spec, tmp)
        stamp = {"builder_version": BUILDER_VERSION, "family": family}
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
        # A concurrent builder may have finished first; keep its copy so readers are not cut off.
        if force or not is_current(target):
            _swap_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _builder(tiny: TinyModel) -> Callable[[], DiffusionPipeline | TinyUpscaler]:
    """The function TinyModel.builder names ("module.function" in this package)."""
    module, _, function = tiny.builder.rpartition(".")
    build: Callable[[], DiffusionPipeline | TinyUpscaler] = getattr(
        importlib.import_module(f"{__name__}.{module}"), function
    )
    return build


def _save_extras(
    pipe: DiffusionPipeline, tiny: TinyModel, spec: FamilySpec, directory: Path
) -> None:
    """What a tiny pipeline ships beside itself: a TAESD, ControlNets, an IP-Adapter, LoRAs."""
    if tiny.taesd is not None:
        _save_taesd(directory / "taesd", tiny.taesd)
    # Before the LoRAs: making them leaves peft's wrappers on the denoiser, SD's ControlNet
    # copies the UNet's own weights and the IP-Adapter's layers take its attentions' shapes.
    save_tiny_controlnets(pipe, spec, directory / "controlnets")
    save_tiny_ip_adapter(pipe, tiny.name, directory / "ip_adapter")
    save_tiny_loras(pipe, directory / "loras")


def _save_taesd(directory: Path, latents: tuple[int, float, float]) -> None:
    preview = seeded(_TAESD_SEED, lambda: taesd(*latents))
    preview.save_pretrained(directory, safe_serialization=True)
    # AutoencoderTiny records block_out_channels in its config but does not take it back,
    # warning on every load; TAESD's published configs do not carry it either.
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("block_out_channels", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _swap_into_place(new: Path, target: Path) -> None:
    # A directory cannot be renamed over a non-empty one, so the old build is moved aside first.
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex}")
    if target.exists():
        target.rename(old)
    try:
        new.rename(target)
    except OSError:
        # Another builder won the race; its pipeline is as good as ours if it is current.
        if not is_current(target):
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # transformers draws a "Writing model shards" bar per text encoder; in a worker log that is
    # noise. The switch is process-wide, so the caller's setting is put back afterwards.
    was_enabled = transformers_logging.is_progress_bar_enabled()
    # transformers leaves these two switches unannotated.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
