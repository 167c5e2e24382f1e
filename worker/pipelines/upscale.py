"""Upscalers: ESRGAN-family models (RealESRGAN, 4x-UltraSharp, SwinIR, ...) loaded with spandrel,
which reads the architecture off the state dict, kept resident across jobs like a pipeline, and
run over an image in overlapping tiles. On out of memory the tile size halves and the image is
run again (the ladder's rule for a model with no offload rungs); each try is an Attempt.

A manifest of family upscaler names the file (source), its native scale and its tile. spandrel
imports every architecture it knows when it is imported (its LaMa needs torchvision), so it is
imported at the first load, never by `kiln --help`."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api_client.manifest import Manifest
from api_client.schema import Attempt, Rung, SettingsReport
from worker.errors import OutOfMemory

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from worker.memory.device import DeviceInfo
    from worker.memory.faults import FaultPlan

log = logging.getLogger(__name__)

MIN_TILE = 32  # input pixels: below this a tile is mostly overlap
KEPT = 2  # upscalers resident at once (tens of MB each; least recently used dropped)


@dataclass
class LoadedUpscaler:
    """One upscaler on the device, as a LoadedPipeline reads to the record and the details."""

    manifest: Manifest
    model: Any  # spandrel's ImageModelDescriptor
    dtype: torch.dtype
    settings: SettingsReport
    load_s: float = 0.0
    device_bytes: int = 0
    tile: int = 0  # the tile size that last ran without running out of memory
    rung: Rung = "full"  # no offload rungs: what does not fit runs in smaller tiles
    compiled: bool = False
    quantized: dict[str, str] = field(default_factory=dict)

    @property
    def dtype_name(self) -> str:
        from worker.pipelines.resident import DTYPE_NAMES

        return DTYPE_NAMES[self.dtype]

    @property
    def sampler(self) -> str:
        """What the record and the details name as the sampler: the architecture."""
        return str(self.model.architecture.name)


def check_installed() -> None:
    """ImportError naming what spandrel needs when it cannot be imported (torchvision)."""
    try:
        import spandrel  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"upscalers load with spandrel, which failed to import ({exc}): install spandrel"
            " (pip install --no-deps spandrel einops) and the torchvision built for this torch"
        ) from None


def load_upscaler(
    manifest: Manifest, info: DeviceInfo, models_dir: Path, faults: FaultPlan
) -> LoadedUpscaler:
    """The manifest's file through spandrel (architecture, scale and precision from the state
    dict), placed on the device; ValueError when spandrel finds another scale than declared."""
    import torch

    from worker.memory import device as dev
    from worker.memory.peaks import module_bytes

    started = time.perf_counter()
    faults.check("load", "full")
    check_installed()
    import spandrel

    path = weights_file(manifest, models_dir)
    descriptor = spandrel.ModelLoader().load_from_file(path)
    if not isinstance(descriptor, spandrel.ImageModelDescriptor):
        raise ValueError(f"model {manifest.id}: {path} is not an image-to-image model")
    if descriptor.scale != manifest.scale:
        raise ValueError(
            f"model {manifest.id}: {path} is a {descriptor.scale}x {descriptor.architecture.name},"
            f" and the manifest declares scale {manifest.scale}"
        )
    report = SettingsReport()
    # Half precision where the card and the architecture have it; fp32 on a CPU.
    if info.accelerator and info.bf16 and descriptor.supports_bfloat16:
        dtype, why = torch.bfloat16, f"bf16 on {info.name} ({descriptor.architecture.name})"
    elif info.accelerator and info.fp16 and descriptor.supports_half:
        dtype, why = torch.float16, f"fp16 on {info.name} ({descriptor.architecture.name})"
    else:
        dtype, why = torch.float32, "fp32: no half precision here for this architecture"
    report.add("applied", "precision", why)
    before = dev.allocated_bytes(info)
    descriptor.to(torch.device(info.torch_device)).to(dtype).eval()
    loaded = LoadedUpscaler(manifest, descriptor, dtype, report, tile=manifest.tile or 512)
    if info.torch_device == "cpu":
        loaded.device_bytes = module_bytes(descriptor.model)
    else:
        loaded.device_bytes = max(dev.allocated_bytes(info) - before, 0)
    loaded.load_s = time.perf_counter() - started
    return loaded


def weights_file(manifest: Manifest, models_dir: Path) -> str:
    """The upscaler's file: a path (absolute, or under models_dir), else owner/repo/file on the
    hub (fetched into its cache, or found there); FileNotFoundError naming both places."""
    local = hub_file(manifest, models_dir)
    if isinstance(local, Path):
        return str(local)
    from huggingface_hub import hf_hub_download

    repo, name = local
    return str(hf_hub_download(repo, name, revision=manifest.revision))


def hub_file(manifest: Manifest, models_dir: Path) -> Path | tuple[str, str]:
    """Where an upscaler's source is: a local file, or (hub repo, file in it)."""
    path = Path(manifest.source).expanduser()
    path = path if path.is_absolute() else models_dir / path
    if path.is_file():
        return path
    parts = manifest.source.split("/")
    if Path(manifest.source).is_absolute() or len(parts) < 3:
        hint = " (build it: `kiln tiny-models`)" if manifest.id.startswith("tiny-") else ""
        raise FileNotFoundError(
            f"model {manifest.id}: source {manifest.source!r} is no file at {path}, nor"
            f" owner/repo/file on the hub{hint}"
        )
    return "/".join(parts[:2]), "/".join(parts[2:])


class Upscalers:
    """A renderer's resident upscalers, least recently used first, at most KEPT."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, LoadedUpscaler] = OrderedDict()

    def get(self, model_id: str) -> LoadedUpscaler | None:
        loaded = self._kept.get(model_id)
        if loaded is not None:
            self._kept.move_to_end(model_id)
        return loaded

    def put(self, loaded: LoadedUpscaler) -> None:
        self._kept[loaded.manifest.id] = loaded
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)


def upscale(
    loaded: LoadedUpscaler,
    images: list[Image.Image],
    attempts: list[Attempt],
    faults: FaultPlan,
    info: DeviceInfo,
) -> list[Image.Image]:
    """Each image scale times larger, in tiles; out of memory halves the tile and runs the image
    again, down to MIN_TILE (then OutOfMemory naming every size tried). The tile that worked is
    kept for the next job (a smaller card's lesson, learnt once)."""
    from worker.memory import device as dev
    from worker.memory.ladder import is_oom

    out = []
    for image in images:
        while True:
            tile = loaded.tile
            try:
                faults.check("upscale", loaded.rung)
                out.append(_run(loaded, image, tile))
                break
            except Exception as exc:
                if not is_oom(exc):
                    raise
                detail = f"tile {tile}px: {str(exc).splitlines()[0][:200]}"
                attempts.append(Attempt(rung="full", outcome="oom", phase="upscale", detail=detail))
                dev.empty_cache(info)
                if tile // 2 < MIN_TILE:
                    tried = ", ".join(a.detail.split(":")[0] for a in attempts if a.detail)
                    raise OutOfMemory(
                        f"model {loaded.manifest.id} ran out of memory upscaling"
                        f" {image.width}x{image.height} down to {MIN_TILE}px tiles ({tried})"
                    ) from exc
                loaded.tile = tile // 2
                log.info("upscale: out of memory at %dpx tiles; halving", tile)
    attempts.append(
        Attempt(rung="full", outcome="ok", phase="upscale", detail=f"tile {loaded.tile}px")
    )
    return out


def _run(loaded: LoadedUpscaler, image: Image.Image, tile: int) -> Image.Image:
    import numpy
    import torch
    from PIL import Image

    model = loaded.model
    pixels = torch.from_numpy(numpy.asarray(image.convert("RGB"), dtype=numpy.float32) / 255.0)
    batch = pixels.permute(2, 0, 1)[None].to(model.device, loaded.dtype)
    with torch.inference_mode():
        result = tiled(model, batch, model.scale, tile, loaded.manifest.tile_overlap)
    array = (result[0].float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255.0).round()
    return Image.fromarray(array.astype(numpy.uint8), "RGB")


def tiled(model: Any, batch: torch.Tensor, scale: int, tile: int, overlap: int) -> torch.Tensor:
    """model over batch (1, C, H, W) in tiles of at most tile px that overlap by overlap px,
    blended with weights that ramp down towards each tile's edges; one call when it fits."""
    import torch

    _, channels, height, width = batch.shape
    if height <= tile and width <= tile:
        return model(batch)  # type: ignore[no-any-return]
    overlap = min(overlap, tile // 4)
    out = torch.zeros(1, channels, height * scale, width * scale, device=batch.device)
    weight = torch.zeros(1, 1, height * scale, width * scale, device=batch.device)
    for top in _starts(height, tile, tile - overlap):
        for left in _starts(width, tile, tile - overlap):
            patch = batch[:, :, top : top + tile, left : left + tile]
            up = model(patch).float()
            ramp = _ramp(up.shape[-2], up.shape[-1], overlap * scale, up.device)
            rows = slice(top * scale, top * scale + up.shape[-2])
            cols = slice(left * scale, left * scale + up.shape[-1])
            out[:, :, rows, cols] += up * ramp
            weight[:, :, rows, cols] += ramp
    return out / weight


def _starts(size: int, tile: int, stride: int) -> list[int]:
    """Tile offsets covering size: every stride, the last one flush with the edge."""
    if size <= tile:
        return [0]
    starts = list(range(0, size - tile, stride))
    return [*starts, size - tile]


def _ramp(height: int, width: int, fade: int, device: Any) -> torch.Tensor:
    """Weights 1 inside, falling linearly over fade px towards each edge (never to 0, so an
    image edge that one tile alone covers keeps its value after the division)."""
    import torch

    def axis(n: int) -> torch.Tensor:
        index = torch.arange(n, device=device, dtype=torch.float32)
        edge = torch.minimum(index, n - 1 - index)
        return ((edge + 1) / (fade + 1)).clamp(max=1.0)

    return axis(height)[:, None] * axis(width)[None, :]
