"""bench/gpu_check.py --dry-run on CPU: the real-architecture configs build (shrunk), every
rung renders through kiln's renderer, int8 shrinks SDXL's text encoder and SD3's T5, the drilled
OOM is survived, and the profile comparison says it had no GPU to compare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_gpu_check_dry_run_passes_on_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and not report["failures"]
    cases = {(row["case"].split("@")[0], row["rung"]) for row in report["rungs"]}
    assert cases == {
        (f, r) for f in ("sd15", "sdxl", "sd3") for r in ("full", "model_offload", "group_offload")
    }
    for row in report["rungs"]:
        assert row["warm"]["rung"] == row["rung"] and row["warm"]["timings"]["denoise"] > 0
    int8 = report["int8"]
    assert int8["int8"]["weight_types"] == ["Int8Tensor"]
    assert int8["int8"]["weight_bytes"] < int8["bf16_or_fp32"]["weight_bytes"]
    t5 = report["int8_t5"]
    assert t5["component"] == "text_encoder_3" and t5["int8"]["weight_types"] == ["Int8Tensor"]
    assert t5["int8"]["weight_bytes"] < t5["bf16_or_fp32"]["weight_bytes"]
    assert report["profile"] == {"skipped": "no GPU: nothing to compare a profile with"}
    outcomes = [(a["rung"], a["outcome"]) for a in report["oom"]["attempts"]]
    assert outcomes == [
        ("full", "oom"),
        ("model_offload", "oom"),
        ("model_offload", "oom"),
        ("group_offload", "ok"),
    ]
    assert "PASS" in done.stdout
