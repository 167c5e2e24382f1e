"""bench/gpu_check.py --dry-run on CPU: the real-architecture configs build (shrunk), every
rung of every family (FLUX.1 and Qwen-Image too) renders through kiln's renderer, their published
step caches run against none at the same seeds, float8 is
reported skipped on the CPU while int8 shrinks the FLUX.1 and Qwen-Image transformers, int8
shrinks SDXL's text encoder and SD3's T5, the drilled OOM is survived, the profile comparison
says it had no GPU to compare, and the controls section times each family's published ControlNet
layout against no control, RealESRGAN x4plus's architecture at three sizes and a hires pass
against a direct render. The video section reports Wan2.2-TI2V-5B's real-size parameters and is
skipped for want of a CUDA device, or with --video-on-cpu renders the shrunk model at every rung
at two sizes. A run cut down by --families, --sections and --rungs does only that, and the
checkpoint shelf deletes the least recently used others when the disk is short."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from api_client.schema import RUNGS  # every rung, partial included
from tests.conftest import ROOT

FAMILIES = ("flux", "qwenimage", "sd15", "sdxl", "sd3")
# worker.pipelines.quantize.unsupported_reason on a CPU
NO_FLOAT8 = "float8 needs a CUDA or ROCm device (torchao kernels); this is cpu"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), done.stdout


@pytest.mark.slow
def test_dry_run_passes_on_cpu(dry_run: tuple[dict, str]) -> None:
    report, stdout = dry_run
    assert report["dry_run"] and report["finished"] and not report["failures"]
    assert "PASS" in stdout
    assert set(report["build_s"]) == set(FAMILIES) and not report["evicted"]
    assert report["profile"] == {"skipped": "no GPU: nothing to compare a profile with"}


@pytest.mark.slow
def test_every_family_renders_at_every_rung(dry_run: tuple[dict, str]) -> None:
    report, _ = dry_run
    cases = {(row["case"].split("@")[0], row["rung"]) for row in report["rungs"]}
    assert cases == {(f, r) for f in FAMILIES for r in RUNGS}
    for row in report["rungs"]:
        assert row["warm"]["rung"] == row["rung"] and row["warm"]["timings"]["denoise"] > 0
        assert row["claimed_gb"] > 0 and row["denoiser"]["weight_bytes"] > 0


@pytest.mark.slow
def test_new_families_plan_with_their_published_manifests(dry_run: tuple[dict, str]) -> None:
    from api_client.manifest import load_manifest_file

    report, _ = dry_run
    for family, file in (("flux", "flux1-dev.yaml"), ("qwenimage", "qwen-image.yaml")):
        published = load_manifest_file(ROOT / "manifests" / file)
        claims = report["claims"][family]
        assert claims["from"] == f"manifests/{file}"
        assert claims["min_vram_gb"] == published.min_vram_gb
        assert claims["rung_vram_gb"] == published.rung_vram_gb
        assert claims["component_gb"] == published.component_gb
        full = next(r for r in report["rungs"] if r["case"] == f"{family}@128 full")
        assert full["claimed_gb"] == published.min_vram_gb


@pytest.mark.slow
def test_float8_is_skipped_on_cpu_and_int8_shrinks_the_transformers(
    dry_run: tuple[dict, str],
) -> None:
    report, _ = dry_run
    for family in ("flux", "qwenimage"):
        figures = report["float8_int8"][family]
        base, float8, int8 = figures["unquantized"], figures["float8"], figures["int8"]
        assert figures["component"] == "transformer"
        assert float8["outcome"] == "skipped" and float8["warm_denoise_s"] is None
        (note,) = [n for n in float8["quantize"] if n["name"] == "quantize:transformer"]
        assert note["kind"] == "skipped" and NO_FLOAT8 in note["reason"]
        assert float8["weight_bytes"] == base["weight_bytes"]
        assert int8["outcome"] == "applied" and int8["weight_types"] == ["Int8Tensor"]
        assert int8["weight_bytes"] < base["weight_bytes"] and int8["warm_denoise_s"] > 0


@pytest.mark.slow
def test_the_published_step_caches_run_against_none_at_the_same_seeds(
    dry_run: tuple[dict, str],
) -> None:
    """flux1-dev's and qwen-image's step_cache, forced on at 4 steps in a dry run: three prompts,
    each uncached then cached, with PSNR and SSIM (the first card run's numbers: 28 steps)."""
    report, stdout = dry_run
    entries = {entry["case"]: entry for entry in report["step_cache"]}
    assert set(entries) == {"flux@128", "qwenimage@128"}
    for entry in entries.values():
        assert entry["threshold"] == 0.08 and entry["steps"] == 4 and len(entry["pairs"]) == 3
        assert entry["ssim"] <= 1.0 and entry["cached_denoise_s"] > 0
    assert "step_cache flux@128 threshold 0.08" in stdout


@pytest.mark.slow
def test_compile_sections_are_skipped_in_a_dry_run(dry_run: tuple[dict, str]) -> None:
    report, _ = dry_run
    assert report["compile"] == [] and report["compile_methods"] == []
    assert {line.split(":")[0] for line in report["skipped"]} == {
        "compile",
        "compile_methods flux",
        "compile_methods qwenimage",
        "video",  # a CUDA device only (test_the_video_section_*)
    }


@pytest.mark.slow
def test_sd_text_encoders_shrink_in_int8_and_the_ladder_survives_oom(
    dry_run: tuple[dict, str],
) -> None:
    report, _ = dry_run
    int8 = report["int8"]
    assert int8["int8"]["weight_types"] == ["Int8Tensor"]
    assert int8["int8"]["weight_bytes"] < int8["bf16_or_fp32"]["weight_bytes"]
    t5 = report["int8_t5"]
    assert t5["component"] == "text_encoder_3" and t5["int8"]["weight_types"] == ["Int8Tensor"]
    assert t5["int8"]["weight_bytes"] < t5["bf16_or_fp32"]["weight_bytes"]
    outcomes = [(a["rung"], a["outcome"]) for a in report["oom"]["attempts"]]
    assert outcomes == [
        ("full", "oom"),
        ("partial", "oom"),
        ("model_offload", "oom"),
        ("model_offload", "oom"),
        ("group_offload", "ok"),
    ]


@pytest.mark.slow
def test_controls_time_a_controlnet_step_the_upscaler_and_hires_against_direct(
    dry_run: tuple[dict, str],
) -> None:
    """Each family's ControlNet, in kiln's class for it, ran once a denoised step beside its
    pipeline and is timed against the plain job; the upscaler's 4x at three sides, the largest
    in tiles; the hires job's two passes against a direct render at its size, as many steps."""
    report, stdout = dry_run
    controls = report["controls"]
    entries = {entry["case"]: entry for entry in controls["controlnet"]}
    assert {case: entry["controlnet"]["class"] for case, entry in entries.items()} == {
        "sd15@128": "ControlNetModel",
        "sdxl@128": "ControlNetUnionModel",
        "flux@128": "FluxControlNetModel",
    }
    for entry in entries.values():
        plain, control = entry["none_per_step_s"], entry["controlnet"]
        assert plain > 0 and control["per_step_s"] > 0 and control["params_b"] > 0
        assert control["ratio"] == pytest.approx(control["per_step_s"] / plain, abs=0.01)
        assert control["extra_per_step_s"] == pytest.approx(control["per_step_s"] - plain, abs=1e-4)
        assert control["calls"] >= control["steps_denoised"] >= entry["steps"] * entry["rounds"]
    # an IP-Adapter's reference where the family has one (sd15, sdxl), timed the same way
    for case in ("sd15@128", "sdxl@128"):
        plain, reference = entries[case]["none_per_step_s"], entries[case]["reference"]
        assert reference["engaged"] and reference["per_step_s"] > 0
        assert reference["ratio"] == pytest.approx(reference["per_step_s"] / plain, abs=0.01)
    assert "reference" not in entries["flux@128"]
    assert "ip-adapter sd15@128" in stdout
    # the published entries it is served as, against the sizes built here
    assert entries["sdxl@128"]["controlnet"]["published_gb"] == 2.51
    assert entries["flux@128"]["controlnet"]["from"] == "manifests/flux1-dev.yaml"
    assert "published_gb" not in entries["sd15@128"]["controlnet"]
    sides = controls["upscaler"]["sides"]
    assert [(row["input"], row["output"]) for row in sides] == [
        ("32x32", "128x128"),
        ("64x64", "256x256"),
        ("128x128", "512x512"),
    ]
    assert all(row["s_per_output_mp"] > 0 and row["tile_px"] == 64 for row in sides)
    assert [row["tiles"] > 1 for row in sides] == [False, False, True]
    hires, direct = controls["hires"]["hires"], controls["hires"]["direct"]
    assert (hires["passes"], direct["passes"]) == (2, 1)
    assert hires["size"] == direct["size"] == "256x256"
    assert direct["steps_denoised"] == hires["steps_denoised"] > 2  # 2 in the first pass
    assert controls["hires"]["total_ratio"] == pytest.approx(
        hires["total_s"] / direct["total_s"], abs=0.01
    )
    assert "controlnet flux@128 FluxControlNetModel" in stdout and "hires sdxl@128" in stdout


@pytest.mark.slow  # a second dry run (16 s), as the first is: make test keeps under 12 minutes
def test_a_run_cut_down_to_one_rung_of_one_family(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "bench/gpu_check.py",
            "--dry-run",
            "--out",
            str(tmp_path),
            *("--families", "sd15", "--sections", "rungs,oom", "--rungs", "full"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["case"] for row in report["rungs"]] == ["sd15@128 full"]
    assert report["options"]["rungs"] == "full" and report["finished"]
    assert "rungs flux: flux is not in --families" in report["skipped"]
    assert "int8 text_encoder_2: int8 is not in --sections" in report["skipped"]
    assert "oom: sdxl is not in --families" in report["skipped"]
    assert "controls upscaler: controls is not in --sections" in report["skipped"]


@pytest.mark.slow
def test_the_video_section_is_reported_skipped_in_a_dry_run(dry_run: tuple[dict, str]) -> None:
    import bench.gpu_check as check

    report, stdout = dry_run
    video = report["video"]
    assert video["skipped"] == check.NO_CUDA_VIDEO and video["rows"] == []
    assert f"video: {check.NO_CUDA_VIDEO}" in report["skipped"]
    assert "wan" not in report["build_s"]  # nothing built for it
    assert "video wan2.2-ti2v-5b parameters (B)" in stdout


def test_the_video_section_builds_the_real_configs_and_is_skipped_on_a_cpu(
    tmp_path: Path,
) -> None:
    """On the meta device (no memory): Wan2.2-TI2V-5B's transformer, VAE and UMT5 as configured
    come to wan2.2-ti2v-5b.yaml's component_gb at two bytes a parameter; nothing renders."""
    import bench.gpu_check as check
    from api_client.manifest import load_manifest_file
    from worker.settings import Settings

    args = check._parser().parse_args(["--dry-run", "--out", str(tmp_path)])
    report = check.Report(device="cpu", dry_run=True)
    shelf = check.Shelf(report, tmp_path / "models", dry_run=True, cuda=False)
    run = check.Run(report, Settings(models_dir=tmp_path / "models"), shelf, args)
    check._check_video(run)
    video = report.video
    assert video["skipped"] == check.NO_CUDA_VIDEO and video["rows"] == []
    assert report.skipped == [f"video: {check.NO_CUDA_VIDEO}"] and not report.failures
    published = load_manifest_file(ROOT / "manifests" / "wan2.2-ti2v-5b.yaml").component_gb
    assert set(video["params_b"]) == set(published) == {"transformer", "text_encoder", "vae"}
    for name, billions in video["params_b"].items():
        assert 2 * billions == pytest.approx(published[name], rel=0.005), name
    assert not (tmp_path / "models").exists()


@pytest.mark.slow  # ~50 s: four rungs, two sizes, a cold and a warm 9-frame job each
def test_the_video_section_renders_every_rung_at_both_sizes_with_video_on_cpu(
    tmp_path: Path,
) -> None:
    import bench.gpu_check as check
    from api_client.manifest import load_manifest_file

    done = subprocess.run(
        [
            sys.executable,
            "bench/gpu_check.py",
            *("--dry-run", "--video-on-cpu", "--out", str(tmp_path)),
            *("--families", "wan", "--sections", "video"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    video = report["video"]
    assert video["skipped"] is None and not report["failures"]
    assert (video["frames"], video["steps"], video["sizes"]) == (9, 2, ["64x64", "96x64"])
    rows = {(row["rung"], row["size"]): row for row in video["rows"]}
    assert set(rows) == {(rung, size) for rung in RUNGS for size in ("64x64", "96x64")}
    published = load_manifest_file(ROOT / "manifests" / "wan2.2-ti2v-5b.yaml")
    for (rung, _), row in rows.items():
        warm = row["warm"]
        assert warm["rung"] == rung and warm["frames"] == row["frames"] == 9
        assert row["per_step_s"] > 0 and row["peak_mb"] > 0
        assert warm["timings"]["video_encode"] > 0 and warm["timings"]["image_encode"] == 0
        want = published.min_vram_gb if rung == "full" else published.rung_vram_gb.get(rung)
        if want is not None:  # partial's is derived from full's
            assert row["claimed_gb"] == want
    assert report["build_s"].keys() == {"wan"}
    assert "video full" in done.stdout and check.NO_CUDA_VIDEO not in done.stdout


def test_shelf_deletes_the_least_recently_used_checkpoint_when_the_disk_is_short(
    tmp_path: Path,
) -> None:
    import bench.gpu_check as check

    sd15, sdxl, sd3 = check.CASES
    room = {"rule": "plenty"}

    def free_bytes(_: Path) -> int:
        if room["rule"] == "none":
            return 0
        if room["rule"] == "once sdxl is gone" and (tmp_path / "check-sdxl").exists():
            return 0
        return 10**12

    report = check.Report(device="cpu", dry_run=True)
    shelf = check.Shelf(report, tmp_path, dry_run=True, cuda=False, free_bytes=free_bytes)
    shelf.get(sd15)
    shelf.get(sdxl)
    assert shelf.get(sd15).source == "check-sd15"  # on disk already: now the most recently used
    room["rule"] = "once sdxl is gone"
    shelf.get(sd3)
    assert report.evicted == ["sdxl: deleted to make room for sd3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check-sd15", "check-sd3"]
    room["rule"] = "none"
    with pytest.raises(check.NoRoom, match="sdxl's checkpoint needs"):
        shelf.get(sdxl)
    assert report.evicted[1:] == [
        "sd15: deleted to make room for sdxl",
        "sd3: deleted to make room for sdxl",
    ]
    assert list(tmp_path.iterdir()) == []
