"""The manifest schema and the loading of manifest files (shipped first, then KILN_MANIFESTS);
shared by client, gateway and worker. What a manifest of each family may declare is its row in
api_client.families; what a request may ask of a manifest, api_client/resolve.py.

Over 400 lines because the schema, its per-field rules and the reading of manifest directories
are one contract: what a manifest is and where one comes from."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api_client.controls import ControlNetSpec, check_control_names, control_refusal
from api_client.errors import Problem
from api_client.families import FAMILIES, Family, FamilyRow, families_with, family_row
from api_client.loras import LoraSpec, check_lora_names
from api_client.model_files import ComponentFile, check_components, weights_refusal
from api_client.references import IPAdapterSpec, reference_refusal
from api_client.samplers import Sampler
from api_client.schema import (
    MAX_FPS,
    VIDEO_MODES,
    Mode,
    Rung,
)
from api_client.step_caches import StepCacheSpec

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
    "step_cache",
]
# float8: torchao float8 weights, only where the card has fp8 math (sm89+, MI300); the others are
# integer weight schemes that run wherever torchao's kernels do.
QuantScheme = Literal["float8", "int8", "int8_dynamic", "int4"]

TXT2IMG_ONLY: tuple[Mode, ...] = ("txt2img",)
# How much of an input image img2img and inpaint re-noise unless the request says (A1111's
# default denoising strength).
DEFAULT_STRENGTH = 0.75


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


class FrameRange(_Strict):
    """A video model's frames: what a request gets unless it asks, and the most it may ask."""

    default: int = Field(ge=1)
    max: int = Field(ge=1, le=1025)

    @model_validator(mode="after")
    def _max_not_below_default(self) -> FrameRange:
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


def _same(given: Any, fixed: Any) -> bool:
    """Whether a given field is the family's fixed value for it (as a manifest dumps it)."""
    if isinstance(given, BaseModel):
        given = given.model_dump()
    if isinstance(given, dict) and isinstance(fixed, dict):
        return {k: float(v) for k, v in given.items()} == {k: float(v) for k, v in fixed.items()}
    return False


class Manifest(_Strict):
    """One model: where its weights live, what a request may ask of it, how to fit it on a card."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    family: Family
    source: str = Field(min_length=1)
    revision: str | None = None
    # Where a source that is one checkpoint file gets the configs and tokenizers it lacks: a
    # diffusers repo id or a local directory (api_client.model_files).
    config: str | None = Field(default=None, min_length=1)
    variant: str | None = None
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    scheduler: Scheduler | None = None
    steps: StepRange
    guidance: GuidanceRange
    # True CFG with a negative prompt (flux, qwenimage); absent: not allowed.
    true_cfg: GuidanceRange | None = None
    # Sizes a request may ask for (every diffusion model lists one or more; an upscaler none: it
    # takes an input of any size within the input caps).
    resolutions: list[tuple[int, int]] = Field(default_factory=list)
    # Prompt tokens the text encoder reads (the pipeline's max_sequence_length; FLUX.1-schnell's
    # T5 was trained on 256, the pipeline's default is 512). None: the pipeline's default.
    max_sequence_length: int | None = Field(default=None, ge=16, le=1024)
    min_vram_gb: float = Field(ge=0)
    rung_vram_gb: dict[Rung, float] = Field(default_factory=dict)
    # 16-bit weight size of each component. When given, min_vram_gb and rung_vram_gb are the
    # figures with nothing quantized, and the ladder counts each component at the precision and
    # quantization this card gives it (worker.memory.ladder.rung_need_gb).
    component_gb: dict[str, float] = Field(default_factory=dict)
    # Components read from their own file (safetensors or GGUF) instead of the source's.
    components: dict[str, ComponentFile] = Field(default_factory=dict)
    # Component -> schemes in order of preference; the first the card can run is used.
    quantize: dict[str, list[QuantScheme]] = Field(default_factory=dict)
    compile: Literal["auto", "required", "off"] = "auto"
    # regional: compile_repeated_blocks; whole: the denoiser at once; auto: regional where the
    # denoiser declares repeated blocks.
    compile_method: Literal["auto", "regional", "whole"] = "auto"
    # What requests may ask for; an input image's modes only where the manifest lists them.
    modes: list[Mode] = Field(default_factory=lambda: list(TXT2IMG_ONLY), min_length=1)
    # The samplers a request may ask for (api_client.samplers): its family's (an edit model's:
    # its edit pipeline's) where the manifest is silent, else those it lists, each one of them.
    samplers: list[Sampler] = Field(default_factory=list)
    benchmark_only: bool = False
    optimizations: dict[SwitchName, Switch] = Field(default_factory=dict)
    # An AutoencoderTiny (TAESD) for cheap previews while denoising: hub id or local directory.
    taesd: str | None = Field(default=None, min_length=1)
    # A replacement VAE (hub id or local directory), e.g. madebyollin/sdxl-vae-fp16-fix: an SDXL
    # VAE that does not overflow in fp16, so an fp16 card decodes without an fp32 upcast.
    vae: str | None = Field(default=None, min_length=1)
    # Adapters a request may name, hot-swapped on the resident denoiser (worker.pipelines.adapters).
    loras: dict[str, LoraSpec] = Field(default_factory=dict)
    # Reuse of denoiser work between steps where the family has it (worker.pipelines.step_cache).
    step_cache: StepCacheSpec | None = None
    # ControlNets a request may name, loaded beside the resident pipeline at a job's first use
    # (api_client.controls; worker.pipelines.control).
    controlnets: dict[str, ControlNetSpec] = Field(default_factory=dict)
    # The IP-Adapter a request's reference image runs through, loaded beside the resident
    # pipeline at a job's first use (api_client.references; worker.pipelines.reference).
    ip_adapter: IPAdapterSpec | None = None
    # family upscaler (mode upscale; a hires pass's upscaler), whose source is one file: the
    # native scale (checked against what spandrel finds in it), the tile it starts at and the
    # overlap between tiles, in input pixels (out of memory halves the tile).
    scale: int | None = Field(default=None, ge=1, le=8)
    tile: int | None = Field(default=None, ge=64, le=4096)
    tile_overlap: int = Field(default=32, ge=0, le=256)
    # The weights' licence where a user must know it (an upscaler's own, a ControlNet's).
    license: str | None = None
    # A video model's frames (its family's rule, FamilyRow.frame_step) and default frames a
    # second; an image model has neither.
    frames: FrameRange | None = None
    fps: int | None = Field(default=None, ge=1, le=MAX_FPS)

    @model_validator(mode="before")
    @classmethod
    def _family_fields(cls, data: Any) -> Any:
        """The family's fixed fields filled in (an upscaler's steps, guidance, modes: one pass,
        no guidance, upscale), and another kind's fields refused, naming each."""
        row = FAMILIES.get(data.get("family") or "") if isinstance(data, dict) else None
        if row is None:
            return data
        # A manifest read back from its own dump (Redis, the API) carries the fixed values.
        present = [
            name
            for name in row.foreign
            if data.get(name) and not _same(data[name], row.fixed.get(name))
        ]
        if present:
            raise ValueError(f"{', '.join(present)}: {row.foreign_refusal()}")
        edit = "edit" in (data.get("modes") or ())
        modes = list(VIDEO_MODES[:1] if row.video else TXT2IMG_ONLY)  # where the manifest is silent
        return {"modes": modes, **row.fixed, "samplers": list(row.samplers_for(edit)), **data}

    @field_validator("samplers")
    @classmethod
    def _samplers_the_family_takes(cls, samplers: list[str], info: ValidationInfo) -> list[str]:
        row = FAMILIES.get(info.data.get("family") or "")
        edit = "edit" in (info.data.get("modes") or ())
        taken = () if row is None else row.samplers_for(edit)
        refused = [name for name in samplers if name not in taken]
        if refused and row is not None:
            offered = ", ".join(taken) or "none"
            whose = f"a {row.name} edit model" if edit else f"family {row.name}"
            raise ValueError(
                f"{', '.join(refused)}: {whose} takes no such sampler; it takes {offered}"
            )
        if len(set(samplers)) < len(samplers):
            raise ValueError(f"{samplers!r} must name each sampler once")
        return samplers

    @model_validator(mode="after")
    def _weights_or_sizes(self) -> Manifest:
        """A family run from one weights file names its scale and that file; a pipeline lists
        at least one resolution."""
        files = self.family_row.weights_files
        why = weights_refusal(self.source, self.config, bool(files), self.components, self.quantize)
        if why is not None:
            raise ValueError(why)
        if not files:
            if not self.resolutions:
                raise ValueError("resolutions: a diffusion model lists at least one size")
            return self
        if self.scale is None:
            raise ValueError("scale: an upscaler names its native scale (2, 4, ...)")
        if not self.source.endswith(files) or ".." in self.source.split("/"):
            raise ValueError(
                f"source {self.source!r}: an upscaler's source is its weights file"
                f" ({', '.join(files)}): a path under KILN_MODELS_DIR or an absolute"
                " one, or owner/repo/file on the hub"
            )
        return self

    @model_validator(mode="after")
    def _frames_of_a_video_model(self) -> Manifest:
        """A video model names its frames, on its family's rule, and its fps; an image model
        neither."""
        row = self.family_row
        if not row.video:
            given = [name for name in ("frames", "fps") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: family {self.family} makes images")
            return self
        if self.frames is None or self.fps is None:
            raise ValueError(f"frames and fps: a {self.family} manifest names both")
        for which in ("default", "max"):
            why = row.frames_refusal(getattr(self.frames, which))
            if why is not None:
                raise ValueError(f"frames.{which} {getattr(self.frames, which)}: {why}")
        return self

    @field_validator("components")
    @classmethod
    def _component_files(cls, components: dict[str, ComponentFile]) -> dict[str, ComponentFile]:
        return check_components(components)

    @field_validator("loras")
    @classmethod
    def _lora_names(cls, loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
        return check_lora_names(loras)

    @field_validator("controlnets")
    @classmethod
    def _controlnets_run_here(
        cls, controlnets: dict[str, ControlNetSpec], info: ValidationInfo
    ) -> dict[str, ControlNetSpec]:
        family = info.data.get("family") or ""
        edit = "edit" if "edit" in (info.data.get("modes") or ()) else None
        why = control_refusal(family, edit) if controlnets else None
        if why is not None:
            raise ValueError(why)
        return check_control_names(controlnets, family)

    @field_validator("ip_adapter")
    @classmethod
    def _ip_adapter_runs_here(
        cls, spec: IPAdapterSpec | None, info: ValidationInfo
    ) -> IPAdapterSpec | None:
        why = reference_refusal(info.data.get("family") or "") if spec else None
        if why is not None:
            raise ValueError(why)
        return spec

    @field_validator("true_cfg")
    @classmethod
    def _true_cfg_family(cls, value: GuidanceRange | None, info: ValidationInfo) -> object:
        row = FAMILIES.get(info.data.get("family") or "")
        if value is not None and row is not None and row.cfg.field != "true_cfg":
            raise ValueError(f"family {row.name} has no true CFG; its CFG is guidance")
        return value

    @field_validator("resolutions")
    @classmethod
    def _sizes_on_the_grid(
        cls, sizes: list[tuple[int, int]], info: ValidationInfo
    ) -> list[tuple[int, int]]:
        family = info.data.get("family")
        row = FAMILIES.get(family or "")
        grid = 8 if row is None else row.grid
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
        row = FAMILIES.get(family or "")
        if tokens is not None and row is not None and row.clip_only:
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
        row = FAMILIES.get(family or "")
        served = () if row is None else row.modes
        for mode in modes:
            if mode not in served:
                raise ValueError(f"{mode}: family {family} serves {', '.join(served)} here")
        edit = () if row is None else row.edit_modes
        if "edit" in modes and not set(modes) <= set(edit):
            raise ValueError(
                f"{', '.join(m for m in modes if m not in edit)}: a {family} manifest with edit is"
                f" an edit model, whose pipeline serves {', '.join(edit)} only"
            )
        return modes

    @field_validator("step_cache")
    @classmethod
    def _step_cache_runs_here(
        cls, spec: StepCacheSpec | None, info: ValidationInfo
    ) -> StepCacheSpec | None:
        family = info.data.get("family") or ""
        if spec is None:
            return spec
        row = FAMILIES.get(family)
        why = family if row is None else row.no_step_cache
        if why is not None:
            raise ValueError(f"{why}; step caches run on {', '.join(families_with('step_cache'))}")
        if info.data.get("compile_method") == "whole":
            raise ValueError(
                "compile_method whole puts the cache's per-step decision inside the one graph;"
                " a step cache needs regional (or auto) compile"
            )
        return spec

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
    def family_row(self) -> FamilyRow:
        """What the manifest's family is and allows (api_client.families)."""
        return family_row(self.family)

    @property
    def default_size(self) -> tuple[int, int]:
        """A diffusion model's first resolution (an upscaler has none: check resolutions)."""
        return self.resolutions[0]


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


SHIPPED_PACKAGE = "kiln_manifests"  # the top-level manifests/, as pyproject.toml installs it


def shipped_manifests() -> Path:
    """The directory of the manifests kiln ships: the checkout's manifests/, installed as the
    package kiln_manifests (pyproject.toml), so a wheel and an editable install read them alike,
    from any working directory."""
    from importlib.resources import files

    root = files(SHIPPED_PACKAGE)
    return root if isinstance(root, Path) else Path(str(root))


class ManifestDirs(tuple[Path, ...]):
    """Manifest directories in the order they are read: the shipped ones first, then each
    KILN_MANIFESTS directory, a later manifest replacing an earlier one of the same id. str()
    spells them as KILN_MANIFESTS does, so the value can be handed to a child process."""

    def __str__(self) -> str:
        return os.pathsep.join(str(path) for path in self)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            manifest_dirs,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda dirs: [str(path) for path in dirs]
            ),
        )


def manifest_dirs(extra: str | Path | Iterable[str | Path] | None = None) -> ManifestDirs:
    """The shipped manifests' directory, then each directory of extra in order: KILN_MANIFESTS's
    value (directories separated by os.pathsep, ':' on Linux and macOS), a path, or paths. A
    directory named twice (the shipped one included) is read once, where it is first named."""
    if extra is None:
        given: list[Path] = []
    elif isinstance(extra, str):
        given = [Path(part) for part in extra.split(os.pathsep) if part.strip()]
    elif isinstance(extra, Path):
        given = [extra]
    else:
        given = [Path(part) for part in extra]
    dirs: list[Path] = []
    seen: set[Path] = set()
    for directory in (shipped_manifests(), *given):
        directory = directory.expanduser()
        if directory.resolve() not in seen:
            seen.add(directory.resolve())
            dirs.append(directory)
    return ManifestDirs(dirs)


def load_manifest_dir(
    directory: str | Path | Iterable[Path],
) -> tuple[dict[str, Manifest], list[ManifestInvalid]]:
    """Every manifest (*.yaml, *.yml) in directory, and every file that failed. Given several
    directories (manifest_dirs()), each is read in order, and a manifest replaces one of the same
    id from an earlier directory. A directory that does not exist is a failure naming it."""
    if isinstance(directory, str | Path):
        return _load_one_dir(Path(directory))
    manifests: dict[str, Manifest] = {}
    failures: list[ManifestInvalid] = []
    for each in directory:
        found, failed = _load_one_dir(each)
        manifests.update(found)
        failures.extend(failed)
    return manifests, failures


def _load_one_dir(directory: Path) -> tuple[dict[str, Manifest], list[ManifestInvalid]]:
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
