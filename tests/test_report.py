"""`kiln timings`, `kiln bench` and `kiln profile` on real records from the tiny pipelines."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from api_client.schema import Timings
from tests.conftest import kiln
from worker.report import percentile, summarize
from worker.timings import FitTracker, TimingRecord, linear_fit


def _record(model: str, total: float, cold: bool = False, status: str = "done") -> TimingRecord:
    return TimingRecord(
        job_id=f"j{total}",
        model=model,
        status=status,
        cold=cold,  # type: ignore[arg-type]
        timings=Timings(denoise=total * 0.8, total=total),
        steps=8,
    )


def test_summary_excludes_cold_and_failed_runs_and_measures_drift() -> None:
    records = [_record("a", 100.0, cold=True), _record("a", 9.0, status="failed")]
    records += [_record("a", 1.0 + i * 0.01) for i in range(10)] + [
        _record("a", 2.0 + i * 0.01) for i in range(10)
    ]
    # A job answered from disk after a crash rendered nothing: no steady-state sample.
    from_disk = TimingRecord(
        job_id="disk", model="a", status="done", timings=Timings(total=0.01), steps=8
    )
    assert not from_disk.steady and FitTracker().add(from_disk) is None
    records.append(from_disk)
    [summary] = summarize(records, window=10)
    assert summary.jobs == 20 and summary.cold == 1 and summary.failed == 1
    assert summary.phases["total"].median < 100
    assert summary.drift is not None and 1.9 < summary.drift < 2.1


def test_percentile_and_fit() -> None:
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9
    assert percentile([5.0], 90) == 5.0
    fixed, per_step = linear_fit([(10, 8.218), (20, 15.719), (10, 8.218)]) or (0, 0)
    assert abs(fixed - 0.717) < 1e-3 and abs(per_step - 0.75) < 1e-4
    assert linear_fit([(8, 1.0), (8, 1.1)]) is None


def test_timings_verb_reads_the_log_writes_csv_and_chart(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    log = tmp_path / "t.jsonl"
    records = [_record("tiny-sd15", 0.2 + i / 100, cold=i == 0) for i in range(6)]
    log.write_text("".join(r.model_dump_json() + "\n" for r in records) + "{not json\n")
    done = kiln(
        "timings",
        str(log),
        "--csv",
        str(tmp_path / "t.csv"),
        "--chart",
        str(tmp_path / "t.png"),
        "--last",
        "3",
        env=kiln_env,
    )
    assert done.returncode == 0, done.stderr
    assert "tiny-sd15" in done.stdout and "median / p90" in done.stdout
    with open(tmp_path / "t.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 and rows[0]["model"] == "tiny-sd15"
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert kiln("timings", str(tmp_path / "missing.jsonl"), env=kiln_env).returncode == 1


def test_bench_runs_a_matrix_in_process_and_compares_rungs(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps({"prompts": [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]}))
    matrix = tmp_path / "matrix.json"
    matrix.write_text(
        json.dumps(
            {
                "cells": [
                    {"model": "tiny-sd15", "steps": [2, 4], "sizes": [[128, 128]]},
                    {
                        "model": "tiny-sd15",
                        "steps": [2],
                        "sizes": [[128, 128]],
                        "settings": {"memory_mode": "model_offload"},
                    },
                ]
            }
        )
    )
    out = tmp_path / "out"
    done = kiln(
        "bench",
        "--suite",
        str(suite),
        "--matrix",
        str(matrix),
        "--out",
        str(out),
        env=kiln_env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "memory_mode=model_offload" in done.stdout and "linear fit" in done.stdout
    lines = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert len(lines) == 9
    assert {line["rung"] for line in lines} == {"full", "model_offload"}
    assert (out / "phases.png").is_file() and (out / "timings.csv").is_file()


def test_profile_writes_a_trace_with_kiln_phases(
    tmp_path: Path, kiln_env: dict[str, str], settings: Any
) -> None:
    trace = tmp_path / "trace.json"
    done = kiln(
        "profile",
        "--model",
        "tiny-sd3",
        "--steps",
        "2",
        "--trace",
        str(trace),
        env=kiln_env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "kiln.denoise" in done.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "kiln.decode" for e in events)


def test_bench_names_the_file_and_field_of_a_bad_matrix(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    matrix = tmp_path / "m.json"
    matrix.write_text(
        json.dumps({"cells": [{"model": "tiny-sd15", "steps": [], "sizes": [[128, 128]]}]})
    )
    done = kiln("bench", "--matrix", str(matrix), env=kiln_env)
    assert done.returncode == 2
    assert f"{matrix}: cells.0.steps" in done.stdout
    missing = kiln("bench", "--suite", str(tmp_path / "none.json"), env=kiln_env)
    assert missing.returncode == 2 and "none.json: cannot read" in missing.stdout


def test_profile_refuses_a_bad_request_before_loading(kiln_env: dict[str, str]) -> None:
    done = kiln("profile", "--model", "tiny-sd15", "--steps", "999", env=kiln_env)
    assert done.returncode == 2 and "steps=999" in done.stderr and "Traceback" not in done.stderr
    unknown = kiln("profile", "--model", "nope", env=kiln_env)
    assert unknown.returncode == 2 and "nope" in unknown.stderr and "no manifest" in unknown.stderr
