"""A reference image (IP-Adapter) as a manifest allows it and a request asks for it: the
manifest's `ip_adapter` (the adapter's weights and its image encoder) and the check that resolves
a request's `reference` (the families and modes kiln runs one on: their rows in
api_client.families; no torch here; the worker's side is worker.pipelines.reference)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api_client.controls import MAX_STRENGTH  # A1111's slider ends, for an IP-Adapter too
from api_client.errors import Problem
from api_client.families import FAMILIES, REFERENCE_MODES
from api_client.schema import ReferenceChoice

DEFAULT_STRENGTH = 1.0  # diffusers' set_ip_adapter_scale default, A1111's and InvokeAI's
WEIGHT_FILES = (".safetensors", ".bin")  # what diffusers' load_ip_adapter reads


class ImageEncoderSpec(BaseModel):
    """The CLIP vision model an IP-Adapter was trained on (CLIPVisionModelWithProjection)."""

    model_config = ConfigDict(extra="forbid")

    # A directory under KILN_MODELS_DIR (or an absolute path), else a hub repo id.
    source: str = Field(min_length=1)
    subfolder: str | None = None
    revision: str | None = None


class IPAdapterSpec(BaseModel):
    """The IP-Adapter a manifest allows: its weights file (image projection and the attention
    layers' key and value projections, h94/IP-Adapter's layout) and its image encoder."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1)  # a directory or hub repo holding weight_name
    subfolder: str | None = None
    weight_name: str = Field(min_length=1)
    revision: str | None = None
    image_encoder: ImageEncoderSpec
    # The adapter's and its encoder's 16-bit weights in GB, counted in the ladder beside the
    # pipeline's for a job with a reference (measured peaks replace it once a job ran).
    gb: float = Field(default=0.0, ge=0)
    license: str | None = None  # the adapter's own, where it differs from the base model's

    @field_validator("image_encoder", mode="before")
    @classmethod
    def _encoder_source(cls, value: object) -> object:
        """`image_encoder: some/encoder` is its source alone (a folder or repo holding it)."""
        return {"source": value} if isinstance(value, str) else value

    @field_validator("weight_name")
    @classmethod
    def _weights_file(cls, name: str) -> str:
        if not name.endswith(WEIGHT_FILES) or "/" in name:
            raise ValueError(
                f"{name!r}: a {' or '.join(WEIGHT_FILES)} file name (what diffusers'"
                " load_ip_adapter reads; its folder is subfolder)"
            )
        if "faceid" in name.lower():
            raise ValueError(
                f"{name!r}: a FaceID adapter carries a LoRA that diffusers loads into the UNet"
                " for good (and takes face embeddings, not an image): kiln runs image adapters"
            )
        return name


def reference_refusal(family: str, mode: str | None = None) -> str | None:
    """Why a family (and mode) takes no reference image, or None."""
    row = FAMILIES.get(family)
    if row is None:
        return f"family {family} has no IP-Adapter in kiln"
    modes = row.reference_modes
    if not modes:
        return row.no_reference()
    if mode is not None and mode not in modes:
        return f"family {family} takes a reference in {', '.join(modes)} only"
    return None


def resolve_reference(
    choice: ReferenceChoice | None,
    spec: IPAdapterSpec | None,
    model: str,
    family: str,
    mode: str,
    problems: list[Problem],
) -> ReferenceChoice | None:
    """The request's reference with its strength filled in; each problem (no adapter in the
    manifest, a family or mode without one, a strength out of range, an image uri of the wrong
    form) is added to problems, naming it."""
    from api_client.inputs import InputRefused, parse_ref

    if choice is None:
        return None
    if spec is None:
        rule = f"model {model}'s manifest names no ip_adapter"
        problems.append(Problem("reference", "a reference image", rule))
        return None
    why = reference_refusal(family, mode)
    if why is not None:
        problems.append(Problem("reference", f"mode {mode}", why))
        return None
    before = len(problems)
    try:
        parse_ref(choice.image, "reference.image")
    except InputRefused as exc:
        problems.append(exc.problem)
    strength = DEFAULT_STRENGTH if choice.strength is None else choice.strength
    if not math.isfinite(strength) or not 0 <= strength <= MAX_STRENGTH:
        rule = f"must be between 0 and {MAX_STRENGTH:g}"
        problems.append(Problem("reference.strength", strength, rule))
    if len(problems) > before:
        return None
    return choice.model_copy(update={"strength": float(strength)})


def parse_reference_flag(text: str) -> ReferenceChoice:
    """`kiln submit --reference PATH[:STRENGTH]` (the path is read and uploaded by the caller);
    ValueError naming the flag's value."""
    from api_client.inputs import path_and_strength

    if not text:
        raise ValueError("--reference '': must be PATH or PATH:STRENGTH")
    path, strength = path_and_strength(text)
    return ReferenceChoice(image=path, strength=strength)


__all__ = [
    "REFERENCE_MODES",
    "IPAdapterSpec",
    "ImageEncoderSpec",
    "parse_reference_flag",
    "reference_refusal",
    "resolve_reference",
]
