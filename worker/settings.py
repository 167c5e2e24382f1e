"""Worker settings: the only module that reads KILN_* environment variables, and the typed
values parsed from them once at start (webhook targets: KILN_WEBHOOKS's grammar below)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlparse

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from api_client.errors import Problem, RequestRejected
from api_client.manifest import ManifestDirs, Switch, SwitchName, manifest_dirs
from api_client.redact import redact
from api_client.schema import WEBHOOK_NAME, RenderRequest, Rung
from api_client.webhooks import secret_key

MemoryMode = Literal["auto", Rung]
SWITCH_NAMES: tuple[SwitchName, ...] = get_args(SwitchName)


def data_dir() -> Path:
    """kiln's per-user data directory, where models and outputs go when KILN_MODELS_DIR and
    KILN_OUTPUT_DIR are unset: $XDG_DATA_HOME/kiln (~/.local/share/kiln) on Linux,
    ~/Library/Application Support/kiln on macOS, %LOCALAPPDATA%\\kiln on Windows."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "kiln"
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        return (Path(local) if local else Path.home() / "AppData" / "Local") / "kiln"
    xdg = os.environ.get("XDG_DATA_HOME", "")
    # The XDG spec: a relative value is invalid and is ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "kiln"


def _timings_log(data: dict[str, Any]) -> Path:
    return Path(data.get("output_dir") or data_dir() / "outputs") / "timings.jsonl"


class Settings(BaseSettings):
    """Everything an operator can set, as KILN_<NAME> environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="KILN_", extra="ignore", validate_default=True, populate_by_name=True
    )

    redis_url: str = Field(
        "redis://localhost:6379/0",
        description="redis://, rediss://, unix:// or redis+sentinel://HOSTS/SERVICE[/db] URL",
    )
    manifests: Annotated[ManifestDirs, NoDecode] = Field(
        default_factory=manifest_dirs,
        description="Manifest directories (os.pathsep separated) read after the shipped ones;"
        " a manifest there replaces a shipped one with the same id",
    )
    models: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Model ids this worker serves, comma separated (--models overrides); unset:"
        " every manifest whose weights are already here",
    )
    models_dir: Path = Field(
        default_factory=lambda: data_dir() / "models",
        description="Where manifest sources that are paths resolve; default: the data directory",
    )
    output_dir: Path = Field(
        default_factory=lambda: data_dir() / "outputs",
        description="Images land in <output_dir>/<job id>/; default: the data directory",
    )
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
    webhook_retries: Annotated[tuple[float, ...], NoDecode] = Field(
        (5, 60, 300, 1800, 7200, 21600),
        description="Seconds between a webhook delivery's tries, comma separated (1 try more "
        "than there are numbers); after the last it is a dead letter (`kiln webhooks`)",
    )
    timings_log: Path = Field(
        default_factory=_timings_log,
        description="One JSON line per job; default: timings.jsonl in output_dir",
    )
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
    # The lease, its heartbeat and the sweep: a killed worker's job runs again within about
    # lease_s + sweep_s (15 s by default; the contract promises 20). Tests shorten them.
    lease_s: int = Field(
        10,
        ge=2,
        le=3600,
        description="A running job's lease lapses this long after its last push; then the"
        " sweep puts the job back on its queue",
    )
    heartbeat_s: float = Field(
        3.0, gt=0, description="How often a worker pushes its running job's lease (below lease_s)"
    )
    sweep_s: float = Field(
        5.0, gt=0, description="How often a worker looks for jobs whose lease lapsed"
    )
    store_backoff_s: Annotated[tuple[float, ...], NoDecode] = Field(
        (10, 30, 90),
        description="Seconds before each retry of a job the store could not take (S3 5xx, a"
        " refused connection), comma separated; after the last the job fails naming the cause",
    )
    webhook_lease_s: float = Field(
        60.0,
        gt=0,
        description="A webhook sender holds a delivery this long; one taken by a worker that"
        " died goes to another sender after it",
    )
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
    compile_cache_mb: float = Field(
        1024.0,
        ge=0,
        description="The fleet's compile cache in Redis (kiln-fleet:*): at most this many MiB of"
        " bundles of compiled code, least recently used dropped first; 0 = share nothing",
    )
    compile_cache_ttl_s: int = Field(
        14 * 86400, ge=60, description="A shared compile bundle lives this long from its last use"
    )
    sdpa: Switch = "auto"
    channels_last: Switch = "auto"
    quantize: Switch = "auto"
    vae_tiling: Switch = "auto"
    attention_slicing: Switch = "auto"
    taesd_preview: Switch = "auto"
    # Reuse of denoiser work between steps where the manifest declares a step_cache: auto at or
    # above its min_steps, on at any steps, off never (worker.pipelines.step_cache).
    step_cache: Switch = "auto"

    @field_validator("redis_url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError(
                "must start with redis://, rediss://, unix:// or redis+sentinel://, "
                f"got {redact(url)!r}"
            )
        return url

    @field_validator("models", mode="before")
    @classmethod
    def _model_list(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("webhook_retries", "store_backoff_s", mode="before")
    @classmethod
    def _retry_schedule(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                value = tuple(float(part) for part in value.split(",") if part.strip())
            except ValueError:
                raise ValueError(f"must be seconds, comma separated, got {value!r}") from None
        if isinstance(value, tuple) and any(not 0 <= s < 10**7 for s in value):
            raise ValueError(f"each delay must be 0 to 10**7 seconds, got {value!r}")
        return value

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> Settings:
        if self.heartbeat_s >= self.lease_s:
            raise ValueError(
                f"KILN_HEARTBEAT_S ({self.heartbeat_s}) must be below KILN_LEASE_S"
                f" ({self.lease_s}): a lease pushed less often than it lasts lapses under its job"
            )
        return self

    @property
    def store_location(self) -> str:
        """KILN_OUTPUT_URL, or KILN_OUTPUT_DIR when that is unset (today's behaviour)."""
        return self.output_url or str(self.output_dir)

    @property
    def published_store(self) -> str:
        """The store as clients judge input uris against it: s3://bucket/prefix as given, a
        directory as its absolute path (a relative one means nothing on another host)."""
        location = self.store_location
        if location.startswith("s3://"):
            return location.rstrip("/")
        path = urlparse(location).path if location.startswith("file://") else location
        return str(Path(path).resolve())

    def secrets(self) -> list[str]:
        """Values no log line or message may show (see api_client.redact)."""

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


class WebhooksInvalid(ValueError):
    """KILN_WEBHOOKS cannot be used; the message names the target and field, never a secret."""


class WebhookTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    secret: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest.split("/")[0]:
            raise ValueError("must be an http:// or https:// URL with a host")
        return url

    @field_validator("secret")
    @classmethod
    def _whsec(cls, secret: str) -> str:
        secret_key(secret)  # its ValueError names the expected form, never the secret
        return secret


def parse_targets(raw: str) -> dict[str, WebhookTarget]:
    """KILN_WEBHOOKS as targets by name; {} when unset."""
    text = raw.strip()
    if not text:
        return {}
    if not text.startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise WebhooksInvalid(f"KILN_WEBHOOKS file {raw!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WebhooksInvalid(f"KILN_WEBHOOKS is not valid JSON: {exc.msg} at {exc.pos}") from None
    if not isinstance(data, dict):
        raise WebhooksInvalid('KILN_WEBHOOKS must be an object {"name": {"url", "secret"}}')
    targets: dict[str, WebhookTarget] = {}
    for name, spec in data.items():
        if not WEBHOOK_NAME.fullmatch(name):
            raise WebhooksInvalid(f"KILN_WEBHOOKS target name {name!r}: 1-64 of [A-Za-z0-9_.-]")
        try:
            targets[name] = WebhookTarget.model_validate(spec)
        except ValidationError as exc:
            # Each error names the field and rule; the input (maybe the secret) is left out.
            rules = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'target'}: {e['msg']}"
                for e in exc.errors()
            )
            raise WebhooksInvalid(f"KILN_WEBHOOKS target {name!r}: {rules}") from None
    return targets


def check_target(request: RenderRequest, targets: Mapping[str, WebhookTarget]) -> None:
    """The worker's own check: a request may only name a target this worker knows."""
    if request.webhook is None:
        return
    if request.webhook not in targets:
        known = ", ".join(sorted(targets)) or "none"
        rule = f"unknown webhook target; this worker is configured with: {known}"
        raise RequestRejected([Problem("webhook", request.webhook, rule)], model=request.model)
