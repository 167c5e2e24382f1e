"""A sampler per job: ComfyUI's sampler and sigma-schedule names (the ones self-hosters know),
which of them a family's pipelines take, and AUTOMATIC1111's names for the same samplers, so a
seed renders the same pixels through kiln's API and A1111's (docs/contract.md, "Samplers").

No torch here: the worker maps a name onto a diffusers scheduler (worker.pipelines.samplers)."""

from __future__ import annotations

from typing import Literal, get_args

Sampler = Literal[
    "euler",
    "euler_ancestral",
    "heun",
    "dpmpp_2m",
    "dpmpp_2m_sde",
    "dpmpp_sde",
    "ddim",
    "uni_pc",
    "lcm",
]
SAMPLERS: tuple[Sampler, ...] = get_args(Sampler)
# How a sampler spaces its noise levels: as the model was trained (normal), or Karras', exponential
# or beta schedules (diffusers' use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas).
Sigmas = Literal["normal", "karras", "exponential", "beta"]
SIGMAS: tuple[Sigmas, ...] = get_args(Sigmas)

# AUTOMATIC1111's sampler names (its /sdapi/v1/samplers) for kiln's, and the aliases A1111 itself
# accepts; "Euler a" is euler_ancestral.
A1111_SAMPLERS: dict[str, Sampler] = {
    "Euler a": "euler_ancestral",
    "Euler": "euler",
    "Heun": "heun",
    "DPM++ 2M": "dpmpp_2m",
    "DPM++ 2M SDE": "dpmpp_2m_sde",
    "DPM++ SDE": "dpmpp_sde",
    "DDIM": "ddim",
    "UniPC": "uni_pc",
    "LCM": "lcm",
}
A1111_ALIASES: dict[str, str] = {
    "k_euler_a": "Euler a",
    "k_euler": "Euler",
    "k_heun": "Heun",
    "k_dpmpp_2m": "DPM++ 2M",
    "k_dpmpp_2m_sde": "DPM++ 2M SDE",
    "k_dpmpp_sde": "DPM++ SDE",
}
# A1111's schedulers (1.9 and later) that are one of kiln's sigma schedules; "automatic" is the
# sampler's own default, read as absent. Before 1.9 the schedule rode in the sampler's name
# ("DPM++ 2M Karras"): from_a1111 reads that form too.
A1111_SCHEDULERS: dict[str, Sigmas | None] = {
    "automatic": None,
    "uniform": "normal",
    "normal": "normal",
    "karras": "karras",
    "exponential": "exponential",
    "beta": "beta",
}
_NAME_SCHEDULES = {" Karras": "karras", " Exponential": "exponential"}


def from_a1111(sampler_name: str, scheduler: str | None = None) -> tuple[Sampler, Sigmas | None]:
    """kiln's sampler and sigmas for A1111's sampler_name and scheduler; ValueError naming which
    of the two kiln has no sampler for, and the names it takes."""
    name = A1111_ALIASES.get(sampler_name, sampler_name)
    named_sigmas: Sigmas | None = None
    for suffix, sigmas in _NAME_SCHEDULES.items():
        if name.endswith(suffix) and name[: -len(suffix)] in A1111_SAMPLERS:
            name, named_sigmas = name[: -len(suffix)], sigmas  # type: ignore[assignment]
    if name not in A1111_SAMPLERS:
        raise ValueError(
            f"sampler_name {sampler_name!r} is not one kiln runs; it runs "
            + ", ".join(repr(known) for known in A1111_SAMPLERS)
        )
    key = (scheduler or "automatic").lower()
    if key not in A1111_SCHEDULERS:
        raise ValueError(
            f"scheduler {scheduler!r} is not one kiln runs; it runs "
            + ", ".join(repr(known) for known in A1111_SCHEDULERS)
        )
    return A1111_SAMPLERS[name], A1111_SCHEDULERS[key] or named_sigmas


def to_a1111(sampler: Sampler) -> str:
    """A1111's name for kiln's sampler (its infotexts' "Sampler:")."""
    return next(name for name, ours in A1111_SAMPLERS.items() if ours == sampler)


# How A1111 (1.9 and later) labels kiln's sigma schedules in its infotexts' "Schedule type".
A1111_SCHEDULE_LABELS: dict[Sigmas, str] = {
    "normal": "Normal",
    "karras": "Karras",
    "exponential": "Exponential",
    "beta": "Beta",
}


def a1111_schedule(sigmas: Sigmas) -> str:
    """A1111's label for kiln's sigma schedule (its infotexts' "Schedule type: Karras")."""
    return A1111_SCHEDULE_LABELS[sigmas]
