"""How kiln renders each diffusion family, one FamilySpec each: the worker's half of a family's row
(the other half, what a manifest and a request may ask of it, is api_client.families.FamilyRow):
its pipeline classes, what its load drops, its precision and VAE rules, prompt encoding, latent
decoding, and its tiny model (TinyModel: the builder worker.pipelines.tiny runs). A family's spec
is looked up once per load (spec_for) and carried with the loaded pipeline (LoadedPipeline.spec);
code asks the spec or the row, never the family's name.

Rendering runs in three calls (encode, denoise to latents, decode) instead of one pipeline call
so each phase is timed, fault-injected and retried on its own. torch is imported where a decode
needs it, so `kiln pull` reads what a family fetches without it; the tiny builders are named,
not imported, for the same reason. Over 400 lines because it holds ten families' specs with
their encode and decode side by side, each a few lines, so they read as one table (the video
families' encode and decode are worker.pipelines.video's, which imports torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from api_client.families import family_row
from api_client.manifest import Manifest
from worker.pipelines.prompt import Embeds, Prompt

if TYPE_CHECKING:
    import torch
    from PIL import Image


def cfg_active(family: str, guidance: float, true_cfg: float | None) -> bool:
    """Whether the family's classifier-free guidance runs (and so needs negative embeddings)."""
    rule = family_row(family).cfg
    value = guidance if rule.field == "guidance" else true_cfg
    return value is not None and value > rule.above


@dataclass(frozen=True)
class ControlFamily:
    """How a family runs a ControlNet (where kiln allows it: its row's ControlRule)."""

    model_class: str  # the diffusers ControlNet model class its checkpoints load as
    pipelines: dict[str, str]  # mode -> the control pipeline class, derived from the resident one
    # The pipeline draws from the job's generators before the starting noise (FLUX.1 and
    # Qwen-Image VAE-sample their control image): kiln draws the noise first and hands it in
    # (control.initial_latents).
    noise_first: bool = False
    # The pipeline VAE-samples its control image from torch's global RNG (SD3's passes no
    # generator): kiln seeds it from the job's seed for the call (control.seeded_call).
    global_rng: bool = False


@dataclass(frozen=True)
class TinyModel:
    """A family's tiny random-weight model, kiln's embedded default (worker.pipelines.tiny builds
    it as models/tiny-<name>): its builder and what the build ships beside the pipeline."""

    name: str  # tiny-<name>: the family's, or an edit model's own (flux-kontext)
    # "module.function" in worker.pipelines.tiny, imported when a build runs (it needs diffusers)
    builder: str
    # (latent channels, scaling, shift) as its TAESD reads the denoiser's latents; None: no TAESD,
    # so no previews
    taesd: tuple[int, float, float] | None = None
    # name -> seed: the tiny ControlNets of its ControlFamily's model class (two let a job stack)
    controlnets: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilySpec:
    """How kiln renders one family (api_client.families.Family names them; its FamilyRow says what
    a manifest and a request may ask of it)."""

    pipeline_class: str  # attribute of the diffusers package
    # (pipe, device, prompt) -> the pipeline call's embeddings, already repeated for the batch
    encode: Callable[[Any, torch.device, Prompt], Embeds]
    # (pipe, latents as the pipeline returns them with output_type="latent", width, height)
    decode: Callable[[Any, torch.Tensor, int, int], list[Image.Image]]
    # (guidance, true_cfg) -> the pipeline call's guidance arguments
    guidance: Callable[[float, float | None], dict[str, Any]] = lambda g, _t: {"guidance_scale": g}
    fp16_safe: bool = True  # sd3 and the flow transformers overflow in fp16: bf16 or fp32
    denoiser: str = "unet"
    # mode -> the diffusers class a mode's pipeline is derived as (from_pipe: same modules).
    modes: dict[str, str] = field(default_factory=dict)
    # (width, height) -> pipeline call arguments of this family's own (FLUX.1 Kontext's size).
    call: Callable[[int, int], dict[str, Any]] = lambda _w, _h: {}
    # (frames, fps) -> a video family's call arguments (worker.pipelines.video).
    video_call: Callable[[int, int], dict[str, Any]] = lambda _f, _fps: {}
    # Modules the pipeline needs beyond diffusers' own dependencies, checked when a worker starts.
    requires: tuple[str, ...] = ()
    # Components the pipeline is loaded without (passed as None) and whose files are never
    # fetched: SD's safety checker.
    dropped: tuple[str, ...] = ()
    # from_pretrained arguments of the family's own beyond the dropped components.
    load_options: Mapping[str, Any] = field(default_factory=dict)
    # Whether the pipeline honours its VAE config's force_upcast (SDXL's; SD1.5's leaves it at
    # its default): an fp16 VAE that sets it is kept in fp32 from load (worker.pipelines.vae).
    vae_upcast: bool = False
    control: ControlFamily | None = None  # its ControlNet pipelines, where kiln runs them
    # An edit model of the family (FamilyRow.edit_modes): its own checkpoint, whose pipeline is
    # loaded as the resident one.
    edit: FamilySpec | None = None
    tiny: TinyModel | None = None  # its tiny model (sd2 renders with sd15's spec, so its tiny)

    def load_kwargs(self) -> dict[str, Any]:
        """The family's own from_pretrained arguments."""
        return {**dict.fromkeys(self.dropped), **self.load_options}


def _encode_sd15(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    positive, negative_embeds = pipe.encode_prompt(
        p.text, device, p.count, p.cfg, negative_prompt=p.negative or None
    )
    embeds = {"prompt_embeds": positive}
    if p.cfg:
        embeds["negative_prompt_embeds"] = negative_embeds
    return embeds


def _encode_sdxl(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    return _encode_pooled(pipe, device, p, prompt_2=None)


def _encode_sd3(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    """SD3's third encoder (T5) reads the manifest's max_sequence_length."""
    return _encode_pooled(pipe, device, p, prompt_2=None, prompt_3=None, **p.tokens())


def _encode_pooled(pipe: Any, device: torch.device, p: Prompt, **extra: Any) -> Embeds:
    """sdxl and sd3 return (embeds, negative, pooled, negative pooled)."""
    positive, negative_embeds, pooled, negative_pooled = pipe.encode_prompt(
        prompt=p.text,
        device=device,
        num_images_per_prompt=p.count,
        do_classifier_free_guidance=p.cfg,
        negative_prompt=p.negative or None,
        **extra,
    )
    embeds = {"prompt_embeds": positive, "pooled_prompt_embeds": pooled}
    if p.cfg:
        embeds["negative_prompt_embeds"] = negative_embeds
        embeds["negative_pooled_prompt_embeds"] = negative_pooled
    return embeds


def _vae_device(vae: Any) -> torch.device:
    device: torch.device = next(iter(vae.parameters())).device
    return device


def _decode_sd15(pipe: Any, latents: torch.Tensor, _w: int, _h: int) -> list[Image.Image]:
    vae = pipe.vae
    latents = latents.to(_vae_device(vae), vae.dtype) / vae.config.scaling_factor
    image = vae.decode(latents, return_dict=False)[0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def _decode_sdxl(pipe: Any, latents: torch.Tensor, _w: int, _h: int) -> list[Image.Image]:
    import torch

    vae = pipe.vae
    # The SDXL VAE overflows in fp16 unless its config says otherwise; decode in fp32 then.
    upcast = vae.dtype == torch.float16 and vae.config.force_upcast
    if upcast:
        pipe.upcast_vae()
    try:
        latents = latents.to(_vae_device(vae), next(iter(vae.post_quant_conv.parameters())).dtype)
        mean, std = (
            getattr(vae.config, "latents_mean", None),
            getattr(vae.config, "latents_std", None),
        )
        if mean is not None and std is not None:
            mean_t = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std_t = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std_t / vae.config.scaling_factor + mean_t
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
    finally:
        if upcast:
            vae.to(dtype=torch.float16)
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def _decode_sd3(pipe: Any, latents: torch.Tensor, _w: int = 0, _h: int = 0) -> list[Image.Image]:
    """SD3 and Z-Image: the VAE's scale and shift, latents as the transformer left them."""
    vae = pipe.vae
    latents = latents.to(_vae_device(vae), vae.dtype)
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(latents, return_dict=False)[0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def decode_preview(pipe: Any, taesd: Any, latents: torch.Tensor) -> Image.Image:
    """The first image of the batch through TAESD, in the latent space its config describes."""
    latents = latents[:1].to(_vae_device(taesd), taesd.dtype)
    latents = latents / taesd.config.scaling_factor + taesd.config.shift_factor
    image = taesd.decode(latents, return_dict=False)[0]
    previews: list[Image.Image] = pipe.image_processor.postprocess(image, output_type="pil")
    return previews[0]


def _encode_flux(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    """CLIP's pooled vector and T5's sequence; the negative pair only for true CFG."""

    def encode(text: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ids = pipe.encode_prompt(
            prompt=text, prompt_2=None, device=device, num_images_per_prompt=p.count, **p.tokens()
        )
        return embeds, pooled

    embeds, pooled = encode(p.text)
    out: Embeds = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    if p.cfg:
        out["negative_prompt_embeds"], out["negative_pooled_prompt_embeds"] = encode(p.negative)
    return out


def _encode_flux2(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    def encode(text: str) -> torch.Tensor:
        embeds: torch.Tensor = pipe.encode_prompt(
            prompt=text, device=device, num_images_per_prompt=p.count, **p.tokens()
        )[0]
        return embeds

    out: Embeds = {"prompt_embeds": encode(p.text)}
    if p.cfg:
        out["negative_prompt_embeds"] = encode(p.negative)
    return out


def _encode_qwenimage(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    # QwenImagePipeline.__call__ encodes at 512 tokens (encode_prompt's own default is 1024).
    tokens: dict[str, Any] = p.tokens() or {"max_sequence_length": 512}
    if p.image is not None:
        tokens["image"] = _edit_prompt_image(pipe, p.image)

    def encode(text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds, mask = pipe.encode_prompt(
            prompt=text, device=device, num_images_per_prompt=p.count, **tokens
        )
        return embeds, mask

    embeds, mask = encode(p.text)
    out: Embeds = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
    if p.cfg:
        # The model card's recipe: true CFG against " " when there is nothing to steer away from.
        out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = encode(
            p.negative or " "
        )
    return out


def _edit_prompt_image(pipe: Any, image: Image.Image) -> Any:
    """The input as QwenImageEditPipeline.__call__ hands it to its text encoder: resized to about
    1 MP at its aspect ratio on a 32 px grid (its processor then patches it for the VL tower)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(1024 * 1024, image.width / image.height)
    return pipe.image_processor.resize(image, height, width)


def _encode_zimage(pipe: Any, device: torch.device, p: Prompt) -> Embeds:
    """ZImagePipeline takes one tensor per image (prompts keep their own lengths)."""
    embeds, negatives = pipe.encode_prompt(
        prompt=p.text,
        device=device,
        do_classifier_free_guidance=p.cfg,
        negative_prompt=p.negative or None,
        **p.tokens(),
    )
    out: Embeds = {"prompt_embeds": [e for e in embeds for _ in range(p.count)]}
    if p.cfg:
        out["negative_prompt_embeds"] = [e for e in negatives for _ in range(p.count)]
    return out


class _AllValidMask(logging.Filter):
    """QwenImagePipeline.encode_prompt returns no mask when every token is valid (always, for one
    prompt), then warns on every call that is given its own embeddings without one. An all-ones
    mask would cost a masked attention instead; the warning is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_mask` is not provided, so the model will treat all" not in record.getMessage()


for _name in ("pipeline_qwenimage", "pipeline_qwenimage_edit"):
    logging.getLogger(f"diffusers.pipelines.qwenimage.{_name}").addFilter(_AllValidMask())


def _decode_flux(pipe: Any, latents: torch.Tensor, width: int, height: int) -> list[Image.Image]:
    """FLUX.1 returns 2x2 patch tokens; unpacked, they decode with the VAE's scale and shift."""
    latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    return _decode_sd3(pipe, latents)


def _decode_flux2(pipe: Any, latents: torch.Tensor, _w: int, _h: int) -> list[Image.Image]:
    """Flux2KleinPipeline unpacks and un-normalizes (batch-norm statistics) before it returns
    latents; they go to the VAE as they are."""
    vae = pipe.vae
    image = vae.decode(latents.to(_vae_device(vae), vae.dtype), return_dict=False)[0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def _decode_qwenimage(
    pipe: Any, latents: torch.Tensor, width: int, height: int
) -> list[Image.Image]:
    """Qwen-Image's VAE is a video VAE: one frame, per-channel mean and std from its config."""
    import torch

    vae = pipe.vae
    latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    latents = latents.to(_vae_device(vae), vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def _true_cfg(guidance: float, true_cfg: float | None) -> dict[str, Any]:
    """FLUX.1: guidance is the embedded guidance (ignored where the transformer has none)."""
    return {"guidance_scale": guidance, "true_cfg_scale": true_cfg or 1.0}


def _true_cfg_only(_guidance: float, true_cfg: float | None) -> dict[str, Any]:
    """Qwen-Image has no guidance embedding: guidance_scale None, or the pipeline warns."""
    return {"guidance_scale": None, "true_cfg_scale": true_cfg or 1.0}


def _modes(prefix: str) -> dict[str, str]:
    """img2img and inpaint as diffusers names them for a family (FLUX.2 klein has neither)."""
    return {"img2img": f"{prefix}Img2ImgPipeline", "inpaint": f"{prefix}InpaintPipeline"}


# SD1.5 and SD2: loaded without the safety checker (kiln returns every image it renders).
_SD = FamilySpec(
    "StableDiffusionPipeline",
    _encode_sd15,
    _decode_sd15,
    modes=_modes("StableDiffusion"),
    dropped=("safety_checker",),
    load_options={"requires_safety_checker": False},
    control=ControlFamily(
        "ControlNetModel",
        {
            "txt2img": "StableDiffusionControlNetPipeline",
            "img2img": "StableDiffusionControlNetImg2ImgPipeline",
            "inpaint": "StableDiffusionControlNetInpaintPipeline",
        },
    ),
    tiny=TinyModel("sd15", "sd.sd15", taesd=(4, 1.0, 0.0), controlnets={"canny": 61, "depth": 62}),
)


def _kontext_call(width: int, height: int) -> dict[str, Any]:
    """FluxKontextPipeline rescales the output to max_area (1 MP unless told) and the input to the
    nearest of the resolutions Kontext was trained at; the job's size is the manifest's, and an
    input is the job's size (kiln never resizes one), so neither is changed here."""
    return {"max_area": width * height, "_auto_resize": False}


def _with_edit(spec: FamilySpec, **edit: Any) -> FamilySpec:
    """The family's spec with its edit model's: the same encode and decode, its own pipeline class
    and tiny model (none unless edit names one), no modes derived from it and no ControlNet."""
    return replace(spec, edit=replace(spec, modes={}, control=None, **{"tiny": None, **edit}))


def _video_spec(pipeline: str, img2video: str, name: str) -> FamilySpec:
    """A video family: its text encode, latent decode and call arguments are worker.pipelines.
    video's <what>_<name> functions, imported at a render (they need torch)."""
    return FamilySpec(
        pipeline,
        _in_video(f"encode_{name}"),
        _in_video(f"decode_{name}"),
        fp16_safe=False,
        denoiser="transformer",
        modes={"img2video": img2video},
        video_call=_in_video(f"call_{name}"),
        tiny=TinyModel(name, f"{name}.{name}"),
    )


def _in_video(function: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        from worker.pipelines import video

        return getattr(video, function)(*args)

    call.__name__ = function
    return call


# Adding a family is one entry here with its pipeline classes and its tiny model's builder
# (worker.pipelines.tiny), its row in api_client.families, and its tests.
SPECS: dict[str, FamilySpec] = {
    "sd15": _SD,
    "sd2": _SD,
    "sdxl": FamilySpec(
        "StableDiffusionXLPipeline",
        _encode_sdxl,
        _decode_sdxl,
        modes=_modes("StableDiffusionXL"),
        vae_upcast=True,
        # Union ControlNets only (xinsir's ControlNet++): one checkpoint serves every kind, each
        # named by its mode index (ControlNetSpec.union_mode, which the manifest must give).
        control=ControlFamily(
            "ControlNetUnionModel",
            {
                "txt2img": "StableDiffusionXLControlNetUnionPipeline",
                "img2img": "StableDiffusionXLControlNetUnionImg2ImgPipeline",
                "inpaint": "StableDiffusionXLControlNetUnionInpaintPipeline",
            },
        ),
        tiny=TinyModel("sdxl", "sd.sdxl", taesd=(4, 1.0, 0.0), controlnets={"union": 64}),
    ),
    "sd3": FamilySpec(
        "StableDiffusion3Pipeline",
        _encode_sd3,
        _decode_sd3,
        fp16_safe=False,
        denoiser="transformer",
        modes=_modes("StableDiffusion3"),
        control=ControlFamily(
            "SD3ControlNetModel", {"txt2img": "StableDiffusion3ControlNetPipeline"}, global_rng=True
        ),
        # SD3's TAESD mirrors its VAE's scale and shift.
        tiny=TinyModel("sd3", "sd.sd3", taesd=(16, 1.5035, 0.0609), controlnets={"canny": 65}),
    ),
    "flux": _with_edit(
        FamilySpec(
            "FluxPipeline",
            _encode_flux,
            _decode_flux,
            guidance=_true_cfg,
            fp16_safe=False,
            denoiser="transformer",
            modes=_modes("Flux"),
            control=ControlFamily(
                "FluxControlNetModel", {"txt2img": "FluxControlNetPipeline"}, noise_first=True
            ),
            tiny=TinyModel("flux", "flux.flux", controlnets={"canny": 63}),
        ),
        pipeline_class="FluxKontextPipeline",
        call=_kontext_call,
        tiny=TinyModel("flux-kontext", "flux.flux_kontext"),
    ),
    "flux2": FamilySpec(
        "Flux2KleinPipeline",
        _encode_flux2,
        _decode_flux2,
        fp16_safe=False,
        denoiser="transformer",
        tiny=TinyModel("flux2", "flux2.flux2"),
    ),
    "qwenimage": _with_edit(
        FamilySpec(
            "QwenImagePipeline",
            _encode_qwenimage,
            _decode_qwenimage,
            guidance=_true_cfg_only,
            fp16_safe=False,
            denoiser="transformer",
            modes=_modes("QwenImage"),
            control=ControlFamily(
                "QwenImageControlNetModel",
                {"txt2img": "QwenImageControlNetPipeline"},
                noise_first=True,
            ),
            tiny=TinyModel("qwenimage", "qwenimage.qwenimage", controlnets={"canny": 66}),
        ),
        # Its encoder reads the input image too (Prompt.image), through Qwen2.5-VL's vision
        # tower; its Qwen2VLProcessor cannot be built without a video processor, which needs
        # torchvision.
        pipeline_class="QwenImageEditPipeline",
        requires=("torchvision",),
    ),
    "zimage": FamilySpec(
        "ZImagePipeline",
        _encode_zimage,
        _decode_sd3,
        fp16_safe=False,
        denoiser="transformer",
        modes=_modes("ZImage"),
        control=ControlFamily("ZImageControlNetModel", {"txt2img": "ZImageControlNetPipeline"}),
        tiny=TinyModel("zimage", "zimage.zimage", controlnets={"canny": 67}),
    ),
    "wan": _video_spec("WanPipeline", "WanImageToVideoPipeline", "wan"),
    "ltx": _video_spec("LTXPipeline", "LTXImageToVideoPipeline", "ltx"),
}
# The tiny models of the families that are one weights file, not a pipeline (no FamilySpec):
# the upscaler's ESRGAN file, which spandrel reads.
WEIGHTS_FILE_TINIES: tuple[TinyModel, ...] = (TinyModel("upscaler", "upscaler.TinyUpscaler"),)


def tiny_models() -> dict[str, tuple[TinyModel, FamilySpec | None]]:
    """Every tiny model by its name, with the spec it renders with (None: a weights file), each
    once (sd2 shares sd15's spec, so its tiny model)."""
    tinies: dict[str, tuple[TinyModel, FamilySpec | None]] = {}
    for spec in SPECS.values():
        for own in (spec, spec.edit):
            if own is not None and own.tiny is not None:
                tinies.setdefault(own.tiny.name, (own.tiny, own))
    for tiny in WEIGHTS_FILE_TINIES:
        tinies[tiny.name] = (tiny, None)
    return tinies


def spec_for(manifest: Manifest) -> FamilySpec:
    """How this manifest's model renders: its family's spec, or the edit one for an edit model."""
    spec = spec_of(manifest.family)
    if "edit" not in manifest.modes:
        return spec
    if spec.edit is None:
        raise ValueError(f"family {manifest.family!r} has no edit pipeline in this worker")
    return spec.edit


def check_installed(manifest: Manifest) -> None:
    """ImportError naming what this manifest's pipeline needs and this environment lacks."""
    import importlib.util

    spec = spec_for(manifest)
    missing = [name for name in spec.requires if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"model {manifest.id}: {spec.pipeline_class} needs {', '.join(missing)}, which is not"
            " installed (install the build that matches this torch, or stop serving the model)"
        )


def spec_of(name: str) -> FamilySpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(
            f"family {name!r} has no renderer in this worker; supported: {', '.join(sorted(SPECS))}"
        ) from None
