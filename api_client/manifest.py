"""The manifest schema and the rules a request must keep to; shared by client and worker.

Over 300 lines because both halves grew a table per family (grid, CFG rule, modes) and each rule
names its field, value and limit in its own words; they change together."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api_client.errors import Problem, RequestRejected, short
from api_client.loras import LoraSpec, check_lora_names, resolve_loras
from api_client.schema import (
    MAX_IMAGES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    Mode,
    RenderRequest,
    Rung,
)

Family = Literal["sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "qwenimage", "zimage"]
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
# float8: torchao float8 weights, only where the card has fp8 math (sm89+, MI300); the others are
# integer weight schemes that run wherever torchao's kernels do.
QuantScheme = Literal["float8", "int8", "int8_dynamic", "int4"]

# Pixels per latent cell: the VAE's 8x, times the 2x2 patch of the transformer families.
GRID: dict[str, int] = {
    "sd15": 8,
    "sd2": 8,
    "sdxl": 8,
    "sd3": 16,
    "flux": 16,
    "flux2": 16,
    "qwenimage": 16,
    "zimage": 16,
}


# The modes each family's pipelines serve here (from_pipe of the resident one: worker.families).
FAMILY_MODES: dict[str, tuple[Mode, ...]] = {
    **{f: ("txt2img", "img2img", "inpaint") for f in ("sd15", "sd2", "sdxl", "sd3", "zimage")},
    **{f: ("txt2img", "img2img", "inpaint", "edit") for f in ("flux", "qwenimage")},
    "flux2": ("txt2img",),
}
# edit is an edit model's own checkpoint (FLUX.1 Kontext, Qwen-Image-Edit) whose pipeline class is
# the resident one, so a manifest that lists edit lists only what that pipeline renders: Kontext
# also renders from a prompt alone; Qwen-Image-Edit's always reads an input image.
EDIT_MODES: dict[str, tuple[Mode, ...]] = {"flux": ("txt2img", "edit"), "qwenimage": ("edit",)}
TXT2IMG_ONLY: tuple[Mode, ...] = ("txt2img",)
# How much of an input image img2img and inpaint re-noise unless the request says (A1111's
# default denoising strength).
DEFAULT_STRENGTH = 0.75


@dataclass(frozen=True)
class CfgRule:
    """Which request field runs a family's classifier-free guidance, and above what value.

    A negative prompt only steers a render through that guidance, so without it a negative
    prompt is refused rather than ignored."""

    field: Literal["guidance", "true_cfg"]
    above: float


CFG: dict[str, CfgRule] = {
    "sd15": CfgRule("guidance", 1.0),
    "sd2": CfgRule("guidance", 1.0),
    "sdxl": CfgRule("guidance", 1.0),
    "sd3": CfgRule("guidance", 1.0),
    "flux2": CfgRule("guidance", 1.0),  # FLUX.2 klein base; the distilled klein caps guidance at 1
    "zimage": CfgRule("guidance", 0.0),  # ZImagePipeline runs CFG for any guidance above 0
    # FLUX.1's guidance is an embedding the distilled model was trained with, not CFG; FLUX.1 and
    # Qwen-Image run true CFG (a second pass on the negative prompt) through true_cfg.
    "flux": CfgRule("true_cfg", 1.0),
    "qwenimage": CfgRule("true_cfg", 1.0),
}


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
    # True CFG with a negative prompt (flux, qwenimage); absent: not allowed.
    true_cfg: GuidanceRange | None = None
    resolutions: list[tuple[int, int]] = Field(min_length=1)
    # Prompt tokens the text encoder reads (the pipeline's max_sequence_length; FLUX.1-schnell's
    # T5 was trained on 256, the pipeline's default is 512). None: the pipeline's default.
    max_sequence_length: int | None = Field(default=None, ge=16, le=1024)
    min_vram_gb: float = Field(ge=0)
    rung_vram_gb: dict[Rung, float] = Field(default_factory=dict)
    # 16-bit weight size of each component. When given, min_vram_gb and rung_vram_gb are the
    # figures with nothing quantized, and the ladder counts each component at the precision and
    # quantization this card gives it (worker.ladder.rung_need_gb).
    component_gb: dict[str, float] = Field(default_factory=dict)
    # Component -> schemes in order of preference; the first the card can run is used.
    quantize: dict[str, list[QuantScheme]] = Field(default_factory=dict)
    compile: Literal["auto", "required", "off"] = "auto"
    # regional: compile_repeated_blocks; whole: the denoiser at once; auto: regional where the
    # denoiser declares repeated blocks.
    compile_method: Literal["auto", "regional", "whole"] = "auto"
    # What requests may ask for; an input image's modes only where the manifest lists them.
    modes: list[Mode] = Field(default_factory=lambda: list(TXT2IMG_ONLY), min_length=1)
    benchmark_only: bool = False
    optimizations: dict[SwitchName, Switch] = Field(default_factory=dict)
    # An AutoencoderTiny (TAESD) for cheap previews while denoising: hub id or local directory.
    taesd: str | None = Field(default=None, min_length=1)
    # A replacement VAE (hub id or local directory), e.g. madebyollin/sdxl-vae-fp16-fix: an SDXL
    # VAE that does not overflow in fp16, so an fp16 card decodes without an fp32 upcast.
    vae: str | None = Field(default=None, min_length=1)
    # Adapters a request may name, hot-swapped on the resident denoiser (worker.adapters).
    loras: dict[str, LoraSpec] = Field(default_factory=dict)

    @field_validator("loras")
    @classmethod
    def _lora_names(cls, loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
        return check_lora_names(loras)

    @field_validator("true_cfg")
    @classmethod
    def _true_cfg_family(cls, value: GuidanceRange | None, info: ValidationInfo) -> object:
        family = info.data.get("family")
        if value is not None and family is not None and CFG[family].field != "true_cfg":
            raise ValueError(f"family {family} has no true CFG; its CFG is guidance")
        return value

    @field_validator("resolutions")
    @classmethod
    def _sizes_on_the_grid(
        cls, sizes: list[tuple[int, int]], info: ValidationInfo
    ) -> list[tuple[int, int]]:
        family = info.data.get("family")
        grid = GRID.get(family or "", 8)
        for width, height in sizes:
            if width < 64 or height < 64 or width > 4096 or height > 4096:
                raise ValueError(f"{width}x{height} is outside 64..4096 px")
            if width % grid or height % grid:
                why = "the VAE's 8x" + (" times the 2x2 patch" if grid == 16 else "")
                raise ValueError(
                    f"{width}x{height} is off the {family} grid: width and height must be a"
                    f" multiple of {grid} ({why})"
                )
        return sizes

    @field_validator("max_sequence_length")
    @classmethod
    def _long_prompt_encoder(cls, tokens: int | None, info: ValidationInfo) -> int | None:
        family = info.data.get("family")
        if tokens is not None and family in ("sd15", "sd2", "sdxl"):
            raise ValueError(f"family {family} reads prompts with CLIP alone (77 tokens)")
        return tokens

    @field_validator("component_gb")
    @classmethod
    def _sizes_positive(cls, sizes: dict[str, float]) -> dict[str, float]:
        for component, size in sizes.items():
            if size <= 0:
                raise ValueError(f"{component} is {size} GB; must be > 0")
        return sizes

    @field_validator("quantize", mode="before")
    @classmethod
    def _schemes_as_lists(cls, wanted: object) -> object:
        """`{text_encoder_3: int8}` is a list of one; a list must name each scheme once."""
        if not isinstance(wanted, dict):
            return wanted
        lists = {c: [s] if isinstance(s, str) else s for c, s in wanted.items()}
        for component, schemes in lists.items():
            if isinstance(schemes, list) and (not schemes or len(set(schemes)) < len(schemes)):
                raise ValueError(
                    f"{component}: {schemes!r} must name one or more schemes, once each"
                )
        return lists

    @field_validator("quantize")
    @classmethod
    def _quantized_are_sized(
        cls, wanted: dict[str, list[str]], info: ValidationInfo
    ) -> dict[str, list[str]]:
        sizes = info.data.get("component_gb") or {}
        unsized = sorted(set(wanted) - set(sizes))
        if sizes and unsized:
            raise ValueError(
                f"{', '.join(unsized)} must have a size in component_gb too, or the ladder"
                " cannot count what quantizing saves"
            )
        return wanted

    @field_validator("modes")
    @classmethod
    def _modes_served(cls, modes: list[str], info: ValidationInfo) -> list[str]:
        family = info.data.get("family")
        served = FAMILY_MODES.get(family or "", ())
        for mode in modes:
            if mode not in served:
                raise ValueError(f"{mode}: family {family} serves {', '.join(served)} here")
        edit = EDIT_MODES.get(family or "", ())
        if "edit" in modes and not set(modes) <= set(edit):
            raise ValueError(
                f"{', '.join(m for m in modes if m not in edit)}: a {family} manifest with edit is"
                f" an edit model, whose pipeline serves {', '.join(edit)} only"
            )
        return modes

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
        hint = "; its CFG is true_cfg" if manifest.true_cfg is not None else ""
        problems.append(
            Problem(
                "guidance",
                guidance,
                f"must be between 0 and {manifest.guidance.max} (manifest cap{hint})",
            )
        )
    true_cfg = _true_cfg(request, manifest, problems)
    problems += _negative_prompt_problems(request, manifest, guidance, true_cfg)
    mode, strength = _mode(request, manifest, steps, problems)
    if (width, height) not in {tuple(size) for size in manifest.resolutions}:
        allowed = ", ".join(f"{w}x{h}" for w, h in manifest.resolutions)
        problems.append(Problem("width x height", f"{width}x{height}", f"must be one of {allowed}"))
    if not 0 <= seed <= MAX_SEED:
        problems.append(Problem("seed", seed, f"must be between 0 and {MAX_SEED}"))
    if not 1 <= request.num_images <= MAX_IMAGES:
        problems.append(
            Problem("num_images", request.num_images, f"must be between 1 and {MAX_IMAGES}")
        )
    problems += _pin_problems(request, manifest)
    loras = resolve_loras(request.loras, manifest.loras, manifest.id, problems)
    if problems:
        raise RequestRejected(problems, model=manifest.id)
    return request.model_copy(
        update={
            "steps": steps,
            "guidance": float(guidance),
            "true_cfg": true_cfg,
            # txt2img stays unset, so a prompt-only request reads as it did before modes.
            "mode": None if mode == "txt2img" else mode,
            "strength": strength,
            "loras": loras,
            "width": width,
            "height": height,
            "seed": seed,
        }
    )


def _mode(
    request: RenderRequest, manifest: Manifest, steps: int, problems: list[Problem]
) -> tuple[str, float | None]:
    """The request's mode (by default from its image and mask), what it needs given, and its
    strength; problems name each break. The references' own form is checked here too, without
    reading them (api_client.inputs.parse_ref): that needs Redis or the store."""
    from api_client.inputs import InputRefused, parse_ref

    image, mask = request.image, request.mask
    # An edit model's image is an edit's: it serves no img2img.
    given = "edit" if "edit" in manifest.modes else "img2img"
    mode = request.mode or ("inpaint" if mask else given if image else "txt2img")
    if mode not in manifest.modes:
        rule = f"must be one of {', '.join(manifest.modes)} (manifest {manifest.id}'s modes)"
        problems.append(Problem("mode", mode, rule))
    needs = {"img2img": ("image",), "inpaint": ("image", "mask"), "edit": ("image",)}.get(mode, ())
    for field, value in (("image", image), ("mask", mask)):
        if value is None and field in needs:
            problems.append(
                Problem(
                    field, None, f"mode {mode} needs {'an' if field == 'image' else 'a'} {field}"
                )
            )
        elif value is not None and field not in needs:
            problems.append(Problem(field, short(value, 60), f"mode {mode} takes no {field}"))
        elif value is not None:
            try:
                parse_ref(value, field)
            except InputRefused as exc:
                problems.append(exc.problem)
    if mode in ("txt2img", "edit"):
        # The edit pipelines denoise from noise with the image as context: nothing to re-noise.
        if request.strength is not None:
            problems.append(Problem("strength", request.strength, f"mode {mode} takes none"))
        return mode, None
    strength = DEFAULT_STRENGTH if request.strength is None else request.strength
    if not math.isfinite(strength) or not 0 < strength <= 1:
        problems.append(Problem("strength", strength, "must be above 0 and at most 1"))
    elif int(steps * strength) < 1:
        rule = f"with {steps} steps re-noises {steps * strength:g} of them; needs at least 1"
        problems.append(Problem("strength", strength, rule))
    return mode, float(strength)


def _true_cfg(request: RenderRequest, manifest: Manifest, problems: list[Problem]) -> float | None:
    """The request's true CFG scale, the manifest's default, or None where the model has none."""
    allowed = manifest.true_cfg
    if allowed is None:
        if request.true_cfg is not None:
            problems.append(
                Problem("true_cfg", request.true_cfg, f"model {manifest.id} has no true CFG")
            )
        return None
    value = allowed.default if request.true_cfg is None else request.true_cfg
    if not math.isfinite(value) or not 1 <= value <= allowed.max:
        problems.append(
            Problem(
                "true_cfg",
                value,
                f"must be between 1 (off) and {allowed.max} (manifest cap)",
            )
        )
    return float(value)


def _negative_prompt_problems(
    request: RenderRequest, manifest: Manifest, guidance: float, true_cfg: float | None
) -> list[Problem]:
    """A negative prompt steers only through the family's CFG; without it, it would be ignored."""
    if not request.negative_prompt.strip():
        return []
    rule = CFG[manifest.family]
    value = guidance if rule.field == "guidance" else true_cfg
    if value is not None and value > rule.above:
        return []
    if value is None:
        why = f"model {manifest.id} has no true CFG (its manifest allows no true_cfg)"
    else:
        why = f"{rule.field} is {value:g}; the negative prompt needs {rule.field} above"
        why += f" {rule.above:g} on {manifest.id}, or it has no effect"
    return [Problem("negative_prompt", request.negative_prompt[:40], why)]


def _pin_problems(request: RenderRequest, manifest: Manifest) -> list[Problem]:
    """A replay's compile pin against its rung and the manifest: torch.compile runs only at full
    (offload hooks and Inductor conflict), never where the manifest switches it off, and always
    where the manifest requires it at full."""
    if request.compile is True and request.rung not in (None, "full"):
        why = f"compile runs only at rung full, and the request pins rung {request.rung}"
        return [Problem("compile", True, why)]
    if request.compile is True and manifest.compile == "off":
        return [Problem("compile", True, f"model {manifest.id}'s manifest switches compile off")]
    if request.compile is False and request.rung == "full" and manifest.compile == "required":
        why = f"model {manifest.id}'s manifest requires compile at rung full (compile: required)"
        return [Problem("compile", False, why)]
    return []


def check_servable(request: RenderRequest, manifests: dict[str, Manifest]) -> Manifest:
    """The manifest a normal job may use, or RequestRejected naming the model."""
    manifest = manifests.get(request.model)
    if manifest is None:
        known = ", ".join(sorted(manifests)) or (
            "none published (publish them with `kiln manifests publish`, or start a worker)"
        )
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
