"""Worker settings: the only module that reads KILN_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api_client.manifest import Switch, SwitchName
from api_client.redact import redact
from api_client.schema import Rung

MemoryMode = Literal["auto", Rung]
SWITCH_NAMES: tuple[SwitchName, ...] = get_args(SwitchName)


class Settings(BaseSettings):
    """Everything an operator can set, as KILN_<NAME> environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="KILN_", extra="ignore", validate_default=True, populate_by_name=True
    )

    redis_url: str = Field(
        "redis://localhost:6379/0",
        description="redis://, rediss://, unix:// or redis+sentinel://HOSTS/SERVICE[/db] URL",
    )
    manifests: Path = Field(Path("manifests"), description="Directory of <model id>.yaml manifests")
    models_dir: Path = Field(
        Path("models"), description="Where manifest sources that are paths resolve"
    )
    output_dir: Path = Field(Path("outputs"), description="Images land in <output_dir>/<job id>/")
    output_url: str | None = Field(
        None, description="Where results go: a directory or s3://bucket/prefix; unset = output_dir"
    )
    url_expires_s: int = Field(
        7 * 24 * 3600, ge=1, le=7 * 24 * 3600, description="Presigned S3 URLs' lifetime (max 7 d)"
    )
    # The store's endpoint and credentials, read the way the AWS tools read them. Unset: boto3's
    # own chain (profiles, instance roles) decides.
    aws_endpoint_url: str | None = Field(
        None, validation_alias=AliasChoices("aws_endpoint_url", "AWS_ENDPOINT_URL")
    )
    aws_region: str | None = Field(
        None, validation_alias=AliasChoices("aws_region", "AWS_REGION", "AWS_DEFAULT_REGION")
    )
    aws_access_key_id: str | None = Field(
        None, validation_alias=AliasChoices("aws_access_key_id", "AWS_ACCESS_KEY_ID")
    )
    aws_secret_access_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY")
    )
    webhooks: str = Field(
        "",
        description='Webhook targets: JSON {"name": {"url", "secret"}} or a JSON file path',
    )
    webhook_attempts: int = Field(10, ge=1, description="Tries per webhook delivery")
    webhook_backoff_s: float = Field(
        1.0, gt=0, description="First retry delay; doubles per try, capped at 60 s"
    )
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
    ram_cache_gb: float = Field(
        8.0,
        ge=0,
        description="Host RAM for pipelines evicted from the device, so a switch back is a copy,"
        " not a disk read; 0 = off",
    )
    max_resident: int = Field(
        0, ge=0, description="At most this many pipelines on the device; 0 = no limit but memory"
    )
    prefetch: Switch = Field(
        "auto",
        description="Read the next queued job's model into the RAM cache while a job renders;"
        " auto: where the device is not the host's CPU (there the read slows the render)",
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
    events_retention_s: int = Field(
        86400,
        ge=60,
        description="How long a model queue's event stream keeps an event (trimmed by age)",
    )
    input_max_mb: float = Field(
        16.0,
        gt=0,
        le=512,  # a Redis string holds at most 512 MB
        description="Largest input image (upload or store file) a job may read, in MiB",
    )
    input_ttl_s: int = Field(
        86400,
        ge=60,
        description="How long client.upload() keeps an input image in Redis (kiln:input:<sha256>)",
    )
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
        if not url.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError(
                "must start with redis://, rediss://, unix:// or redis+sentinel://, "
                f"got {redact(url)!r}"
            )
        return url

    @property
    def store_location(self) -> str:
        """KILN_OUTPUT_URL, or KILN_OUTPUT_DIR when that is unset (today's behaviour)."""
        return self.output_url or str(self.output_dir)

    def secrets(self) -> list[str]:
        """Values no log line or message may show (see api_client.redact)."""
        from urllib.parse import urlparse

        found = [urlparse(self.redis_url).password or ""]
        if self.aws_secret_access_key is not None:
            found.append(self.aws_secret_access_key.get_secret_value())
        return [s for s in found if s]

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
