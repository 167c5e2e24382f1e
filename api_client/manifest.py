"""The manifest schema and the rules a request must keep to; shared by client and worker."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api_client.errors import Problem, RequestRejected
from api_client.schema import MAX_IMAGES, MAX_PROMPT_CHARS, MAX_SEED, RenderRequest, Rung

Family = Literal["sd15", "sd2", "sdxl", "sd3"]
Scheduler = Literal[
    "dpmsolver",
    "euler",
    "euler-a",
    "euler-trailing",
    "ddim",
    "lcm",
    "flow-euler",
]
Switch = Literal["auto", "on", "off"]
SwitchName = Literal[
    "sdpa",
    "channels_last",
    "compile",
    "quantize",
    "vae_tiling",
    "attention_slicing",
    "taesd_preview",
]
QuantScheme = Literal["int8", "int8_dynamic", "int4", "fp8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepRange(_Strict):
    default: int = Field(ge=1)
    max: int = Field(ge=1, le=1000)

    @model_validator(mode="after")
    def _max_not_below_default(self) -> StepRange:
        if self.max < self.default:
            raise ValueError(f"max ({self.max}) must be >= default ({self.default})")
        return self


class GuidanceRange(_Strict):
    default: float = Field(ge=0)
    max: float = Field(ge=0, le=100)

    @model_validator(mode="after")
    def _max_not_below_default(self) -> GuidanceRange:
        if self.max < self.default:
            raise ValueError(f"max ({self.max}) must be >= default ({self.default})")
        return self


class Manifest(_Strict):
    """One model: where its weights live, what a request may ask of it, how to fit it on a card."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    family: Family
    source: str = Field(min_length=1)
    revision: str | None = None
    variant: str | None = None
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    scheduler: Scheduler | None = None
    steps: StepRange
    guidance: GuidanceRange
    resolutions: list[tuple[int, int]] = Field(min_length=1)
    min_vram_gb: float = Field(ge=0)
    rung_vram_gb: dict[Rung, float] = Field(default_factory=dict)
    quantize: dict[str, QuantScheme] = Field(default_factory=dict)
    compile: Literal["auto", "required", "off"] = "auto"
    benchmark_only: bool = False
    optimizations: dict[SwitchName, Switch] = Field(default_factory=dict)
    # An AutoencoderTiny (TAESD) for cheap previews while denoising: hub id or local directory.
    taesd: str | None = Field(default=None, min_length=1)
    # A replacement VAE (hub id or local directory), e.g. madebyollin/sdxl-vae-fp16-fix: an SDXL
    # VAE that does not overflow in fp16, so an fp16 card decodes without an fp32 upcast.
    vae: str | None = Field(default=None, min_length=1)

    @field_validator("resolutions")
    @classmethod
    def _sizes_are_latent_aligned(cls, sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for width, height in sizes:
            if width < 64 or height < 64 or width > 4096 or height > 4096:
                raise ValueError(f"{width}x{height} is outside 64..4096 px")
            if width % 8 or height % 8:
                raise ValueError(
                    f"{width}x{height} is not a multiple of 8 (the VAE's downscale factor)"
                )
        return sizes

    @field_validator("rung_vram_gb")
    @classmethod
    def _rung_needs_non_negative(cls, needs: dict[str, float]) -> dict[str, float]:
        for rung, need in needs.items():
            if rung == "full":
                raise ValueError("full needs min_vram_gb, not an entry here")
            if need < 0:
                raise ValueError(f"{rung} needs {need} GB; must be >= 0")
        return needs

    @property
    def default_size(self) -> tuple[int, int]:
        return self.resolutions[0]


def resolve_request(request: RenderRequest, manifest: Manifest) -> RenderRequest:
    """Fill defaults from the manifest and check every limit; RequestRejected names each break.

    Nothing is clamped: a value over its limit is an error, not a quietly smaller job.
    """
    if request.model != manifest.id:
        raise RequestRejected(
            [Problem("model", request.model, f"does not match manifest {manifest.id!r}")]
        )
    problems: list[Problem] = []
    steps = manifest.steps.default if request.steps is None else request.steps
    guidance = manifest.guidance.default if request.guidance is None else request.guidance
    default_w, default_h = manifest.default_size
    width = default_w if request.width is None else request.width
    height = default_h if request.height is None else request.height
    seed = random.randint(0, MAX_SEED) if request.seed is None else request.seed

    if not request.prompt.strip():
        problems.append(Problem("prompt", request.prompt, "must not be empty"))
    for field in ("prompt", "negative_prompt"):
        text: str = getattr(request, field)
        if len(text) > MAX_PROMPT_CHARS:
            problems.append(
                Problem(field, f"<{len(text)} chars>", f"exceeds {MAX_PROMPT_CHARS} characters")
            )
        elif "\x00" in text:
            problems.append(Problem(field, text[:40], "must not contain NUL characters"))
    if not 1 <= steps <= manifest.steps.max:
        problems.append(
            Problem("steps", steps, f"must be between 1 and {manifest.steps.max} (manifest max)")
        )
    if not math.isfinite(guidance) or not 0 <= guidance <= manifest.guidance.max:
        problems.append(
            Problem(
                "guidance",
                guidance,
                f"must be between 0 and {manifest.guidance.max} (manifest cap)",
            )
        )
    if (width, height) not in {tuple(size) for size in manifest.resolutions}:
        allowed = ", ".join(f"{w}x{h}" for w, h in manifest.resolutions)
        problems.append(Problem("width x height", f"{width}x{height}", f"must be one of {allowed}"))
    if not 0 <= seed <= MAX_SEED:
        problems.append(Problem("seed", seed, f"must be between 0 and {MAX_SEED}"))
    if not 1 <= request.num_images <= MAX_IMAGES:
        problems.append(
            Problem("num_images", request.num_images, f"must be between 1 and {MAX_IMAGES}")
        )
    if problems:
        raise RequestRejected(problems, model=manifest.id)
    return request.model_copy(
        update={
            "steps": steps,
            "guidance": float(guidance),
            "width": width,
            "height": height,
            "seed": seed,
        }
    )


def check_servable(request: RenderRequest, manifests: dict[str, Manifest]) -> Manifest:
    """The manifest a normal job may use, or RequestRejected naming the model."""
    manifest = manifests.get(request.model)
    if manifest is None:
        known = ", ".join(sorted(manifests)) or "none published"
        raise RequestRejected([Problem("model", request.model, f"unknown model; known: {known}")])
    if manifest.benchmark_only:
        raise RequestRejected(
            [
                Problem(
                    "model",
                    request.model,
                    "is benchmark_only: listed for `kiln bench`, refused for jobs",
                )
            ]
        )
    return manifest


def load_manifest_file(path: Path) -> Manifest:
    """Parse one YAML manifest; raise ManifestInvalid naming file, field, value and rule."""
    from pydantic import ValidationError

    try:
        import yaml  # the client proper needs only what workers publish to Redis
    except ImportError:
        rule = "reading manifest files needs PyYAML (pip install pyyaml); or publish them to Redis"
        raise ManifestInvalid(path, [Problem("(file)", str(path), rule)]) from None

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ManifestInvalid(
            path, [Problem("(file)", str(path), f"unreadable YAML: {exc}")]
        ) from None
    if not isinstance(data, dict):
        raise ManifestInvalid(path, [Problem("(file)", _type_name(data), "must be a YAML mapping")])
    problems: list[Problem] = []
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            field = ".".join(str(part) for part in err["loc"]) or "(manifest)"
            problems.append(Problem(field, err.get("input"), err["msg"]))
        raise ManifestInvalid(path, problems) from None
    if manifest.id != path.stem:
        raise ManifestInvalid(
            path, [Problem("id", manifest.id, f"must equal the file stem {path.stem!r}")]
        )
    return manifest


def load_manifest_dir(directory: Path) -> tuple[dict[str, Manifest], list[ManifestInvalid]]:
    """Every manifest (*.yaml, *.yml) in directory, and every file that failed."""
    if not directory.is_dir():
        bad = ManifestInvalid(
            directory, [Problem("(dir)", str(directory), "manifest directory not found")]
        )
        return {}, [bad]
    manifests: dict[str, Manifest] = {}
    failures: list[ManifestInvalid] = []
    for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
        try:
            manifest = load_manifest_file(path)
        except ManifestInvalid as exc:
            failures.append(exc)
            continue
        if manifest.id in manifests:
            failures.append(
                ManifestInvalid(path, [Problem("id", manifest.id, "duplicate id in directory")])
            )
            continue
        manifests[manifest.id] = manifest
    return manifests, failures


class ManifestInvalid(Exception):
    """A manifest file breaks the schema; carries every problem found in it."""

    def __init__(self, path: Path, problems: list[Problem]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  {path}: {p.field} = {p.value!r}: {p.rule}" for p in problems)
        super().__init__(f"invalid manifest {path}:\n{lines}")


def _type_name(value: object) -> str:
    return type(value).__name__
