"""Generation details inside every image kiln writes, so the file alone says how to render it
again: one JSON document (ImageDetails) under one key per format, written at encode and read
back by `kiln replay`. No torch here: reading an image's details loads no model.

- PNG: an iTXt chunk "kiln" holding the JSON, beside a "parameters" text chunk in
  AUTOMATIC1111's layout (what A1111's PNG Info, Forge, ComfyUI loaders and Civitai read) and
  "Software".
- WebP and JPEG: the JSON in EXIF UserComment (Exif IFD tag 0x9286, character code UNICODE:
  UTF-16 in the EXIF block's byte order), beside EXIF Software. UTF-16 keeps the worst case,
  two 4000-character prompts of emoji, near 33 kB, inside the 64 kB of a JPEG's EXIF segment;
  the same JSON escaped to ASCII (ImageDescription's type) would need 96 kB.

Over 400 lines because the details' schema, their replay request, their writing into each
format and their reading back with every refusal are one contract, read together.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from PIL import Image
from PIL.PngImagePlugin import PngInfo
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_client.errors import short
from api_client.samplers import Sampler, Sigmas, a1111_schedule, to_a1111
from api_client.schema import (
    MAX_CONTROLS,
    MAX_LORAS,
    ControlChoice,
    ControlReport,
    HiresRequest,
    LoraChoice,
    Mode,
    OutputFormat,
    ReferenceChoice,
    ReferenceReport,
    RenderRequest,
    Rung,
    StepCacheReport,
)
from worker.errors import CannotReplay
from worker.files.tags import DETAILS_KEY, details_from_exif, exif_with_details

if TYPE_CHECKING:
    from worker.pipelines.resident import Rendered

DETAILS_VERSION: Literal[1] = 1
# Details nest three deep (the object, its loras list, a LoRA); a document nested deeper than this
# is no kiln's, and one nested thousands deep would overflow the JSON reader's stack.
MAX_DEPTH = 8
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


class LoraWeight(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str
    weight: float


class InputDigest(BaseModel):
    """An input image of the job (img2img, inpaint, edit, a control's, the reference), by the
    request field that carried it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    field: Literal["image", "mask", "controls.0.image", "controls.1.image", "reference.image"]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ImageDetails(BaseModel):
    """What rendered one image: the resolved request, and the pipeline state that changes pixels
    (rung, dtype, compiled, quantization, device). Nothing that differs between two jobs of the
    same request (no job id, no clock), so the same request still gives the same bytes."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    details_version: Literal[1] = DETAILS_VERSION
    kiln: str  # the kiln version that rendered it
    model: str
    revision: str | None  # the manifest's hub revision; None: whatever it resolved to then
    prompt: str
    negative_prompt: str
    seed: int  # the request's; image i of a batch was drawn from seed + i
    steps: int
    guidance: float
    true_cfg: float | None
    scheduler: str  # the scheduler class the pipeline ran
    # The request's sampler and sigmas (api_client.samplers); None: the manifest's scheduler at its
    # own sigmas. A replay pins them.
    sampler: Sampler | None = None
    sigmas: Sigmas | None = None
    width: int
    height: int
    num_images: int
    index: int = Field(ge=0)  # this image's place in the job's batch
    format: OutputFormat
    rung: Rung
    dtype: str
    compiled: bool
    device: str
    quantized: dict[str, str]
    loras: list[LoraWeight] = Field(max_length=MAX_LORAS)  # a request's own bound
    inputs: list[InputDigest]
    mode: Mode = "txt2img"
    strength: float | None = None
    # The step cache that reused steps for it ("first_block threshold=0.08"); None: every step
    # was computed. A replay pins it either way.
    step_cache: str | None = None
    # Its controls; each one's image is among the inputs (controls.<i>.image), as given, before
    # the worker's preprocess.
    controls: list[ControlReport] = Field(default_factory=list, max_length=MAX_CONTROLS)
    # Its reference image's IP-Adapter strength; the image is among the inputs (reference.image).
    reference: ReferenceReport | None = None
    # A hires pass (its defaults filled in): the image is its scale of width x height.
    hires: HiresRequest | None = None
    # A video's frames and frames a second (a video model's; None for an image).
    frames: int | None = None
    fps: int | None = None

    def replay_request(self) -> RenderRequest:
        """The request that renders this image again: the same batch (image `index` of it),
        pinned to the rung and compile state that made it, with its adapters at their weights."""
        # Inputs by their sha256: a replay finds them while the uploads live (KILN_INPUT_TTL_S);
        # the worker checks each one's sha256 on read.
        uploads: dict[str, str] = {i.field: f"kiln-input:{i.sha256}" for i in self.inputs}
        try:
            return self._request(uploads)
        except ValidationError as exc:
            problems = "; ".join(_problem(err) for err in exc.errors())
            raise CannotReplay(f"its kiln details make no valid request: {problems}") from None

    def _request(self, uploads: dict[str, str]) -> RenderRequest:
        return RenderRequest(
            mode=None if self.mode == "txt2img" else self.mode,
            image=uploads.get("image"),
            mask=uploads.get("mask"),
            strength=self.strength,
            loras=[LoraChoice(name=x.name, weight=x.weight) for x in self.loras] or None,
            model=self.model,
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            steps=self.steps,
            guidance=self.guidance,
            true_cfg=self.true_cfg,
            width=self.width,
            height=self.height,
            seed=self.seed,
            num_images=self.num_images,
            output_format=self.format,
            rung=self.rung,
            compile=self.compiled,
            step_cache=self.step_cache is not None,
            controls=[
                ControlChoice(
                    name=c.name,
                    image=uploads.get(f"controls.{i}.image", ""),
                    strength=c.strength,
                    start=c.start,
                    end=c.end,
                    preprocess=c.preprocess,
                )
                for i, c in enumerate(self.controls)
            ]
            or None,
            reference=(
                None
                if self.reference is None
                else ReferenceChoice(
                    image=uploads.get("reference.image", ""), strength=self.reference.strength
                )
            ),
            hires=self.hires,
            sampler=self.sampler,
            sigmas=self.sigmas,
            frames=self.frames,
            fps=self.fps,
        )

    def document(self) -> str:
        """The JSON a file carries; an image's leaves out the video fields, so its bytes are
        what they were before videos."""
        video = {"frames", "fps"} if self.frames is None else set()
        return self.model_dump_json(exclude=video)


def image_details(
    request: RenderRequest,
    loaded: Rendered,
    index: int,
    inputs: list[InputDigest],
    device: str,
    step_cache: StepCacheReport | None = None,
) -> ImageDetails:
    """What image `index` of a job carries inside its file: enough to render it again."""
    cached = None
    if step_cache is not None:
        params = " ".join(
            f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in step_cache.params.items()
        )
        cached = f"{step_cache.kind} {params}".strip()
    return ImageDetails(
        kiln=kiln_version(),
        model=request.model,
        revision=loaded.manifest.revision,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        seed=int(request.seed or 0),
        steps=int(request.steps or 0),
        guidance=float(request.guidance or 0.0),
        true_cfg=request.true_cfg,
        scheduler=loaded.sampler if request.sampler is None else _scheduler(loaded, request),
        sampler=request.sampler,
        sigmas=request.sigmas,
        width=int(request.width or 0),
        height=int(request.height or 0),
        num_images=request.num_images,
        index=index,
        format=request.output_format,
        rung=loaded.rung,
        dtype=loaded.dtype_name,
        compiled=loaded.compiled,
        device=device,
        quantized=dict(loaded.quantized),
        loras=[LoraWeight(name=c.name, weight=float(c.weight or 0.0)) for c in request.loras or []],
        inputs=inputs,
        mode=request.mode or "txt2img",
        strength=request.strength,
        step_cache=cached,
        controls=[ControlReport.of(choice) for choice in request.controls or []],
        reference=ReferenceReport.of(request.reference),
        hires=request.hires,
        frames=request.frames,
        fps=request.fps,
    )


def _scheduler(loaded: Rendered, request: RenderRequest) -> str:
    """The scheduler class a job's own sampler ran as (worker.pipelines.samplers)."""
    from worker.pipelines.samplers import class_name

    assert request.sampler is not None
    return class_name(loaded.manifest.family_row, request.sampler)


# pyproject.toml's [project] name: what importlib.metadata knows kiln's version by.
DISTRIBUTION = "kiln-render"


@functools.cache
def kiln_version() -> str:
    """The installed kiln's version, recorded in every image's details."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def save_options(details: ImageDetails, fmt: OutputFormat) -> dict[str, Any]:
    """Pillow save() arguments that write details into an image of this format."""
    document = details.document()
    software = f"kiln {details.kiln}"
    if fmt == "png":
        info = PngInfo()
        info.add_itxt(DETAILS_KEY, document)
        info.add_text("parameters", parameters_text(details))
        info.add_text("Software", software)
        return {"pnginfo": info}
    return {"exif": exif_with_details(document, software)}


def parameters_text(details: ImageDetails) -> str:
    """A1111's "parameters" layout: prompt, negative prompt, then one line of `Key: value`."""
    fields: list[tuple[str, object]] = [
        ("Steps", details.steps),
        # A kiln sampler by A1111's name ("Euler a"), else the scheduler class that ran.
        ("Sampler", details.scheduler if details.sampler is None else to_a1111(details.sampler)),
        ("CFG scale", details.guidance),
        # A1111's seed is the image's own; kiln draws image i of a batch from seed + i.
        ("Seed", details.seed + details.index),
        ("Size", f"{details.width}x{details.height}"),
        ("Model", details.model),
    ]
    if details.sigmas is not None:  # where A1111 1.9 and later write the schedule
        fields.insert(2, ("Schedule type", a1111_schedule(details.sigmas)))
    if details.true_cfg is not None:
        fields.append(("True CFG scale", details.true_cfg))
    if details.step_cache is not None:
        fields.append(("Step cache", details.step_cache))
    if details.hires is not None:  # A1111's hires fix fields, in its words
        hires = details.hires
        fields.append(("Denoising strength", hires.strength))
        fields.append(("Hires upscale", hires.scale))
        fields.append(("Hires steps", hires.steps))
        fields.append(
            ("Hires upscaler", "Latent" if hires.upscaler == "latent" else hires.upscaler)
        )
    # The layout A1111's ControlNet extension writes, one quoted field per unit.
    for i, c in enumerate(details.controls):
        unit = (
            f"Module: {c.preprocess}, Model: {c.name}, Weight: {c.strength:g},"
            f" Guidance Start: {c.start:g}, Guidance End: {c.end:g}"
        )
        fields.append((f"ControlNet {i}", f'"{unit}"'))
    if details.reference is not None:  # A1111's IP-Adapter unit, by its model
        unit = f"Module: ip-adapter_clip, Model: ip-adapter, Weight: {details.reference.strength:g}"
        fields.append((f"ControlNet {len(details.controls)}", f'"{unit}"'))
    fields.append(("Version", f"kiln {details.kiln}"))
    # A1111 names each LoRA in the prompt as <lora:name:weight>; readers of its layout (Civitai,
    # image browsers) find the adapters there.
    tags = "".join(f" <lora:{lora.name}:{lora.weight:g}>" for lora in details.loras)
    lines = [details.prompt + tags]
    if details.negative_prompt:
        lines.append(f"Negative prompt: {details.negative_prompt}")
    lines.append(", ".join(f"{key}: {value}" for key, value in fields))
    return "\n".join(lines)


def read_details(path: Path) -> ImageDetails:
    """The details kiln wrote into this image file; CannotReplay naming the file and what is
    missing or wrong (never a traceback for a file that is not what it should be)."""
    # Pillow's words for a file that is missing, not an image, truncated, or of absurd size.
    broken = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
    try:
        if _is_av_video(path):
            return parse_details(_video_document(path), str(path))
        with Image.open(path) as image:
            document = _document(image, path)
    except broken as exc:
        raise CannotReplay(f"{path}: not an image kiln can read: {exc}") from None
    return parse_details(document, str(path))


def _is_av_video(path: Path) -> bool:
    """An MP4 (an ISO box "ftyp" at byte 4) or a WebM (EBML's magic): a video kiln wrote through
    FFmpeg. An animated WebP is read as any WebP, by Pillow."""
    with open(path, "rb") as handle:
        head = handle.read(12)
    return head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3"


def _video_document(path: Path) -> str:
    """The JSON in a video's container metadata (worker.files.video), or CannotReplay."""
    from worker.files import video

    try:
        document = video.read_details(path.read_bytes())
    except ValueError as exc:  # worker.files.video's word for a file FFmpeg cannot read
        raise CannotReplay(f"{path}: {exc}") from None
    if document is None:
        raise CannotReplay(f"{path}: carries no kiln details (no {DETAILS_KEY!r} metadata tag)")
    return document


def parse_details(document: str, where: str) -> ImageDetails:
    """An ImageDetails from its JSON; CannotReplay naming each field that is wrong."""
    depth = nesting_depth(document)
    if depth > MAX_DEPTH:
        raise CannotReplay(
            f"{where}: its kiln details (the {DETAILS_KEY!r} chunk) nest {depth} levels deep;"
            f" kiln's nest at most {MAX_DEPTH}"
        )
    try:
        data = json.loads(document)
    except json.JSONDecodeError as exc:
        raise CannotReplay(f"{where}: its kiln details are not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CannotReplay(f"{where}: its kiln details are not a JSON object")
    version = data.get("details_version")
    if version != DETAILS_VERSION:
        raise CannotReplay(
            f"{where}: its kiln details are version {short(version)!r}; this kiln reads"
            f" version {DETAILS_VERSION} (details_version)"
        )
    try:
        return ImageDetails.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise CannotReplay(f"{where}: its kiln details are invalid: {problems}") from None


def nesting_depth(document: str) -> int:
    """How deep a JSON document's arrays and objects nest, counted without parsing it (brackets
    inside strings aside), so that a hostile depth is refused before json.loads recurses."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub("", document)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _problem(error: Any) -> str:
    field = ".".join(str(part) for part in error["loc"])
    if error["type"] == "missing":
        return f"{field}: missing"
    return f"{field}={short(error.get('input'))!r}: {error['msg']}"


def _document(image: Image.Image, path: Path) -> str:
    """The JSON text under kiln's key in this image, or CannotReplay saying where kiln looked."""
    if image.format == "PNG":
        text = getattr(image, "text", {})
        if DETAILS_KEY not in text:
            raise CannotReplay(f"{path}: carries no kiln details (no {DETAILS_KEY!r} PNG chunk)")
        return str(text[DETAILS_KEY])
    if image.format not in ("WEBP", "JPEG"):
        raise CannotReplay(
            f"{path}: a {image.format} image carries no kiln details; kiln writes them into"
            " PNG, WebP and JPEG"
        )
    try:
        document = details_from_exif(image.getexif())
    except UnicodeDecodeError as exc:
        raise CannotReplay(f"{path}: its EXIF UserComment is not UTF-16 text: {exc}") from None
    if document is None:
        raise CannotReplay(
            f"{path}: carries no kiln details (no UNICODE EXIF UserComment in this"
            f" {image.format} file)"
        )
    return document
