"""GPU acceptance check: random-weight pipelines with the real SD1.5, SDXL and SD3.5-medium
architectures (bench/configs, never downloaded) through kiln's own renderer and ladder.

Reports per-phase timings and peak memory at each rung, the compile speedup after warm-up, the
int8 memory drop (SDXL's text_encoder_2, SD3's T5), a real out-of-memory
(torch.cuda.set_per_process_memory_fraction) that the ladder survives, and the card against
kiln's device profile of it (memory, native bf16, fp8, compute capability). Runs offline on an
NVIDIA GPU:

    python bench/gpu_check.py [--out DIR]
    python bench/gpu_check.py --dry-run      # CPU, shrunken configs, drilled OOM: under a minute
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the path fix so `python bench/gpu_check.py` finds kiln

from api_client.manifest import Manifest  # noqa: E402
from api_client.schema import RUNGS  # noqa: E402
from worker.context import LocalContext  # noqa: E402
from worker.faults import FaultPlan  # noqa: E402
from worker.loading import load_pipeline  # noqa: E402
from worker.quantize import weight_summary  # noqa: E402
from worker.render import Renderer  # noqa: E402
from worker.settings import Settings  # noqa: E402
from worker.timings import TimingRecord  # noqa: E402

CONFIGS = ROOT / "bench" / "configs"
MB = 1e6

# Dry-run shrinks every width and depth so a CPU builds and renders each case in seconds, while
# keeping the block layout (down/up block types, SDXL's text_time conditioning) of the real thing.
_SMALL_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "projection_dim": 32,
}
_SMALL_VAE = {"block_out_channels": [8, 16, 16, 16], "norm_num_groups": 8, "layers_per_block": 1}
DRY_RUN: dict[str, dict[str, dict[str, Any]]] = {
    "sd15": {
        "unet": {
            "block_out_channels": [32, 32, 64, 64],
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "cross_attention_dim": 32,
            "sample_size": 16,
        },
        "text_encoder": _SMALL_CLIP,
        "vae": _SMALL_VAE,
    },
    "sdxl": {
        "unet": {
            "block_out_channels": [32, 64, 64],
            "attention_head_dim": [2, 4, 4],
            "transformer_layers_per_block": [1, 1, 2],
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "cross_attention_dim": 64,
            "addition_time_embed_dim": 8,
            # six micro-conditioning ids x 8 plus text_encoder_2's 32-wide projection
            "projection_class_embeddings_input_dim": 80,
            "sample_size": 16,
        },
        "text_encoder": _SMALL_CLIP,
        "text_encoder_2": _SMALL_CLIP,
        "vae": _SMALL_VAE,
    },
    "sd3": {
        "transformer": {
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "num_layers": 2,
            "dual_attention_layers": [0],
            # T5's width; the two CLIPs' 32 + 32 are zero-padded up to it
            "joint_attention_dim": 64,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 64,  # the two CLIP projections, concatenated
            "pos_embed_max_size": 32,
            "sample_size": 16,
        },
        "text_encoder": _SMALL_CLIP,
        "text_encoder_2": _SMALL_CLIP,
        "text_encoder_3": {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2},
        "vae": _SMALL_VAE,
    },
}


@dataclass(frozen=True)
class Case:
    family: str
    size: int
    min_vram_gb: float  # measured-style estimates for full residency in 16-bit
    rung_vram_gb: dict[str, float]
    quantize: dict[str, str] = field(default_factory=dict)


CASES = (
    Case("sd15", 512, 4.0, {"model_offload": 2.5, "group_offload": 1.0}),
    Case("sdxl", 1024, 10.0, {"model_offload": 6.0, "group_offload": 3.0}),
    # sd35-medium's manifest: T5-XXL in int8, compiled at full.
    Case(
        "sd3",
        1024,
        14.0,
        {"model_offload": 12.5, "group_offload": 3.0},
        {"text_encoder_3": "int8"},
    ),
)


@dataclass
class Report:
    device: str
    dry_run: bool
    build_s: dict[str, float] = field(default_factory=dict)
    rungs: list[dict[str, Any]] = field(default_factory=list)
    compile: list[dict[str, Any]] = field(default_factory=list)
    int8: dict[str, Any] = field(default_factory=dict)
    int8_t5: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    oom: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    total_s: float = 0.0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    _quiet()
    cuda = torch.cuda.is_available() and not args.dry_run
    report = Report(device=torch.cuda.get_device_name(0) if cuda else "cpu", dry_run=args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    try:
        settings = Settings(
            models_dir=work / "models",
            manifests=work / "manifests",
            output_dir=work / "out",
            timings_log=work / "out" / "timings.jsonl",
            device="cuda" if cuda else "cpu",
            **({"inductor_cache_dir": args.out / "inductor"} if args.dry_run else {}),
        )
        steps = 2 if args.dry_run else args.steps
        manifests = {}
        for case in CASES:
            t0 = time.perf_counter()
            manifests[case.family] = _build(case, settings.models_dir, args.dry_run, cuda)
            report.build_s[case.family] = round(time.perf_counter() - t0, 2)

        def left() -> float:
            return args.time_budget_s - (time.perf_counter() - started)

        for case in CASES:
            _check_rungs(report, settings, manifests[case.family], case, steps, args.dry_run, left)
        _check_compile(report, settings, manifests, steps, args, left)
        _check_profile(report, settings, cuda)
        report.int8 = _check_int8(report, settings, manifests["sdxl"], "text_encoder_2", cuda)
        report.int8_t5 = _check_int8(report, settings, manifests["sd3"], "text_encoder_3", cuda)
        _check_oom(report, settings, manifests["sdxl"], steps, args.dry_run, cuda)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.total_s = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    _print(report, args.out / "gpu_check.json")
    return 1 if report.failures else 0


def _quiet() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, shrunken configs, drilled OOM")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "out", help="where gpu_check.json goes"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="denoising steps per job (default 10)"
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=420.0,
        help="later sections are skipped (and reported) past this many seconds",
    )
    parser.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="also run the compile section in a dry run (minutes on CPU)",
    )
    return parser


# 1. Random-weight pipelines from the configs, saved like any diffusers model


def _build(case: Case, models_dir: Path, dry_run: bool, cuda: bool) -> Manifest:
    import diffusers
    import transformers

    # the same offline tokenizers as the tiny models
    from worker.tiny import _clip_tokenizer, _t5_tokenizer

    directory = CONFIGS / case.family
    shrink = DRY_RUN[case.family] if dry_run else {}
    tokenizer = _clip_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    components: dict[str, Any] = {}
    # Weights are initialised where they will run: an SDXL UNet is 2.6 B parameters.
    with torch.device("cuda" if cuda else "cpu"):
        for config_file in sorted(directory.glob("*.json")):
            name = config_file.stem
            config = json.loads(config_file.read_text())
            class_name = config.pop("_class_name")
            config.update(shrink.get(name, {}))
            if name == "scheduler":
                components[name] = getattr(diffusers, class_name).from_config(config)
            elif name == "text_encoder_3":
                t5_ids = {
                    "pad_token_id": t5_tokenizer.pad_token_id,
                    "eos_token_id": t5_tokenizer.eos_token_id,
                    "decoder_start_token_id": t5_tokenizer.pad_token_id,
                }
                t5_config = transformers.T5Config(**config, **t5_ids)
                components[name] = transformers.T5EncoderModel(t5_config)
            elif name.startswith("text_encoder"):
                model_cls = getattr(transformers, class_name)
                components[name] = model_cls(transformers.CLIPTextConfig(**config, **ids))
            else:
                components[name] = getattr(diffusers, class_name).from_config(config)
    # sd3 overflows in fp16; kiln casts at load to the dtype it chooses anyway.
    dtype = (torch.bfloat16 if case.family == "sd3" else torch.float16) if cuda else torch.float32
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.to(dtype=dtype).eval()
    if case.family == "sd15":
        pipe: Any = diffusers.StableDiffusionPipeline(
            tokenizer=tokenizer,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
            **components,
        )
    elif case.family == "sdxl":
        pipe = diffusers.StableDiffusionXLPipeline(
            tokenizer=tokenizer, tokenizer_2=_clip_tokenizer(), add_watermarker=False, **components
        )
    else:
        pipe = diffusers.StableDiffusion3Pipeline(
            tokenizer=tokenizer,
            tokenizer_2=_clip_tokenizer(),
            tokenizer_3=t5_tokenizer,
            **components,
        )
    target = models_dir / f"check-{case.family}"
    pipe.save_pretrained(target, safe_serialization=True)
    del pipe, components
    if cuda:
        torch.cuda.empty_cache()
    size = 128 if dry_run else case.size
    return Manifest(
        id=f"check-{case.family}",
        family=case.family,
        source=target.name,  # type: ignore[arg-type]
        steps={"default": 10, "max": 50},
        guidance={"default": 5.0, "max": 10.0},  # type: ignore[arg-type]
        resolutions=[(size, size)],
        min_vram_gb=case.min_vram_gb,
        rung_vram_gb=case.rung_vram_gb,  # type: ignore[arg-type]
        quantize=case.quantize,  # type: ignore[arg-type]
    )


# 2. Each rung: a cold job (load, cache fill) then a warm one, timed by kiln's own stopwatch


class _RecordingRenderer(Renderer):
    """A renderer for one manifest that keeps every timing record it hands to its listener."""

    def __init__(self, settings: Settings, manifest: Manifest) -> None:
        self.records: list[TimingRecord] = []
        super().__init__(settings, {manifest.id: manifest}, on_record=self.records.append)


def _job(renderer: _RecordingRenderer, manifest: Manifest, steps: int, tag: str) -> dict[str, Any]:
    size = manifest.default_size
    payload = {
        "model": manifest.id,
        "prompt": "a lighthouse on a cliff at dusk",
        "steps": steps,
        "width": size[0],
        "height": size[1],
        "seed": 1,
    }
    result = renderer.render(payload, LocalContext(job_id=f"{manifest.id}-{tag}-{time.time_ns()}"))
    record = renderer.records[-1]
    return {
        "rung": result.rung,
        "attempts": [a.model_dump(exclude_none=True) for a in result.attempts],
        "timings": {k: round(v, 4) for k, v in result.timings.model_dump().items()},
        "per_step_s": round(record.per_step_s or 0.0, 4),
        "peak_mb": round((record.peak_memory_bytes or 0) / MB, 1),
        "compiled": result.compiled,
        "recompiles": record.recompiles,
    }


def _check_rungs(
    report: Report,
    settings: Settings,
    manifest: Manifest,
    case: Case,
    steps: int,
    dry_run: bool,
    left: Any,
) -> None:
    for rung in RUNGS:
        label = f"{case.family}@{manifest.default_size[0]} {rung}"
        if left() < 60:
            report.skipped.append(f"rung {label}: time budget spent")
            continue
        pinned = settings.model_copy(update={"memory_mode": rung, "compile": "off"})
        renderer = _RecordingRenderer(pinned, manifest)
        try:
            cold = _job(renderer, manifest, steps, "cold")
            warm = _job(renderer, manifest, steps, "warm")
        except Exception as exc:  # a rung that cannot render is the failure this check exists for
            report.failures.append(f"rung {label}: {type(exc).__name__}: {exc}")
            continue
        finally:
            for model_id in renderer.cache.model_ids():
                renderer.cache.evict(model_id)
        report.rungs.append(
            {
                "case": label,
                "rung": rung,
                "load_s": cold["timings"]["load"],
                "cold": cold,
                "warm": warm,
            }
        )
        if warm["rung"] != rung:
            report.failures.append(f"rung {label}: rendered at {warm['rung']}")


# 3. Compile at full: speedup of warm denoise over the eager warm job of the same case


def _check_compile(
    report: Report,
    settings: Settings,
    manifests: dict[str, Manifest],
    steps: int,
    args: argparse.Namespace,
    left: Any,
) -> None:
    if args.dry_run and not args.compile_on_cpu:
        report.skipped.append(
            "compile: dry run on CPU (Inductor takes minutes here); --compile-on-cpu"
        )
        return
    for case in CASES:
        manifest = manifests[case.family]
        label = f"{case.family}@{manifest.default_size[0]}"
        if left() < 150:
            report.skipped.append(f"compile {label}: time budget spent")
            continue
        eager = next((r["warm"] for r in report.rungs if r["case"] == f"{label} full"), None)
        renderer = _RecordingRenderer(
            settings.model_copy(update={"memory_mode": "full", "compile": "on"}), manifest
        )
        try:
            cold = _job(renderer, manifest, steps, "compile-cold")
            warm = [_job(renderer, manifest, steps, f"compile-warm{i}") for i in range(2)]
        except Exception as exc:
            report.failures.append(f"compile {label}: {type(exc).__name__}: {exc}")
            continue
        finally:
            for model_id in renderer.cache.model_ids():
                renderer.cache.evict(model_id)
        best = min(w["timings"]["denoise"] for w in warm)
        entry = {
            "case": label,
            "compiled": cold["compiled"],
            "cold_denoise_s": cold["timings"]["denoise"],
            "warm_denoise_s": best,
            "recompiles_after_warmup": warm[-1]["recompiles"],
        }
        if eager is not None and best > 0:
            entry["eager_warm_denoise_s"] = eager["timings"]["denoise"]
            entry["speedup"] = round(eager["timings"]["denoise"] / best, 2)
        report.compile.append(entry)
        if not cold["compiled"]:
            report.failures.append(f"compile {label}: did not compile")


# 4. int8 of a big text encoder (SDXL's second CLIP, SD3's T5): weight bytes and device memory


def _check_int8(
    report: Report, settings: Settings, manifest: Manifest, component: str, cuda: bool
) -> dict[str, Any]:
    from worker.device import probe

    info = probe(settings)
    figures: dict[str, Any] = {"component": component}
    for label, quantize in (("bf16_or_fp32", {}), ("int8", {component: "int8"})):
        variant = manifest.model_copy(update={"quantize": quantize})
        if cuda:
            torch.cuda.empty_cache()
        loaded = load_pipeline(variant, "full", info, settings, FaultPlan())
        kinds, weight_bytes = weight_summary(getattr(loaded.pipe, component))
        figures[label] = {
            "weight_types": sorted(kinds),
            "weight_bytes": weight_bytes,
            "weight_mb": round(weight_bytes / MB, 3),
            "pipeline_device_mb": round(loaded.device_bytes / MB, 1),
            "report": [
                n.model_dump() for n in loaded.settings.applied if n.name.startswith("quantize")
            ],
        }
        loaded.pipe = None
        del loaded
        import gc

        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    before, after = figures["bf16_or_fp32"]["weight_bytes"], figures["int8"]["weight_bytes"]
    figures["weight_drop_mb"] = round((before - after) / MB, 3)
    figures["device_drop_mb"] = round(
        figures["bf16_or_fp32"]["pipeline_device_mb"] - figures["int8"]["pipeline_device_mb"], 1
    )
    if figures["int8"]["weight_types"] != ["Int8Tensor"] or after >= before:
        report.failures.append(f"int8 {component}: weights did not shrink: {before} -> {after}")
    return figures


# 5. The card against kiln's profile of it: what KILN_DEVICE_PROFILE decides with is what it has


def _check_profile(report: Report, settings: Settings, cuda: bool) -> None:
    from worker.device import probe_real
    from worker.profiles import GIB, PROFILES, profile_for

    if not cuda:
        report.profile = {"skipped": "no GPU: nothing to compare a profile with"}
        return
    info = probe_real(settings)
    name = profile_for(info.name)
    reported = {
        "card": info.name,
        "backend": info.backend,
        "total_gib": round(info.total_bytes / GIB, 2),
        "free_gib": round(info.free_bytes / GIB, 2),
        "bf16": info.bf16,
        "fp8": info.fp8,
        "capability": list(info.capability or ()),
    }
    if name is None:
        report.profile = {"reported": reported, "profile": None}
        report.skipped.append(f"profile: no kiln profile for {info.name}")
        return
    p = PROFILES[name]
    profiled = {
        "backend": p.backend,
        "total_gib": p.total_gib,
        "free_gib": round(p.free_gib, 2),
        "bf16": p.bf16,
        "fp8": p.fp8,
        "capability": list(p.capability or ()),
    }
    report.profile = {"profile": name, "reported": reported, "profiled": profiled}
    for key in ("backend", "bf16", "fp8", "capability"):
        if reported[key] != profiled[key]:
            report.failures.append(
                f"profile {name}: {key} {profiled[key]} but the card says {reported[key]}"
            )
    # Datasheet memory vs what the driver reports: within 10 % (a T4's 16 GB shows as about
    # 15 GiB, less with ECC on: the driver keeps the rest), else the profile is wrong.
    if abs(reported["total_gib"] - p.total_gib) > 0.10 * p.total_gib:
        report.failures.append(
            f"profile {name}: total {p.total_gib} GiB but the card reports {reported['total_gib']}"
        )


# 6. A real OOM: cap this process's share of the card below SDXL's full-rung need


def _check_oom(
    report: Report, settings: Settings, manifest: Manifest, steps: int, dry_run: bool, cuda: bool
) -> None:
    auto = settings.model_copy(update={"memory_mode": "auto", "compile": "off"})
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        # 16-bit SDXL is ~7 GB of weights (UNet 5.1 GB): full cannot load and model_offload
        # cannot hold the UNet, so the ladder must walk down to group_offload.
        cap_gb = 4.0
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap_gb * 1e9 / total, 0)
        how = f"real: set_per_process_memory_fraction to {cap_gb} GB of {total / 1e9:.0f} GB"
    else:
        # No allocator cap on CPU: drill the same sequence with KILN_FAULTS.
        auto = auto.model_copy(update={"faults": "oom@load:full,oom@denoise:model_offload*2"})
        how = "drilled: KILN_FAULTS=oom@load:full,oom@denoise:model_offload*2 (no GPU)"
    renderer = _RecordingRenderer(auto, manifest)
    try:
        job = _job(renderer, manifest, steps, "oom")
        report.oom = {"how": how, **job}
        if job["rung"] == "full" or not any(a["outcome"] == "oom" for a in job["attempts"]):
            report.failures.append(f"oom: no out-of-memory happened ({job['attempts']})")
    except Exception as exc:
        records = renderer.records
        attempts = (
            [a.model_dump(exclude_none=True) for a in records[-1].attempts] if records else []
        )
        report.oom = {"how": how, "error": f"{type(exc).__name__}: {exc}", "attempts": attempts}
        report.failures.append(f"oom: the ladder did not survive: {exc}")
    finally:
        for model_id in renderer.cache.model_ids():
            renderer.cache.evict(model_id)
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)


def _print(report: Report, path: Path) -> None:
    print(f"kiln gpu check on {report.device}{' (dry run)' if report.dry_run else ''}")
    print(f"  built: {report.build_s} s")
    for row in report.rungs:
        t = row["warm"]["timings"]
        print(
            f"  {row['case']:<28} load {row['load_s']:.2f}s  encode {t['text_encode']:.3f}"
            f"  denoise {t['denoise']:.3f}  decode {t['decode']:.3f}  total {t['total']:.3f}"
            f"  peak {row['warm']['peak_mb']:.0f} MB"
        )
    for entry in report.compile:
        print(
            f"  compile {entry['case']}: cold {entry['cold_denoise_s']:.2f}s,"
            f" warm {entry['warm_denoise_s']:.3f}s,"
            f" speedup {entry.get('speedup', '?')}x, recompiles {entry['recompiles_after_warmup']}"
        )
    for i in (report.int8, report.int8_t5):
        if i:
            print(
                f"  int8 {i['component']}: {i['bf16_or_fp32']['weight_mb']} MB"
                f" -> {i['int8']['weight_mb']} MB"
                f" weights; device drop {i['device_drop_mb']} MB"
            )
    if report.profile:
        print(f"  profile: {report.profile}")
    if report.oom:
        print(f"  oom ({report.oom['how']}): attempts {report.oom.get('attempts')}")
    for line in report.skipped:
        print(f"  skipped: {line}")
    for line in report.failures:
        print(f"  FAILED: {line}")
    print(f"  {'FAIL' if report.failures else 'PASS'} in {report.total_s} s; details in {path}")


if __name__ == "__main__":
    sys.exit(main())
