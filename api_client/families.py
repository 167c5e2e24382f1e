"""Every model family kiln knows, one row each (FamilyRow in FAMILIES): what a manifest of the
family may declare and a request may ask of it, read by the client and the worker alike. The
worker's row (worker.pipelines.families.FamilySpec) adds its pipeline classes. Code asks a
family's row; it never compares the family's name.

Adding a family is one row here, its name in Family, its worker row with its pipeline classes,
and its tiny model (worker.pipelines.tiny); tests/test_families.py holds the tables together.
Over 400 lines because the rows and the rules they share (CFG, controls, samplers, frames) are
one table, read together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from api_client.samplers import SAMPLERS, SIGMAS, Sampler, Sigmas
from api_client.schema import VIDEO_MODES, Mode

Family = Literal[
    "sd15", "sd2", "sdxl", "sd3", "flux", "flux2", "qwenimage", "zimage", "wan", "ltx", "upscaler"
]
# What a family's models make: images (or videos: FamilyRow.frame_step) by denoising, or a larger
# image of an input.
Kind = Literal["diffusion", "upscaler"]


@dataclass(frozen=True)
class CfgRule:
    """Which request field runs a family's classifier-free guidance, and above what value.

    A negative prompt only steers a render through that guidance, so without it a negative
    prompt is refused rather than ignored."""

    field: Literal["guidance", "true_cfg"]
    above: float


@dataclass(frozen=True)
class ControlRule:
    """How a request's controls run on a family (the worker's ControlNet pipelines for each mode:
    worker.pipelines.families.ControlFamily)."""

    # The modes kiln runs a ControlNet in: where diffusers has the family's control pipeline and a
    # control at strength 0 renders what no control renders.
    modes: tuple[Mode, ...] = ("txt2img",)
    # Its ControlNet is a union model (ControlNetUnionModel): each manifest entry gives the mode
    # index its checkpoint's card lists for its kind.
    union: bool = False
    # Why its control pipeline takes one ControlNet and one image; None: up to MAX_CONTROLS.
    one: str | None = None
    # Why its control pipeline applies a control over every step; None: start and end apply.
    whole_schedule: str | None = None


# What a manifest of an upscaler may not set: the fields of a diffusion pipeline.
DIFFUSION_ONLY = (
    "steps",
    "guidance",
    "resolutions",
    "rung_vram_gb",
    "scheduler",
    "true_cfg",
    "max_sequence_length",
    "component_gb",
    "quantize",
    "taesd",
    "vae",
    "loras",
    "step_cache",
    "controlnets",
    "ip_adapter",
)
TXT2IMG_INPAINT: tuple[Mode, ...] = ("txt2img", "img2img", "inpaint")


@dataclass(frozen=True)
class FamilyRow:
    """One family: everything the client and the worker ask of it, but its pipeline classes."""

    name: Family
    kind: Kind = "diffusion"
    # Pixels per latent cell: the VAE's 8x, times the 2x2 patch of the transformer families; 1 for
    # an image of any size within the input caps (no latent grid).
    grid: int = 8
    # The modes its pipelines serve here (from_pipe of the resident one).
    modes: tuple[Mode, ...] = TXT2IMG_INPAINT
    # What a manifest that lists edit may list: an edit model is its own checkpoint whose pipeline
    # class is the resident one (FLUX.1 Kontext also renders from a prompt alone; Qwen-Image-Edit
    # always reads an input image). Empty: no edit model.
    edit_modes: tuple[Mode, ...] = ()
    cfg: CfgRule = CfgRule("guidance", 1.0)  # its classifier-free guidance
    clip_only: bool = False  # reads prompts with CLIP alone (77 tokens): no max_sequence_length
    # Its denoiser's latents are 2x2 patch tokens (B, tokens, C): no TAESD preview from them, and
    # a hires pass unpacks them before it scales them.
    packed_latents: bool = False
    latent_hires: bool = False  # its img2img takes latents as its image (a hires pass's "latent")
    # Why its denoiser has no step cache here, as a job's settings report it; None: one runs
    # (diffusers' First Block Cache and MagCache hooks).
    no_step_cache: str | None = None
    # How it runs a ControlNet, or why it takes none.
    control: ControlRule | str = ""
    # The modes it runs an IP-Adapter in (diffusers' IPAdapterMixin, h94/IP-Adapter's weights), or
    # why it takes no reference image.
    reference: tuple[Mode, ...] | str = ""
    # A request carries a prompt and the denoising fields; False: an image in, at its own size, and
    # nothing else (api_client.resolve), so a worker has nothing to warm it with.
    prompted: bool = True
    # Its source is one weights file, with one of these suffixes, that spandrel reads
    # (worker.pipelines.upscale), at a native scale the manifest names; empty: a pipeline
    # directory (diffusers' from_pretrained) rendering the sizes its manifest lists.
    weights_files: tuple[str, ...] = ()
    # It runs whole on the device and fits a card by halving its tiles on out of memory: one rung,
    # no offload, and it never keeps a worker from taking jobs.
    tiles: bool = False
    # Manifest fields every model of the family has, filled in where the manifest is silent.
    fixed: Mapping[str, Any] = field(default_factory=dict)
    # Manifest fields of another kind, refused naming each, and why (default: an upscaler's).
    foreign: tuple[str, ...] = ("scale", "tile")
    foreign_why: str = ""
    # The samplers a request may ask of it (what diffusers' schedulers run for it here:
    # worker.pipelines.samplers maps each onto one). Empty: it takes no sampler. A manifest may
    # narrow them (Manifest.samplers).
    samplers: tuple[Sampler, ...] = ()
    # Its denoiser predicts a flow (rectified flow, FlowMatch* schedulers), not noise: the
    # schedulers that run it are the flow solvers (worker.pipelines.samplers.FLOW), and the sigma
    # schedules and from-noise-only rules are the flow solvers' (schedules, txt2img_only).
    flow_matching: bool = False
    # The samplers an edit model of the family takes (its edit pipeline class's); None: samplers.
    edit_samplers: tuple[Sampler, ...] | None = None
    # Its models make videos whose frame count is frame_step * k + 1 (the VAE compresses time by
    # frame_step and keeps the first frame on its own); 0: images.
    frame_step: int = 0

    @property
    def video(self) -> bool:
        return self.frame_step > 0

    def frames_refusal(self, frames: int) -> str | None:
        """Why a frame count breaks the family's rule, or None."""
        if self.frame_step and (frames < 1 or (frames - 1) % self.frame_step):
            step = self.frame_step
            return f"family {self.name} makes {step}k+1 frames (1, {step + 1}, {2 * step + 1}, ...)"
        return None

    def samplers_for(self, edit: bool) -> tuple[Sampler, ...]:
        """The samplers a model of the family takes: an edit model's (edit), or the family's."""
        return self.edit_samplers if edit and self.edit_samplers is not None else self.samplers

    @property
    def schedules(self) -> Mapping[Sampler, tuple[Sigmas, ...]]:
        """The sigma schedules beside normal each of its samplers takes."""
        return self._offered(_FLOW_SCHEDULES if self.flow_matching else _NOISE_SCHEDULES)

    @property
    def txt2img_only(self) -> Mapping[Sampler, str]:
        """Its samplers that run from noise only, and why: img2img, inpaint and a hires pass
        start part-way through the schedule, which these schedulers cannot here."""
        return self._offered(_FLOW_TXT2IMG_ONLY if self.flow_matching else {})

    def _offered(self, table: Mapping[Sampler, Any]) -> dict[Sampler, Any]:
        offered = {*self.samplers, *(self.edit_samplers or ())}
        return {sampler: value for sampler, value in table.items() if sampler in offered}

    def sigmas_for(self, sampler: Sampler) -> tuple[Sigmas, ...]:
        """The sigma schedules the sampler takes on this family: normal, then its own."""
        return ("normal", *self.schedules.get(sampler, ()))

    @property
    def step_cache(self) -> bool:
        """Whether a manifest of the family may declare a step cache."""
        return self.no_step_cache is None

    @property
    def control_rule(self) -> ControlRule | None:
        return self.control if isinstance(self.control, ControlRule) else None

    def no_control(self) -> str:
        """Why the family takes no ControlNet (its control is no ControlRule)."""
        why = self.control if isinstance(self.control, str) else ""
        return why or f"family {self.name} has no ControlNet in kiln"

    @property
    def reference_modes(self) -> tuple[Mode, ...]:
        return self.reference if isinstance(self.reference, tuple) else ()

    def no_reference(self) -> str:
        why = self.reference if isinstance(self.reference, str) else ""
        return why or f"family {self.name} has no IP-Adapter in kiln"

    def foreign_refusal(self) -> str:
        return self.foreign_why or f"family {self.name} is no upscaler"


def _sd_unet(name: str) -> str:
    return f"{name}'s UNet has no step cache in diffusers"


_SD_CONTROL = ControlRule(TXT2IMG_INPAINT)
# An epsilon or v-prediction UNet runs every sampler kiln names (diffusers' A1111 table); those
# whose scheduler class takes use_karras/exponential/beta_sigmas take those schedules.
_NOISE_SCHEDULES: dict[Sampler, tuple[Sigmas, ...]] = dict.fromkeys(
    ("euler", "heun", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_sde", "uni_pc"), SIGMAS[1:]
)
# A flow-matching denoiser runs diffusers' flow solvers: each family's list is what renders on its
# tiny model (tests/test_samplers.py). FlowMatchEuler and FlowMatchLCM take the three schedules;
# FlowMatchHeun takes none, and the multistep solvers on flow sigmas render NaN at them.
_FLOW_SCHEDULES: dict[Sampler, tuple[Sigmas, ...]] = dict.fromkeys(
    ("euler", "euler_ancestral", "lcm"), SIGMAS[1:]
)
_NO_SCALE_NOISE = (
    "diffusers' {} has no scale_noise, which the flow pipelines' img2img and inpaint call"
)
_FLOW_TXT2IMG_ONLY: dict[Sampler, str] = {
    "dpmpp_2m": _NO_SCALE_NOISE.format("DPMSolverMultistepScheduler"),
    "dpmpp_2m_sde": _NO_SCALE_NOISE.format("DPMSolverMultistepScheduler"),
    "uni_pc": _NO_SCALE_NOISE.format("UniPCMultistepScheduler"),
}
# What SD3's and FLUX's pipelines run; Heun runs on SD3 alone: the others hand set_timesteps
# their own sigmas, which FlowMatchHeun's does not take.
_FLOW_SOLVERS: tuple[Sampler, ...] = ("euler", "euler_ancestral", "dpmpp_2m", "dpmpp_2m_sde")
# SD3's, Qwen-Image's and Z-Image's ControlNets run in txt2img only: diffusers has no ControlNet
# img2img for them, and their ControlNet inpaint pipelines run an inpainting ControlNet (the
# masked image is its control image) with no image or strength: another checkpoint's task.
_NO_IP = "has no IP-Adapter (none published for it, none in diffusers 0.42)"
_VIDEO_CONTROL = "has no ControlNet in kiln (diffusers' video control pipelines are not run yet)"
_VIDEO_IP = "takes no reference image here (img2video's image is its first frame)"

FAMILIES: dict[str, FamilyRow] = {
    row.name: row
    for row in (
        FamilyRow(
            "sd15",
            clip_only=True,
            latent_hires=True,
            no_step_cache=_sd_unet("sd15"),
            control=_SD_CONTROL,
            reference=TXT2IMG_INPAINT,
            samplers=SAMPLERS,
        ),
        FamilyRow(
            "sd2",
            clip_only=True,
            latent_hires=True,
            no_step_cache=_sd_unet("sd2"),
            control=_SD_CONTROL,  # SD 2.x ControlNets run in the same pipelines
            reference="no IP-Adapter is published for SD 2.x (h94/IP-Adapter's are for SD1.5 and"
            " SDXL)",
            samplers=SAMPLERS,
        ),
        FamilyRow(
            "sdxl",
            clip_only=True,
            latent_hires=True,
            no_step_cache=_sd_unet("sdxl"),
            # Union ControlNets (StableDiffusionXLControlNetUnion*Pipeline) in all three modes.
            control=ControlRule(TXT2IMG_INPAINT, union=True),
            reference=TXT2IMG_INPAINT,
            samplers=SAMPLERS,
        ),
        FamilyRow(
            "sd3",
            grid=16,
            latent_hires=True,
            no_step_cache="SD3's transformer has no step cache hooks in diffusers",
            control=ControlRule(),
            reference="kiln does not run SD3.5's IP-Adapter yet (InstantX's, for SD3.5 Large"
            " only, through diffusers' SD3IPAdapterMixin)",
            flow_matching=True,
            samplers=(*_FLOW_SOLVERS, "heun", "uni_pc", "lcm"),
        ),
        FamilyRow(
            "flux",
            grid=16,
            modes=(*TXT2IMG_INPAINT, "edit"),
            edit_modes=("txt2img", "edit"),
            # FLUX.1's guidance is an embedding the distilled model was trained with, not CFG; it
            # runs true CFG (a second pass on the negative prompt) through true_cfg.
            cfg=CfgRule("true_cfg", 1.0),
            packed_latents=True,
            latent_hires=True,  # unpacked first (worker.render.generate.hires_latents)
            # FluxControlNetImg2Img/Inpaint draw the control image's VAE sample from the job's
            # generator before the input's noise, so a control, even at strength 0, would change
            # the noise: until kiln draws that noise itself for them, txt2img only.
            control=ControlRule(),
            reference="kiln does not run FLUX.1's IP-Adapter yet (XLabs', through diffusers'"
            " FluxIPAdapterMixin)",
            flow_matching=True,
            samplers=(*_FLOW_SOLVERS, "uni_pc", "lcm"),
            # FluxKontextPipeline hands set_timesteps its sigmas even on flow sigmas: no DPM-Solver.
            edit_samplers=("euler", "euler_ancestral", "uni_pc", "lcm"),
        ),
        FamilyRow(
            "flux2",
            grid=16,
            modes=("txt2img",),
            cfg=CfgRule("guidance", 1.0),  # klein base; the distilled klein caps guidance at 1
            packed_latents=True,
            # Measured on tiny-flux2: the cache's tail block (a single-stream one) returns one
            # tensor where its head (a double-stream one) returned two: the residual subtraction
            # raises TypeError.
            no_step_cache="FLUX.2's First Block Cache fails in diffusers 0.42 (its single-stream"
            " tail block returns one tensor, its head two: TypeError)",
            control="FLUX.2 klein has no ControlNet (none published for it, none in diffusers"
            " 0.42)",
            reference=f"FLUX.2 klein {_NO_IP}",
            flow_matching=True,
            samplers=(*_FLOW_SOLVERS, "uni_pc", "lcm"),
        ),
        FamilyRow(
            "qwenimage",
            grid=16,
            modes=(*TXT2IMG_INPAINT, "edit"),
            edit_modes=("edit",),
            cfg=CfgRule("true_cfg", 1.0),  # no guidance embedding: true CFG alone
            packed_latents=True,
            control=ControlRule(
                one="QwenImageControlNetPipeline runs one ControlNet (its multi-ControlNet is one"
                " union checkpoint over several images, not several checkpoints)"
            ),
            reference=f"Qwen-Image {_NO_IP}",
            flow_matching=True,
            # Its pipelines hand set_timesteps their sigmas: no Heun or DPM-Solver; UniPC takes
            # them. Its edit pipeline has no tiny model here: only the FlowMatch schedulers,
            # whose set_timesteps and scale_noise are its own scheduler's.
            samplers=("euler", "euler_ancestral", "uni_pc", "lcm"),
            edit_samplers=("euler", "euler_ancestral", "lcm"),
        ),
        FamilyRow(
            "zimage",
            grid=16,
            cfg=CfgRule("guidance", 0.0),  # ZImagePipeline runs CFG for any guidance above 0
            no_step_cache="Z-Image's transformer has no cache mixin in diffusers (cache-dit"
            " covers it; kiln does not ship cache-dit)",
            control=ControlRule(
                one="ZImageControlNetPipeline takes one ZImageControlNetModel",
                whole_schedule="ZImageControlNetPipeline's call takes no control_guidance_start"
                " or end",
            ),
            reference=f"Z-Image {_NO_IP}",
            flow_matching=True,
            # Z-Image hands set_timesteps its own sigmas: no Heun, DPM-Solver or UniPC.
            samplers=("euler", "euler_ancestral", "lcm"),
        ),
        # Wan 2.1 / 2.2 (WanPipeline, WanImageToVideoPipeline): a UMT5 encoder, a 3D transformer
        # over the Wan VAE's latents (4x in time, 8x or 16x in space), 2x2 patches; sizes on a
        # 16 px grid (its pipeline's check). Its guidance is CFG above 1.
        FamilyRow(
            "wan",
            grid=16,
            modes=VIDEO_MODES,
            control=f"Wan {_VIDEO_CONTROL}",
            reference=f"Wan {_VIDEO_IP}",
            flow_matching=True,
            frame_step=4,
        ),
        # LTX-Video (LTXPipeline, LTXImageToVideoPipeline): a T5 encoder over its VAE's 8x-in-time,
        # 32x-in-space latents, packed into tokens; sizes on a 32 px grid. CFG above 1.
        FamilyRow(
            "ltx",
            grid=32,
            modes=VIDEO_MODES,
            packed_latents=True,
            control=f"LTX-Video {_VIDEO_CONTROL}",
            reference=f"LTX-Video {_VIDEO_IP}",
            flow_matching=True,
            frame_step=8,
        ),
        # One forward pass over the image (Real-ESRGAN and kin, through spandrel), guided by
        # nothing: its steps and guidance, which every manifest has, are fixed, and a request
        # may set neither.
        FamilyRow(
            "upscaler",
            kind="upscaler",
            grid=1,
            modes=("upscale",),
            cfg=CfgRule("guidance", 0.0),  # its guidance is fixed at 0: nothing steers it
            no_step_cache="an upscaler runs one pass: no steps to reuse",
            prompted=False,
            # safetensors, or a pickled state dict (read with weights_only).
            weights_files=(".safetensors", ".pth", ".pt", ".ckpt", ".bin"),
            tiles=True,
            fixed={
                "steps": {"default": 1, "max": 1},
                "guidance": {"default": 0.0, "max": 0.0},
                "modes": ["upscale"],
                "tile": 512,  # input pixels a tile starts at (Real-ESRGAN's scripts use 400-512)
                "min_vram_gb": 0.0,
            },
            foreign=DIFFUSION_ONLY,
            foreign_why="a diffusion pipeline's fields; an upscaler has none",
        ),
    )
}


def family_row(name: str) -> FamilyRow:
    """The family's row; ValueError naming the families kiln knows."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(FAMILIES)
        raise ValueError(f"family {name!r} is not one kiln knows: {known}") from None


def families_with(attribute: str) -> list[str]:
    """The names of the families whose row's attribute is true, in the table's order."""
    return [name for name, row in FAMILIES.items() if getattr(row, attribute)]


# The mappings callers read before rows: derived from the table, never edited.
CONTROL_MODES: dict[str, tuple[Mode, ...]] = {
    name: rule.modes for name, row in FAMILIES.items() if (rule := row.control_rule) is not None
}
REFERENCE_MODES: dict[str, tuple[Mode, ...]] = {
    name: row.reference_modes for name, row in FAMILIES.items() if row.reference_modes
}
