"""LoRA adapters as a manifest allows them and a request names them: the manifest's `loras`
entries, and the check that resolves a request's [{name, weight}] against them (no torch here;
the worker's side is worker.pipelines.adapters)."""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api_client.errors import Problem, named_entries
from api_client.model_files import refuse_pickle
from api_client.schema import MAX_LORAS, LoraChoice

LORA_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# How far a request may push an adapter, either way. A1111 and ComfyUI take any number, but past
# about 2 an adapter's delta swamps the model (burnt, noisy images); 4 leaves room for adapters
# trained weak, and a weight out of range is refused, never clamped.
MAX_WEIGHT = 4.0


class LoraSpec(BaseModel):
    """One adapter a manifest allows: `loras: {detail: {source, max_rank, default_weight}}`."""

    model_config = ConfigDict(extra="forbid")

    # A directory under KILN_MODELS_DIR (or an absolute path), else a hub repo id.
    source: str = Field(min_length=1)
    # The safetensors file in source; diffusers' default name when unset.
    weight_name: str = Field(default="pytorch_lora_weights.safetensors", min_length=1)
    revision: str | None = None
    # The highest rank this adapter may have: the worker pads every adapter slot to the largest
    # max_rank of the manifest, so swapping never changes a tensor's shape (no recompile).
    max_rank: int = Field(ge=1, le=1024)
    default_weight: float = Field(default=1.0, ge=-MAX_WEIGHT, le=MAX_WEIGHT)

    @model_validator(mode="after")
    def _one_safetensors_file(self) -> LoraSpec:
        """Never a pickle; a source that is the file itself (kohya / A1111, as Civitai serves
        them) takes no weight_name."""
        refuse_pickle("source", self.source)
        refuse_pickle("weight_name", self.weight_name)
        # The default is what a manifest read back from its own dump (Redis, the API) carries.
        if self.is_file and self.weight_name != "pytorch_lora_weights.safetensors":
            raise ValueError(
                f"weight_name {self.weight_name!r}: source {self.source!r} names the file"
                " itself; weight_name picks a file in a directory source"
            )
        return self

    @property
    def is_file(self) -> bool:
        """Whether source names the adapter's file itself rather than a directory."""
        return self.source.lower().endswith(".safetensors")


def check_lora_names(loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
    """Manifest-side: names a request can spell (and a log line can carry) unquoted."""
    for name in loras:
        if not LORA_NAME.fullmatch(name):
            raise ValueError(
                f"lora name {name!r} must be 1-64 lowercase letters, digits, '.', '_' or '-'"
            )
    return loras


def slot_count(loras: dict[str, LoraSpec]) -> int:
    """Adapter slots a pipeline of this manifest keeps: as many as one request may name."""
    return min(MAX_LORAS, len(loras))


def resolve_loras(
    choices: list[LoraChoice] | None,
    loras: dict[str, LoraSpec],
    model: str,
    problems: list[Problem],
) -> list[LoraChoice] | None:
    """The request's adapters with every weight filled in, in the order given; each problem
    (unknown name, a name twice, a weight out of range) is added to problems, naming it."""
    if choices is None:
        return None
    if not choices:
        return None  # an empty list asks for nothing: the same request as none
    if not loras:
        names = ", ".join(c.name for c in choices)
        problems.append(Problem("loras", names, f"model {model}'s manifest allows no loras"))
        return None
    resolved: list[LoraChoice] = []
    for field, choice, spec in named_entries(choices, loras, "loras", problems):
        weight = spec.default_weight if choice.weight is None else choice.weight
        if not math.isfinite(weight) or abs(weight) > MAX_WEIGHT:
            rule = f"must be between -{MAX_WEIGHT:g} and {MAX_WEIGHT:g}"
            problems.append(Problem(f"{field}.weight", weight, rule))
            continue
        resolved.append(LoraChoice(name=choice.name, weight=float(weight)))
    return resolved


def parse_lora_flag(text: str) -> LoraChoice:
    """`kiln submit --lora NAME[:WEIGHT]`; ValueError naming the flag's value."""
    name, sep, weight = text.partition(":")
    if not name:
        raise ValueError(f"--lora {text!r}: must be NAME or NAME:WEIGHT")
    if not sep:
        return LoraChoice(name=name)
    try:
        value = float(weight)
    except ValueError:
        raise ValueError(f"--lora {text!r}: weight {weight!r} is not a number") from None
    return LoraChoice(name=name, weight=value)
