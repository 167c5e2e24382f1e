"""A job's sampler on a resident pipeline: kiln's sampler and sigmas names (api_client.samplers) as
a diffusers scheduler class and its config overrides, built from the scheduler config the
pipeline's weights came with (not the manifest's `scheduler:`, whose overrides would leak into
another sampler), set on the pipeline a pass calls and put back when the call ends.

A fresh scheduler each pass: a scheduler holds its timesteps, step index and a multistep
solver's past outputs, so none of a job's state reaches the next job; the denoiser is untouched,
so nothing reloads or recompiles. Which samplers a family takes is its row's
(api_client.families.FamilyRow.samplers); this table says what runs each. Torch and diffusers
are imported only when a scheduler is built, so the image details can name a sampler's class
without them."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from api_client.families import FamilyRow
from api_client.samplers import Sampler, Sigmas


@dataclass(frozen=True)
class Recipe:
    """A sampler as diffusers runs it: a scheduler class and what its config changes."""

    scheduler: str  # attribute of the diffusers package
    overrides: Mapping[str, Any] = field(default_factory=dict)


# For an epsilon or v-prediction UNet: diffusers' own table of A1111's samplers
# (docs: "Schedulers", A1111/k-diffusion equivalents).
NOISE: dict[Sampler, Recipe] = {
    "euler": Recipe("EulerDiscreteScheduler"),
    "euler_ancestral": Recipe("EulerAncestralDiscreteScheduler"),
    "heun": Recipe("HeunDiscreteScheduler"),
    "dpmpp_2m": Recipe(
        "DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}
    ),
    "dpmpp_2m_sde": Recipe(
        "DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}
    ),
    "dpmpp_sde": Recipe("DPMSolverSDEScheduler"),  # its Brownian tree is torchsde's
    "ddim": Recipe("DDIMScheduler"),
    "uni_pc": Recipe("UniPCMultistepScheduler"),
    "lcm": Recipe("LCMScheduler"),
}
# The multistep solvers on a flow's sigmas (diffusers' use_flow_sigmas), the shift the model
# was trained with carried over as their flow_shift.
_ON_FLOW = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
# For a flow-matching denoiser: diffusers' flow solvers. euler_ancestral is FlowMatchEuler's
# stochastic sampling: each step's x0 estimate re-noised to the next sigma with fresh noise.
FLOW: dict[Sampler, Recipe] = {
    "euler": Recipe("FlowMatchEulerDiscreteScheduler", {"stochastic_sampling": False}),
    "euler_ancestral": Recipe("FlowMatchEulerDiscreteScheduler", {"stochastic_sampling": True}),
    "heun": Recipe("FlowMatchHeunDiscreteScheduler"),
    "dpmpp_2m": Recipe(
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, **_ON_FLOW},
    ),
    "dpmpp_2m_sde": Recipe(
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "sde-dpmsolver++", "solver_order": 2, **_ON_FLOW},
    ),
    "uni_pc": Recipe("UniPCMultistepScheduler", _ON_FLOW),
    "lcm": Recipe("FlowMatchLCMScheduler"),
}
# The config flag of each sigma schedule; normal: none of them.
SIGMA_FLAGS: dict[Sigmas, str | None] = {
    "normal": None,
    "karras": "use_karras_sigmas",
    "exponential": "use_exponential_sigmas",
    "beta": "use_beta_sigmas",
}


def recipe(row: FamilyRow, sampler: Sampler) -> Recipe:
    """What runs sampler on the family; ValueError naming the samplers it takes."""
    table = FLOW if row.flow_matching else NOISE
    if sampler not in row.samplers or sampler not in table:
        taken = ", ".join(row.samplers) or "none"
        raise ValueError(f"sampler {sampler!r}: family {row.name} takes {taken}")
    return table[sampler]


def build(base: Mapping[str, Any], row: FamilyRow, sampler: Sampler, sigmas: Sigmas | None) -> Any:
    """A new scheduler for sampler at sigmas from base, a scheduler config (None sigmas: the
    schedule base gives it, as the model ships)."""
    import diffusers

    how = recipe(row, sampler)
    scheduler_cls = getattr(diffusers, how.scheduler)
    accepted = inspect.signature(scheduler_cls.__init__).parameters
    overrides = dict(how.overrides)
    if "flow_shift" in accepted and "shift" in base:
        overrides["flow_shift"] = base["shift"]
    if sigmas is not None:
        if sigmas not in row.sigmas_for(sampler):
            raise ValueError(
                f"sigmas {sigmas!r}: sampler {sampler} on family {row.name} takes"
                f" {', '.join(row.sigmas_for(sampler))}"
            )
        for schedule, flag in SIGMA_FLAGS.items():
            if flag is not None and flag in accepted:
                overrides[flag] = schedule == sigmas
    return scheduler_cls.from_config(base, **overrides)


def class_name(row: FamilyRow, sampler: Sampler) -> str:
    """The diffusers scheduler class a sampler runs as on the family (the record's scheduler)."""
    return recipe(row, sampler).scheduler


@contextmanager
def swapped(
    pipe: Any,
    row: FamilyRow,
    base: Mapping[str, Any] | None,
    sampler: Sampler | None,
    sigmas: Sigmas | None,
) -> Iterator[None]:
    """pipe runs sampler at sigmas inside; its own scheduler is put back after, whatever
    happens. sampler None: pipe runs its own (the manifest's scheduler), untouched. base: the
    config the pipeline's weights came with (None: its scheduler's now)."""
    if sampler is None:
        yield
        return
    own = pipe.scheduler
    pipe.scheduler = build(own.config if base is None else base, row, sampler, sigmas)
    try:
        yield
    finally:
        pipe.scheduler = own
