"""`kiln doctor`: what this machine offers kiln (device, memory, dtypes, attention, compile,
torchao, Redis) and, for one model, the switch report of a real load."""

from __future__ import annotations

import importlib.metadata
import os
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from api_client.connection import connect
from api_client.redact import redact
from api_client.schema import Attempt, Rung, SettingsReport
from worker import device as dev
from worker.compile import compile_available
from worker.device import DeviceInfo
from worker.errors import OutOfMemory
from worker.faults import FaultPlan
from worker.ladder import GB, Ladder, pick_rung, usable_gb
from worker.loading import load_pipeline
from worker.quantize import torchao_version, unsupported_reason
from worker.resident import LoadedPipeline, PipelineCache, release_memory
from worker.settings import SWITCH_NAMES, Settings

PACKAGES = ("torch", "diffusers", "transformers", "torchao", "accelerate", "rq")


@dataclass
class ModelCheck:
    """One real load of a model: where it landed and what each switch did."""

    model: str
    rung: Rung | None = None
    rung_reason: str = ""
    dtype: str | None = None
    load_s: float = 0.0
    device_bytes: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    settings: SettingsReport = field(default_factory=SettingsReport)
    error: str | None = None


@dataclass
class DoctorReport:
    """Everything `kiln doctor` prints, as data so tests can read it."""

    info: DeviceInfo
    usable_gb: float
    versions: dict[str, str]
    rocm_aotriton: str | None
    attention: dict[str, bool]
    compile: str
    torchao: dict[str, str]
    redis: str
    redis_ok: bool
    model: ModelCheck | None = None

    @property
    def ok(self) -> bool:
        return self.redis_ok and (self.model is None or self.model.error is None)


def run_doctor(settings: Settings, model: str | None = None) -> int:
    report = collect(settings, model)
    print(format_report(report, settings))
    return 0 if report.ok else 1


def collect(settings: Settings, model: str | None = None) -> DoctorReport:
    info = dev.probe(settings)
    usable = usable_gb(info.free_bytes, 0, settings.vram_reserve_gb, settings.vram_budget_gb, 0)
    redis_line, redis_ok = _redis(settings.redis_url)
    redis_line = redact(redis_line, settings.secrets())
    return DoctorReport(
        info=info,
        usable_gb=usable,
        versions={name: _version(name) for name in PACKAGES},
        rocm_aotriton=_aotriton(info),
        attention=dev.sdpa_backends(info),
        compile=_compile_line(settings, info),
        torchao=_torchao(info),
        redis=redis_line,
        redis_ok=redis_ok,
        model=_check_model(settings, info, model) if model else None,
    )


def format_report(report: DoctorReport, settings: Settings) -> str:
    info = report.info
    lines = [
        "device",
        f"  backend       {info.backend} ({info.torch_device}): {info.name}",
        f"  memory        {info.total_bytes / GB:.1f} GB total, {info.free_bytes / GB:.1f} GB free,"
        f" {report.usable_gb:.1f} GB usable (reserve {settings.vram_reserve_gb} GB,"
        f" budget {settings.vram_budget_gb or 'none'})",
        f"  dtypes        bf16 {_yes(info.bf16)}, fp16 {_yes(info.fp16)};"
        f" memory mode {settings.memory_mode}",
        "  versions      " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
    ]
    if report.rocm_aotriton is not None:
        flag = f"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL={report.rocm_aotriton}"
        lines.append(f"  rocm          {flag}")
    kernels = ", ".join(f"{name} {_yes(on)}" for name, on in report.attention.items())
    lines += [
        f"  attention     sdpa kernels: {kernels}",
        f"  compile       {report.compile}",
        "  torchao       " + "; ".join(f"{k}: {v}" for k, v in report.torchao.items()),
        f"  redis         {report.redis}",
        f"  store         {_store_line(settings)}",
        "  switches      " + ", ".join(f"{name}={settings.switch(name)}" for name in SWITCH_NAMES),
    ]
    if report.model is not None:
        lines += _model_lines(report.model)
    else:
        lines.append("  (`kiln doctor --model ID` loads a model and reports what each switch did)")
    return "\n".join(lines)


def _model_lines(check: ModelCheck) -> list[str]:
    lines = [f"model {check.model}"]
    if check.attempts:
        tried = [f"{a.rung}: out of memory ({a.detail})" for a in check.attempts]
        lines.append(f"  attempts      {', '.join(tried)}")
    if check.error is not None:
        lines.append(f"  FAILED        {check.error}")
        return lines
    lines += [
        f"  rung          {check.rung} ({check.rung_reason})",
        f"  loaded        {check.dtype} in {check.load_s:.2f} s, {check.device_bytes / 1e6:.1f} MB",
    ]
    for kind in ("applied", "skipped", "fell_back"):
        for note in getattr(check.settings, kind):
            lines.append(f"  {kind:<13} {note.name}: {note.reason}")
    return lines


def _check_model(settings: Settings, info: DeviceInfo, model: str) -> ModelCheck:
    """Load the model as a worker would (rung choice, the ladder's loading rules) and keep
    its report."""
    from worker.errors import ManifestDirectoryInvalid
    from worker.manifest import load_manifests

    check = ModelCheck(model=model)
    try:
        manifest = load_manifests(settings.manifests, [model])[model]
    except (ManifestDirectoryInvalid, KeyError, ValueError) as exc:
        check.error = f"no valid manifest: {exc}"
        return check
    reserve, budget = settings.vram_reserve_gb, settings.vram_budget_gb
    usable = usable_gb(dev.free_bytes(info), 0, reserve, budget, 0)
    choice = pick_rung(manifest, usable, settings.memory_mode)
    check.rung_reason = choice.reason
    faults = FaultPlan.parse(settings.faults)
    ladder = Ladder(model, settings.memory_mode, check.attempts)

    def load(rung: Rung) -> LoadedPipeline:
        return load_pipeline(manifest, rung, info, settings, faults)

    started = time.perf_counter()
    try:
        loaded = ladder.load(choice.rung, load, reclaim=lambda: release_memory(info))
    except OutOfMemory as exc:
        check.error = str(exc)
        return check
    except Exception as exc:
        check.error = f"{type(exc).__name__}: {exc}"
        return check
    check.rung, check.dtype = loaded.rung, loaded.dtype_name
    check.settings = loaded.settings
    check.load_s, check.device_bytes = time.perf_counter() - started, loaded.device_bytes
    cache = PipelineCache(info)
    cache.put(loaded)
    cache.evict(model)
    return check


def _compile_line(settings: Settings, info: DeviceInfo) -> str:
    missing = compile_available()
    if missing is not None:
        return f"unavailable: {missing}"
    effective: str = settings.compile
    if effective == "auto":
        effective = "on" if info.accelerator else "off (auto: CPU)"
    return (
        f"available; KILN_COMPILE={settings.compile} -> {effective} at the full rung;"
        f" inductor cache {settings.inductor_cache_dir}"
    )


def _torchao(info: DeviceInfo) -> dict[str, str]:
    version = torchao_version()
    if version is None:
        return {"import": "not importable: every quantize entry will be skipped"}
    schemes = {}
    for scheme in ("int8", "int8_dynamic", "int4", "fp8"):
        reason = unsupported_reason(scheme, info)
        schemes[scheme] = "ok" if reason is None else f"skipped ({reason})"
    return {"version": version, **schemes}


def _redis(url: str) -> tuple[str, bool]:
    try:
        conn = connect(url, socket_connect_timeout=2, socket_timeout=2)
        started = time.perf_counter()
        conn.ping()
        ping_ms = (time.perf_counter() - started) * 1000
        server = conn.info("server").get("redis_version", "?")
        return f"reachable at {url} (redis {server}, ping {ping_ms:.1f} ms)", True
    except (RedisError, OSError) as exc:
        return f"UNREACHABLE at {url}: {exc}", False


def _store_line(settings: Settings) -> str:
    """Where results go, and which credentials are set (never their values)."""
    location = settings.store_location
    if not location.startswith("s3://"):
        return f"{location} (local directory)"
    endpoint = settings.aws_endpoint_url or "AWS default endpoint"
    key = "set" if settings.aws_access_key_id else "from boto3's chain"
    return f"{location} at {endpoint}; access key {key}; URLs expire in {settings.url_expires_s} s"


def _aotriton(info: DeviceInfo) -> str | None:
    if info.backend != "rocm":
        return None
    return os.environ.get("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "unset")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _yes(value: bool) -> str:
    return "yes" if value else "no"
