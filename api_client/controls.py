"""ControlNets as a manifest allows them and a request names them: the manifest's `controlnets`
entries, and the check that resolves a request's `controls` against them and the family's
control rule (api_client.families: the families and modes kiln runs them on; no torch here; the
worker's side is worker.pipelines.control)."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api_client.errors import Problem, named_entries, short
from api_client.families import CONTROL_MODES, FAMILIES, ControlRule
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
    rule = _rule(family)
    if rule is not None and rule.union and spec.union_mode is None:
        return (
            f"union_mode=None: family {family}'s ControlNet is a union model, so each entry gives"
            " its kind's mode index from the checkpoint's card"
        )
    return None


def control_refusal(family: str, mode: str | None = None) -> str | None:
    """Why a family (and mode) takes no control, or None."""
    if mode == "edit":
        return "an edit model's pipeline takes no ControlNet"
    row = FAMILIES.get(family)
    rule = None if row is None else row.control_rule
    if rule is None:
        return f"family {family} has no ControlNet in kiln" if row is None else row.no_control()
    if mode is not None and mode not in rule.modes:
        return f"family {family} takes a control in {', '.join(rule.modes)} only"
    return None


def _rule(family: str) -> ControlRule | None:
    row = FAMILIES.get(family)
    return None if row is None else row.control_rule


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
    control = _rule(family)
    assert control is not None  # control_refusal says why otherwise
    if len(choices) > 1 and control.one is not None:
        rule = f"family {family} takes one control: {control.one}"
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
        if control.whole_schedule is not None:
            for name, value, whole in (("start", start, 0.0), ("end", end, 1.0)):
                if value != whole:
                    rule = f"must be {whole:g} on family {family}: {control.whole_schedule}"
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
