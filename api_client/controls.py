"""ControlNets as a manifest allows them and a request names them: the manifest's `controlnets`
entries, the families and modes kiln runs them on, and the check that resolves a request's
`controls` against them (no torch here; the worker's side is worker.pipelines.control)."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api_client.errors import Problem, named_entries, short
from api_client.schema import MAX_CONTROLS, ControlChoice

CONTROL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# What a control image shows: the kind of map its ControlNet was trained on.
# union: a union checkpoint that takes no mode index and reads any of its maps (Qwen-Image's).
ControlKind = Literal[
    "canny",
    "depth",
    "pose",
    "lineart",
    "softedge",
    "scribble",
    "normal",
    "segmentation",
    "tile",
    "union",
]
# What the worker computes from a request's image before the ControlNet reads it: nothing (the
# image is already the map), or Canny edges (no model needed). Others need a model of their own
# (a depth or pose estimator) and are the client's to run.
PREPROCESSORS: tuple[str, ...] = ("none", "canny")
MAX_STRENGTH = 2.0  # A1111's and ComfyUI's slider ends; past it a control burns the image

# Families and modes kiln runs a ControlNet on, with diffusers 0.42's pipelines for each
# (worker.pipelines.families: FamilySpec.control). A mode is listed where diffusers has its
# control pipeline and a control at strength 0 renders what no control renders.
CONTROL_MODES: dict[str, tuple[str, ...]] = {
    "sd15": ("txt2img", "img2img", "inpaint"),
    "sd2": ("txt2img", "img2img", "inpaint"),  # SD 2.x ControlNets run in the same pipelines
    # Union ControlNets (StableDiffusionXLControlNetUnion*Pipeline) in all three modes.
    "sdxl": ("txt2img", "img2img", "inpaint"),
    # FluxControlNetImg2Img/Inpaint draw the control image's VAE sample from the job's generator
    # before the input's noise, so a control, even at strength 0, would change the noise: until
    # kiln draws that noise itself for them, FLUX.1 takes a control in txt2img only.
    "flux": ("txt2img",),
    # diffusers has no SD3 ControlNet img2img; StableDiffusion3ControlNetInpaintingPipeline is an
    # inpainting ControlNet's (the masked image is its control image), with no image or strength.
    "sd3": ("txt2img",),
    # No Qwen-Image ControlNet img2img; QwenImageControlNetInpaintPipeline, like SD3's, runs an
    # inpainting ControlNet on a control image and control mask, with no image or strength.
    "qwenimage": ("txt2img",),
    # No Z-Image ControlNet img2img; ZImageControlNetInpaintPipeline feeds the masked image and
    # the mask to the ControlNet (33 input channels, Fun-Controlnet-Union 2.x's) and takes no
    # strength: another checkpoint's task, not kiln's inpaint.
    "zimage": ("txt2img",),
}
NO_CONTROL: dict[str, str] = {
    "flux2": "FLUX.2 klein has no ControlNet (none published for it, none in diffusers 0.42)",
}
# Families whose ControlNet kiln loads as a union model (ControlNetUnionModel): each manifest
# entry gives the mode its checkpoint's card lists for its kind.
UNION_FAMILIES: frozenset[str] = frozenset({"sdxl"})
# Families whose control pipeline takes one ControlNet and one image, and why.
ONE_CONTROL: dict[str, str] = {
    "qwenimage": (
        "QwenImageControlNetPipeline runs one ControlNet (its multi-ControlNet is one union"
        " checkpoint over several images, not several checkpoints)"
    ),
    "zimage": "ZImageControlNetPipeline takes one ZImageControlNetModel",
}
# Families whose control pipeline applies a control over every step, and why.
WHOLE_SCHEDULE: dict[str, str] = {
    "zimage": "ZImageControlNetPipeline's call takes no control_guidance_start or end",
}


class ControlNetSpec(BaseModel):
    """One ControlNet a manifest allows: `controlnets: {canny: {source, kind}}`. A union
    checkpoint serves several kinds: one entry per kind, the same source, each with the mode
    index the checkpoint's card gives (`union_mode`); entries sharing a source load it once."""

    model_config = ConfigDict(extra="forbid")

    # A directory under KILN_MODELS_DIR (or an absolute path), else a hub repo id.
    source: str = Field(min_length=1)
    revision: str | None = None
    subfolder: str | None = None
    kind: ControlKind
    union_mode: int | None = Field(default=None, ge=0, le=15)
    # Its 16-bit weights in GB, counted in the ladder beside the pipeline's for a job that uses
    # it (measured peaks replace it once a job ran).
    gb: float = Field(default=0.0, ge=0)
    license: str | None = None  # the checkpoint's own, where it differs from the base model's


def check_control_names(
    controlnets: dict[str, ControlNetSpec], family: str | None = None
) -> dict[str, ControlNetSpec]:
    """The manifest's entries, or ValueError naming the first whose name, or whose fit to the
    family's ControlNet (entry_refusal), breaks a rule."""
    for name, spec in controlnets.items():
        if not CONTROL_NAME.fullmatch(name):
            raise ValueError(
                f"controlnet name {name!r} must be 1-64 lowercase letters, digits, '.', '_' or '-'"
            )
        why = entry_refusal(family, spec) if family is not None else None
        if why is not None:
            raise ValueError(f"controlnets.{name}: {why}")
    return controlnets


def entry_refusal(family: str, spec: ControlNetSpec) -> str | None:
    """Why a manifest entry cannot run on its family's ControlNet pipeline, or None."""
    if family in UNION_FAMILIES and spec.union_mode is None:
        return (
            f"union_mode=None: family {family}'s ControlNet is a union model, so each entry gives"
            " its kind's mode index from the checkpoint's card"
        )
    return None


def control_refusal(family: str, mode: str | None = None) -> str | None:
    """Why a family (and mode) takes no control, or None."""
    if mode == "edit":
        return "an edit model's pipeline takes no ControlNet"
    modes = CONTROL_MODES.get(family)
    if modes is None:
        return NO_CONTROL.get(family, f"family {family} has no ControlNet in kiln")
    if mode is not None and mode not in modes:
        return f"family {family} takes a control in {', '.join(modes)} only"
    return None


def resolve_controls(
    choices: list[ControlChoice] | None,
    controlnets: dict[str, ControlNetSpec],
    model: str,
    family: str,
    mode: str,
    problems: list[Problem],
) -> list[ControlChoice] | None:
    """The request's controls with strength, start, end and preprocess filled in, in the order
    given; each problem (unknown name, a name twice, a value out of range, a control on a mode
    or family without one) is added to problems, naming it. The image's own form is checked too
    (api_client.inputs.parse_ref); its bytes and size where the client or worker can read them."""
    from api_client.inputs import InputRefused, parse_ref

    if not choices:
        return None  # an empty list asks for nothing: the same request as none
    if not controlnets:
        names = ", ".join(c.name for c in choices)
        rule = f"model {model}'s manifest allows no controlnets"
        problems.append(Problem("controls", names, rule))
        return None
    why = control_refusal(family, mode)
    if why is not None:
        problems.append(Problem("controls", f"mode {mode}", why))
        return None
    if len(choices) > 1 and family in ONE_CONTROL:
        rule = f"family {family} takes one control: {ONE_CONTROL[family]}"
        problems.append(Problem("controls", f"{len(choices)} controls", rule))
        return None
    resolved: list[ControlChoice] = []
    for field, choice, spec in named_entries(choices, controlnets, "controls", problems):
        before = len(problems)
        why = entry_refusal(family, spec)
        if why is not None:
            problems.append(Problem(f"{field}.name", choice.name, f"model {model}'s entry: {why}"))
        try:
            parse_ref(choice.image, f"{field}.image")
        except InputRefused as exc:
            problems.append(exc.problem)
        strength = 1.0 if choice.strength is None else choice.strength
        if not math.isfinite(strength) or not 0 <= strength <= MAX_STRENGTH:
            rule = f"must be between 0 and {MAX_STRENGTH:g}"
            problems.append(Problem(f"{field}.strength", strength, rule))
        start = 0.0 if choice.start is None else choice.start
        end = 1.0 if choice.end is None else choice.end
        for name, value in (("start", start), ("end", end)):
            if not math.isfinite(value) or not 0 <= value <= 1:
                rule = "must be between 0 and 1 (the share of the steps)"
                problems.append(Problem(f"{field}.{name}", value, rule))
        if math.isfinite(start) and math.isfinite(end) and start >= end:
            rule = f"must be below end ({end:g}): the control applies from start to end"
            problems.append(Problem(f"{field}.start", start, rule))
        if family in WHOLE_SCHEDULE:
            for name, value, whole in (("start", start, 0.0), ("end", end, 1.0)):
                if value != whole:
                    rule = f"must be {whole:g} on family {family}: {WHOLE_SCHEDULE[family]}"
                    problems.append(Problem(f"{field}.{name}", value, rule))
        preprocess = choice.preprocess or "none"
        if preprocess == "canny" and spec.kind not in ("canny", "union"):
            rule = f"canny edges feed a canny ControlNet; {choice.name} is a {spec.kind} one"
            problems.append(Problem(f"{field}.preprocess", preprocess, rule))
        if len(problems) == before:
            resolved.append(
                choice.model_copy(
                    update={
                        "strength": float(strength),
                        "start": float(start),
                        "end": float(end),
                        "preprocess": preprocess,
                    }
                )
            )
    return resolved


def parse_control_flag(text: str) -> ControlChoice:
    """`kiln submit --control NAME:PATH[:STRENGTH]` (the path is read and uploaded by the caller);
    ValueError naming the flag's value."""
    name, sep, rest = text.partition(":")
    if not name or not sep or not rest:
        raise ValueError(f"--control {short(text)!r}: must be NAME:PATH or NAME:PATH:STRENGTH")
    from api_client.inputs import path_and_strength

    path, strength = path_and_strength(rest)
    return ControlChoice(name=name, image=path, strength=strength)


__all__ = [
    "CONTROL_MODES",
    "MAX_CONTROLS",
    "ControlNetSpec",
    "control_refusal",
    "entry_refusal",
    "parse_control_flag",
    "resolve_controls",
]
