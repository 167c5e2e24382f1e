"""`kiln doctor`: what this machine offers kiln (device, memory, dtypes, attention, compile,
torchao, Redis), for one model the switch report of a real load, and with --profile what a
card would do with every manifest (worker.ops.plan decides and prints those plans).

Over 400 lines because each check (the device, the Redis it talks to and whether that Redis keeps
what it acknowledged, a model's real load) is one section of the same report, read together."""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from api_client.connection import connect
from api_client.errors import short
from api_client.redact import redact
from api_client.schema import Attempt, Rung, SettingsReport
from worker import quiet
from worker.errors import OutOfMemory
from worker.memory import device as dev
from worker.memory import rungs
from worker.memory.device import DeviceInfo
from worker.memory.faults import FaultPlan
from worker.memory.ladder import GB, Ladder, pick_rung, rung_need_gb, usable_gb
from worker.memory.peaks import WRONG_BY, Comparison, PeakBook, card_kind, comparisons
from worker.ops.plan import ModelPlan, plan_lines, plan_manifests
from worker.pipelines.compile import compile_available
from worker.pipelines.compile_cache import CompileCache
from worker.pipelines.loading import fit_for, load_pipeline
from worker.pipelines.prefetch import off_reason
from worker.pipelines.quantize import torchao_version, try_scheme, unsupported_reason
from worker.pipelines.release import release_memory
from worker.pipelines.resident import LoadedPipeline, PipelineCache
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
    # What a restart of that Redis would keep, and what it may evict (durability_lines).
    durability: list[str] = field(default_factory=list)
    # The fleet's compile cache in that Redis: bundles alive and their bytes.
    fleet_compile: dict[str, int] = field(default_factory=dict)
    model: ModelCheck | None = None
    # What this card kind measured (kiln:peaks) beside what the manifests declare.
    measured: list[Comparison] = field(default_factory=list)
    plans: list[ModelPlan] | None = None  # with --profile: every manifest on that card
    served: tuple[str, ...] = ()  # the plans' models a worker would serve (not benchmark_only)

    @property
    def ok(self) -> bool:
        """With --profile: every served model can run on the card (Redis is not the question);
        else Redis answers and the model, if any, loaded."""
        model_ok = self.model is None or self.model.error is None
        if self.plans is not None:
            return model_ok and all(p.runs for p in self.plans if p.model in self.served)
        return self.redis_ok and model_ok


def run_doctor(
    settings: Settings,
    model: str | None = None,
    profile: str | None = None,
    as_json: bool = False,
) -> int:
    if profile is not None:
        from worker.profiles import parse_profile

        try:
            parse_profile(profile)
        except ValueError as exc:
            print(f"kiln doctor: {exc}")
            return 2
        settings = settings.model_copy(update={"device_profile": profile.strip().lower()})
    report = collect(settings, model)
    if profile is not None:
        report.plans, report.served = plan_manifests(settings, report.info, report.usable_gb)
    if as_json:
        print(json.dumps(_json_report(report), indent=2))
    else:
        print(format_report(report, settings))
    return 0 if report.ok else 1


def _json_report(report: DoctorReport) -> list[dict[str, object]] | dict[str, object]:
    """With --profile: one object per manifest; without: the machine's summary as an object."""
    if report.plans is not None:
        return [{**p.as_json(), "served": p.model in report.served} for p in report.plans]
    info = report.info
    return {
        "device": {"backend": info.backend, "name": info.name, "torch_device": info.torch_device},
        "usable_gb": round(report.usable_gb, 2),
        "versions": report.versions,
        "compile": report.compile,
        "torchao": report.torchao,
        "redis": report.redis,
        "durability": report.durability,
        "fleet_compile": report.fleet_compile,
        "measured": [
            {
                "shape": c.shape,
                "rung": c.rung,
                "jobs": c.jobs,
                "measured_gb": round(c.measured_gb, 3),
                "declared_gb": round(c.declared_gb, 3),
                "wrong": c.wrong,
            }
            for c in report.measured
        ],
        "ok": report.ok,
        "model": None if report.model is None else report.model.error or report.model.rung,
    }


def collect(settings: Settings, model: str | None = None) -> DoctorReport:
    info = dev.probe(settings)
    usable = usable_gb(info.free_bytes, 0, settings.vram_reserve_gb, settings.vram_budget_gb, 0)
    redis_line, redis_ok = _redis(settings.redis_url)
    redis_line = redact(redis_line, settings.secrets())
    durability = durability_lines(settings.redis_url) if redis_ok else []
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
        durability=durability,
        fleet_compile=_fleet_compile(settings) if redis_ok else {},
        model=_check_model(settings, info, model) if model else None,
        measured=_measured(settings, info) if redis_ok else [],
    )


def _measured(settings: Settings, info: DeviceInfo) -> list[Comparison]:
    """kiln:peaks for this card kind, each beside the need its manifest declares."""
    from api_client.manifest import load_manifest_dir

    manifests, _failures = load_manifest_dir(settings.manifests)
    book = PeakBook(connect(settings.redis_url), card_kind(info.name, info.simulated))
    book.read()

    def declared(model: str, rung: str) -> float | None:
        manifest = manifests.get(model)
        if manifest is None or rung not in rungs.names() or manifest.family_row.tiles:
            return None
        return rung_need_gb(manifest, rung, fit_for(manifest, info, settings))

    return comparisons(book, declared)


def _measured_lines(measured: list[Comparison]) -> list[str]:
    lines = ["measured (kiln:peaks, this card kind; needs without the planning margin)"]
    for c in measured:
        flag = f" (the manifest is off by more than {WRONG_BY:.0%})" if c.wrong else ""
        lines.append(
            f"  {c.shape} {c.rung}: measured {c.measured_gb:.2f} GB over {c.jobs} job(s),"
            f" declared {c.declared_gb:.2f} GB ({c.off:+.0%}){flag}"
        )
    return lines


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
        *(f"  durability    {line}" for line in report.durability),
        *(
            [f"  fleet cache   {fleet_line(report.fleet_compile, settings)}"]
            if report.redis_ok
            else []
        ),
        f"  store         {_store_line(settings)}",
        "  switches      " + ", ".join(f"{name}={settings.switch(name)}" for name in SWITCH_NAMES),
        f"  model cache   {_cache_line(settings, info)}",
    ]
    if info.simulated is not None:
        lines[1:1] = _profile_lines(info)
    if report.measured:
        lines += _measured_lines(report.measured)
    if report.plans is not None:
        lines += plan_lines(report.plans, report.served)
    if report.model is not None:
        lines += _model_lines(report.model)
    elif report.plans is None:
        lines.append("  (`kiln doctor --model ID` loads a model and reports what each switch did)")
    return "\n".join(lines)


def _profile_lines(info: DeviceInfo) -> list[str]:
    from worker.profiles import PROFILES

    profile = PROFILES[info.simulated or ""]
    capability = "" if info.capability is None else f" sm{info.capability[0]}{info.capability[1]},"
    return [
        f"  profile       {profile.name}: decisions as {profile.card} ({profile.backend},"
        f"{capability} fp8 {_yes(info.fp8)}, copy streams {_yes(info.streams)},"
        f" compile default {'on' if info.compile_default else 'off'});"
        f" tensors stay on {info.torch_device}",
        f"  source        {profile.source}",
    ]


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
        f"available; KILN_COMPILE={settings.compile} -> {effective} at the"
        f" {rungs.compiling()} rung;"
        f" inductor cache {settings.inductor_cache_dir}"
    )


def _fleet_compile(settings: Settings) -> dict[str, int]:
    return CompileCache(connect(settings.redis_url), 0, 0).stats()


def fleet_line(stats: dict[str, int], settings: Settings) -> str:
    """The shared compile cache (worker/pipelines/compile_cache.py) against its bounds."""
    if settings.compile_cache_mb == 0:
        return f"off (KILN_COMPILE_CACHE_MB=0); {stats['entries']} bundle(s) left in Redis"
    return (
        f"{stats['entries']} compile bundle(s), {stats['bytes'] / 2**20:.1f} MiB of"
        f" {settings.compile_cache_mb:g} MiB (KILN_COMPILE_CACHE_MB), each kept"
        f" {settings.compile_cache_ttl_s / 86400:g} day(s) from its last use"
    )


def _torchao(info: DeviceInfo) -> dict[str, str]:
    """Each scheme: the card's verdict, then a real try on a small linear layer on the real
    device (a scheme the card allows can still lack its kernel package, e.g. int4)."""
    version = torchao_version()
    if version is None:
        return {"import": "not importable: every quantize entry will be skipped"}
    schemes = {}
    for scheme in ("float8", "int8", "int8_dynamic", "int4"):
        reason = unsupported_reason(scheme, info)
        if reason is not None:
            schemes[scheme] = f"skipped ({reason})"
            continue
        failure = try_scheme(scheme, info.torch_device)
        where = info.torch_device
        schemes[scheme] = (
            f"ok (quantized and ran a linear layer on {where})"
            if failure is None
            else f"fails on {where} ({failure})"
        )
    missing = quiet.torchao_missing()  # its import's notices, dropped from stderr, said once here
    if missing:
        loaded = f"{', '.join(missing)} (built for another Python or CUDA, or no Triton here)"
        return {"version": version, "not loaded": loaded, **schemes}
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


def durability_lines(url: str) -> list[str]:
    """What a restart of this Redis keeps and whether it may evict, from CONFIG GET: a WARNING
    line when a restart would drop what it acknowledged (AOF off and no RDB schedule: every
    queued job, upload and lease) or when a maxmemory policy other than noeviction may drop
    kiln's keys to make room. CONFIG is often refused (kiln's ACL users lack @dangerous, managed
    Redis renames it): then one line saying it could not be checked."""
    try:
        conn = connect(url, socket_connect_timeout=2, socket_timeout=2)
        config = {
            name: str(conn.config_get(name).get(name, ""))
            for name in ("appendonly", "appendfsync", "save", "maxmemory-policy", "maxmemory")
        }
    except (RedisError, OSError) as exc:
        return [
            f"not checked: CONFIG GET refused ({short(str(exc), 120)}); ask the operator"
            " for appendonly, save and maxmemory-policy"
        ]
    return [_persistence_line(config), _eviction_line(config)]


def _persistence_line(config: dict[str, str]) -> str:
    if config["appendonly"] == "yes":
        fsync = config["appendfsync"]
        loss = {"always": "nothing acknowledged", "everysec": "at most the last second"}
        lost = loss.get(fsync, "what the OS had not yet flushed")
        return f"AOF on (appendfsync {fsync}): a crash loses {lost}"
    if config["save"].strip():
        return (
            f"RDB snapshots only (save {config['save']}): a crash loses the writes since the last"
            " snapshot; appendonly yes keeps them"
        )
    return (
        "WARNING: AOF off and no RDB save schedule: a restart of this Redis loses every queued"
        " job, upload and lease it acknowledged (appendonly yes, appendfsync everysec;"
        " docker/compose.yaml)"
    )


def _eviction_line(config: dict[str, str]) -> str:
    policy = config["maxmemory-policy"]
    limit = "no limit" if config["maxmemory"] in ("", "0") else f"{config['maxmemory']} bytes"
    if policy == "noeviction":
        return f"maxmemory-policy noeviction ({limit}): a full Redis refuses writes, drops nothing"
    return (
        f"WARNING: maxmemory-policy {policy} ({limit}): when full, this Redis may evict queued"
        " jobs, leases or results; set maxmemory-policy noeviction"
    )


def _cache_line(settings: Settings, info: DeviceInfo) -> str:
    """The warm-switch settings, and whether this worker would read the next job's model ahead."""
    resident = settings.max_resident or "no limit but memory"
    off = off_reason(settings, info)
    ahead = "read ahead on" if off is None else f"read ahead off ({off})"
    return f"RAM {settings.ram_cache_gb:g} GB, on the device {resident}; {ahead}"


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
