"""Worker settings: the only module that reads KILN_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api_client.manifest import Switch, SwitchName

MemoryMode = Literal["auto", "full", "model_offload", "group_offload"]
SWITCH_NAMES: tuple[SwitchName, ...] = get_args(SwitchName)


class Settings(BaseSettings):
    """Everything an operator can set, as KILN_<NAME> environment variables."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore", validate_default=True)

    redis_url: str = Field(
        "redis://localhost:6379/0", description="redis://, rediss:// or unix:// URL"
    )
    manifests: Path = Field(Path("manifests"), description="Directory of <model id>.yaml manifests")
    models_dir: Path = Field(
        Path("models"), description="Where manifest sources that are paths resolve"
    )
    output_dir: Path = Field(Path("outputs"), description="Images land in <output_dir>/<job id>/")
    timings_log: Path = Field(Path("outputs/timings.jsonl"), description="One JSON line per job")
    device: Literal["auto", "cuda", "cpu", "mps"] = Field(
        "auto", description="auto picks cuda, then mps, then cpu"
    )
    memory_mode: MemoryMode = Field(
        "auto", description="auto walks the ladder; a rung name pins it"
    )
    vram_reserve_gb: float = Field(0.5, ge=0, description="Free memory kiln leaves untouched")
    vram_budget_gb: float | None = Field(
        None, gt=0, description="Cap on what kiln may use, even on a big card"
    )
    device_profile: str | None = Field(
        None,
        description="Decide as this card would (t4, l4, a100, h100, h200, mi300, mps; NAME:FREE_GIB"
        " sets its free memory); tensors stay on the real device",
    )
    compile: Switch = Field(
        "auto", description="torch.compile at the full rung: auto = on for accelerators"
    )
    log_format: Literal["json", "console"] = Field(
        "json", description="structlog renderer for stdout"
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Prometheus /metrics port; unset = off"
    )
    job_timeout_s: int = Field(600, ge=1, description="A job running longer is failed")
    faults: str = Field("", description="Fault drills, e.g. oom@denoise:full*2,oom@load:full")
    inductor_cache_dir: Path = Field(
        Path.home() / ".cache" / "kiln" / "inductor", description="Persistent torch.compile cache"
    )
    sdpa: Switch = "auto"
    channels_last: Switch = "auto"
    quantize: Switch = "auto"
    vae_tiling: Switch = "auto"
    attention_slicing: Switch = "auto"
    taesd_preview: Switch = "auto"

    @field_validator("redis_url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"must start with redis://, rediss:// or unix://, got {url!r}")
        return url

    @field_validator("device_profile")
    @classmethod
    def _known_profile(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        from worker.profiles import parse_profile

        parse_profile(value)
        return value.strip().lower()

    def switch(self, name: SwitchName) -> Switch:
        value: Switch = getattr(self, name)
        return value
