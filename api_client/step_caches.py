"""The step caches a manifest may declare (diffusers' First Block Cache and MagCache hooks): their
parameters, when auto uses one, and which modes one cannot run (worker.pipelines.step_cache runs
them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Steps at and above which auto uses a model's step cache when its manifest names no min_steps:
# the first step always computes and reuse needs steps that change little, which 20+ step
# schedules have and few-step (distilled) ones do not (Qwen-Image-Lightning 1.04-1.33x, FLUX.2
# klein's PSNR 20-32: issue 29's sources).
DEFAULT_MIN_STEPS = 20


class _StepCacheBase(_Strict):
    min_steps: int | None = Field(default=None, ge=1, le=1000)  # auto uses it from here
    source: str | None = None  # where the figures come from (a paper, a model card)

    @property
    def auto_min_steps(self) -> int:
        return DEFAULT_MIN_STEPS if self.min_steps is None else self.min_steps


class FirstBlockCache(_StepCacheBase):
    """diffusers' First Block Cache: the first transformer block runs every step, the rest are
    skipped while that block's residual has moved by less than `threshold` (relative mean) since
    the last full step. Higher reuses more."""

    kind: Literal["first_block"]
    threshold: float = Field(gt=0, le=1)

    @property
    def params(self) -> dict[str, int | float | str]:
        return {"threshold": self.threshold}


class MagCache(_StepCacheBase):
    """diffusers' MagCache: skips whole steps while the error accumulated from the model's
    calibrated residual-magnitude ratios stays under `threshold`, at most `max_skip_steps` in a
    row, never in the first `retention_ratio` of the steps. The ratios are the checkpoint's own:
    `flux` is diffusers' FLUX.1-dev calibration (FLUX_MAG_RATIOS), or a list from a calibration
    run. They follow the schedule from its first step, so img2img and inpaint, which start
    part-way, do not use it."""

    kind: Literal["magcache"]
    threshold: float = Field(gt=0, le=1)
    max_skip_steps: int = Field(default=3, ge=1, le=50)
    retention_ratio: float = Field(default=0.2, ge=0, lt=1)
    mag_ratios: Literal["flux"] | Annotated[list[float], Field(min_length=2)]

    @property
    def params(self) -> dict[str, int | float | str]:
        ratios = self.mag_ratios if isinstance(self.mag_ratios, str) else "calibrated"
        return {
            "threshold": self.threshold,
            "max_skip_steps": self.max_skip_steps,
            "retention_ratio": self.retention_ratio,
            "mag_ratios": ratios,
        }


StepCacheSpec = Annotated[FirstBlockCache | MagCache, Field(discriminator="kind")]


def partway_refusal(spec: FirstBlockCache | MagCache, mode: str | None) -> str | None:
    """Why a step cache cannot run a job of this mode, or None: MagCache's ratios are indexed
    from the schedule's first step, and img2img and inpaint start part-way through it."""
    if spec.kind == "magcache" and mode in ("img2img", "inpaint"):
        return (
            f"magcache's ratios follow the schedule from its first step, and {mode} starts"
            " part-way through it"
        )
    return None
