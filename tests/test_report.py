"""`kiln timings`, `kiln bench` and `kiln profile` on real records from the tiny pipelines."""

from __future__ import annotations

import csv
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from api_client.schema import Attempt, ImageFile, SettingsReport, Timings
from tests.conftest import kiln
from worker.ops.report import percentile, summarize
from worker.render.timings import RESULT_FIELDS, FitTracker, TimingRecord, linear_fit


def _record(model: str, total: float, cold: bool = False, status: str = "done") -> TimingRecord:
    return TimingRecord(
        job_id=f"j{total}",
        model=model,
        status=status,
        cold=cold,  # type: ignore[arg-type]
        timings=Timings(denoise=total * 0.8, total=total),
        steps=8,
    )


def test_a_result_is_its_records_and_a_stored_result_gives_the_record_back() -> None:
    """The fields a record and a result share are named once (RESULT_FIELDS): a render's result
    is built from its record and the record of a job answered from the store from its result,
    each field with the same value, none dropped, and each its own finished_at."""
    settings = SettingsReport()
    settings.add("applied", "vae_tiling", "off full")
    record = TimingRecord(
        job_id="j1",
        model="tiny-sd15",
        status="done",
        timings=Timings(load=0.5, denoise=1.0, total=2.0),
        seed=7,
        steps=4,
        guidance=7.5,
        true_cfg=None,
        width=128,
        height=96,
        num_images=2,
        rung="model_offload",
        device="cpu",
        simulated_device="a10g",
        dtype="fp32",
        compiled=False,
        quantized={"unet": "int8wo"},
        attempts=[Attempt(rung="full", outcome="oom", phase="denoise")],
        settings=settings,
        worker="w1",
    )
    image = ImageFile(path="/out/j1/0.png", width=128, height=96, format="png", sha256="0" * 64)
    started = datetime(2026, 1, 1, tzinfo=timezone.utc)
    result = record.result([image, image], started, "d" * 64)
    both = set(type(record).model_fields) & set(type(result).model_fields)
    assert set(RESULT_FIELDS) == both - {"finished_at"}
    assert {name: getattr(result, name) for name in RESULT_FIELDS} == {
        name: getattr(record, name) for name in RESULT_FIELDS
    }
    assert result.started_at == started and result.request_sha256 == "d" * 64
    assert result.attempts is not record.attempts  # the result keeps its own list
    stored = result.model_copy(update={"finished_at": started})  # as read from result.json
    again = TimingRecord.from_result(stored, answered_by="w2")
    assert again.worker == "w2" and again.rendered_by == "w1" and again.answered_from == "store"
    assert again.num_images == 2 and again.status == "done"
    shared = [name for name in RESULT_FIELDS if name != "worker"]
    assert {n: getattr(again, n) for n in shared} == {n: getattr(record, n) for n in shared}
    assert again.finished_at > started  # the record's own clock, not the render's


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
    records[0] = records[0].model_copy(update={"compile_s": 2.5, "compile_source": "fleet"})
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
    compile_columns = [(r["compile_s"], r["compile_source"]) for r in rows]
    assert compile_columns == [("2.5", "fleet")] + [("0.0", "")] * 5
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert kiln("timings", str(tmp_path / "missing.jsonl"), env=kiln_env).returncode == 1


@pytest.mark.slow  # 32 s of renders: make test keeps under 12 minutes; CI runs it
def test_bench_runs_a_matrix_in_process_and_compares_rungs(
    tmp_path: Path, kiln_env: dict[str, str], redis_conn: Any
) -> None:
    """It says how many renders and how long by the workers' fit before it starts, a line as
    each cell ends, then the tables; a line with one step count has no fit, and says so."""
    from api_client.schema import TimingFit

    fit = TimingFit(fixed_s=1.0, per_step_s=0.5, samples=9, rung="full")
    redis_conn.hset("kiln:fits", "tiny-sd15:128x128", fit.model_dump_json())
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
    out_lines = done.stdout.splitlines()
    assert out_lines[0] == (
        "kiln bench: 9 renders (3 points from 2 cells x 3 prompts x repeat 1) in process"
    )
    # 3 x (1 + 2 x 0.5) + 3 x (1 + 4 x 0.5) + 3 x (1 + 2 x 0.5) by the published fit.
    assert out_lines[1].startswith("expected: about 21 s (by the workers' timing fits in kiln:fits")
    assert out_lines[2].startswith("[1/2] tiny-sd15 128x128 steps 2, 4 (defaults): 6 renders in ")
    assert "; 3 left, about " in out_lines[2]
    assert out_lines[3].startswith("[2/2] tiny-sd15 128x128 steps 2 (memory_mode=model_offload): ")
    assert "memory_mode=model_offload" in done.stdout and "linear fit" in done.stdout
    assert "one step count (2): no fit" in done.stdout
    assert "9 renders in " in done.stdout and "(expected about 21 s)" in done.stdout
    lines = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert len(lines) == 9
    assert {line["rung"] for line in lines} == {"full", "model_offload"}
    assert (out / "phases.png").is_file() and (out / "timings.csv").is_file()


@pytest.mark.slow  # a profiled worker run (~17 s): make test-slow, which CI runs
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


def _warm(model: str, steps: int, total: float, width: int = 128) -> TimingRecord:
    """A warm render of `steps` steps whose total splits 1/4 fixed, 3/4 denoise."""
    return TimingRecord(
        job_id=f"{model}-{steps}-{total}",
        model=model,
        status="done",
        timings=Timings(denoise=total * 0.75, total=total),
        steps=steps,
        width=width,
        height=128,
        num_images=1,
        rung="full",
    )


def test_bench_estimate_starts_from_published_fits_and_updates_as_it_measures() -> None:
    """Before the run: the workers' fits where there are some, "unknown until the first renders
    of MODEL" where not (naming the sizes when the model is known at others); as warm renders come
    in the bench's own fit replaces the published one, for other settings too until they have
    their own."""
    from api_client.schema import TimingFit
    from worker.ops.bench import Matrix, Suite, plan
    from worker.ops.forecast import Estimate, published_fits

    matrix = Matrix.model_validate(
        {
            "cells": [
                {"model": "a", "steps": [2, 4], "sizes": [[128, 128]]},
                {"model": "b", "steps": [2], "sizes": [[128, 128]], "num_images": 2},
                {
                    "model": "a",
                    "steps": [4],
                    "sizes": [[128, 128], [256, 128]],
                    "settings": {"x": 1},
                },
            ]
        }
    )
    requests = plan(Suite(prompts=[{"prompt": "p"}, {"prompt": "q"}]), matrix)
    assert len(requests) == 10
    estimate = Estimate({("a", 128, 128): TimingFit(fixed_s=1.0, per_step_s=0.5, samples=9)})
    # a at 128x128 by the published fit: 2 x (1 + 2 x 0.5) + 2 x (1 + 4 x 0.5) + 2 x 3 = 16 s.
    assert str(estimate.of(requests)) == (
        "about 16 s for 6 renders, the other 4 unknown until the first renders of b, a at 256x128"
    )
    plain, b_cell, other = matrix.cells
    estimate.add(b_cell, _warm("b", 2, 0.8).model_copy(update={"cold": True}))  # a load: no fit
    assert estimate.of(requests[4:6]).unknown == ["b"]
    estimate.add(b_cell, _warm("b", 2, 0.8).model_copy(update={"num_images": 2}))
    b = estimate.of(requests[4:6])  # per image 0.1 fixed + 2 x 0.15 per step; 2 images a job
    assert b.unknown == [] and abs(b.seconds - 1.6) < 1e-9 and b.short == "~1.6 s left"
    for steps, total in [(2, 0.4), (4, 0.6), (2, 0.4), (4, 0.6)]:  # 0.2 s + 0.1 s a step
        estimate.add(plain, _warm("a", steps, total))
    # The bench's own fit, not the published one, for both cells of a at 128x128: 2.0 + 1.2 s.
    assert str(estimate.of(requests)) == (
        "about 4.8 s for 8 renders, the other 2 unknown until the first renders of a at 256x128"
    )
    estimate.add(other, _warm("a", 4, 3.0, width=256))
    assert (
        str(estimate.of(requests)) == "about 11 s" and estimate.of(requests).short == "~11 s left"
    )
    assert published_fits("redis://127.0.0.1:1/0") == {}  # no Redis: no fits, no error


def _groups() -> list[Any]:
    from worker.ops.bench import Group

    def point(model: str, steps: int, totals: list[float], settings: str = "defaults") -> Any:
        return Group(model, (128, 128), steps, settings, [_warm(model, steps, t) for t in totals])

    return [
        point("a", 4, [1.0, 1.1]),  # more steps, less time: noise
        point("a", 8, [0.9, 0.95]),
        point("b", 2, [0.4, 0.4]),
        point("b", 4, [0.6, 0.6]),
        point("b", 4, [0.7], settings="memory_mode=x"),
    ]


def test_bench_tables_and_chart_call_a_negative_per_step_fit_noise(tmp_path: Path) -> None:
    """One bar per point (model x size x steps x settings), grouped by model; a negative fitted
    per-step time is shown as noise with the reason, in the table and the chart, never as a
    number; one step count says there is no fit."""
    from rich.console import Console

    from worker.ops.bench import chart_data, render_tables
    from worker.ops.report import write_bench_chart

    console = Console(record=True, width=250)
    for table in render_tables(_groups()):
        console.print(table)
    text = console.export_text()
    fits = text[text.index("linear fit") :]
    noise = "per-step fit negative: noise, more steps or repeats needed"
    [a_row] = [line for line in fits.splitlines() if "│ a " in line]
    assert noise in a_row and a_row.count("noise") == 3 and "-0." not in a_row
    [b_row] = [line for line in fits.splitlines() if "│ b " in line and "defaults" in line]
    assert "0.200" in b_row and "0.1000" in b_row and "noise" not in b_row
    assert "one step count (4): no fit" in fits
    points, lines = chart_data(_groups())
    assert [(p.model, p.label) for p in points] == [
        ("a", "128x128, 4 st"),
        ("a", "128x128, 8 st"),
        ("b", "128x128, 2 st"),
        ("b", "128x128, 4 st"),
        ("b", "128x128, 4 st\nmemory_mode=x"),
    ]
    assert abs(points[0].phases["total"] - 1.05) < 1e-9
    # Given backwards: models and settings in the order they came, then size and steps.
    backwards = [(p.model, p.label) for p in chart_data(_groups()[::-1])[0]]
    assert backwards == [
        ("b", "128x128, 4 st\nmemory_mode=x"),
        ("b", "128x128, 2 st"),
        ("b", "128x128, 4 st"),
        ("a", "128x128, 4 st"),
        ("a", "128x128, 8 st"),
    ]
    legend = write_bench_chart(points, lines, tmp_path / "bench.png")
    assert legend == [
        f"a 128x128: {noise}",
        "b 128x128: 0.200 s + 0.1000 s/step",
        "b 128x128 memory_mode=x: one step count (4): no fit",
    ]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_progress_draws_a_bar_on_a_terminal_and_a_line_a_cell() -> None:
    """A bar on stderr with the point, renders done and the time left by the fits, updated as
    renders come in; nothing drawn when stderr is no terminal; a line on stdout as a cell ends."""
    import io

    from rich.console import Console

    from worker.ops.bench import BenchMonitor, Matrix, Suite, plan
    from worker.ops.forecast import Estimate

    matrix = Matrix.model_validate(
        {
            "cells": [
                {"model": "a", "steps": [2, 4], "sizes": [[128, 128]]},
                {"model": "b", "steps": [2], "sizes": [[128, 128]]},
            ]
        }
    )
    requests = plan(Suite(prompts=[{"prompt": "p"}, {"prompt": "q"}]), matrix)
    for terminal in (True, False):
        out, err = io.StringIO(), io.StringIO()
        monitor = BenchMonitor(
            requests,
            Estimate({}),
            Console(file=out, width=200),
            Console(file=err, force_terminal=terminal, width=160),
        )
        with monitor:
            monitor.bar.refresh()
            for index, (_, request) in enumerate(requests):
                monitor.start(index)
                record = _warm(request["model"], request["steps"], 0.1 * request["steps"])
                monitor.done(index, record.model_copy(update={"cold": index in (0, 4)}))
                monitor.bar.refresh()
        lines = out.getvalue().splitlines()
        assert len(lines) == 2
        assert lines[0].startswith("[1/2] a 128x128 steps 2, 4 (defaults): 4 renders in ")
        assert lines[0].endswith("; 2 left, unknown until the first renders of b")
        assert lines[1].startswith("[2/2] b 128x128 steps 2 (defaults): 2 renders in ")
        drawn = err.getvalue()
        if not terminal:
            assert drawn == ""
            continue
        assert "0/6" in drawn and "time left unknown until the first renders of a, b" in drawn
        assert "a 128x128 4 steps" in drawn and "4/6" in drawn and "6/6" in drawn
        # After a's first warm render (0.2 s at 2 steps, 3/4 of it denoise): 0.05 s + 0.075 s a
        # step for a's two renders of 4 steps left; then the line through 2 and 4 steps.
        assert "~0.7 s left + b unknown" in drawn and "~0.4 s left + b unknown" in drawn


def test_the_default_bench_asks_only_what_each_manifest_allows() -> None:
    """Every request `kiln bench` makes by default passes the client's rules (a suite's negative
    prompt on FLUX.1 needs true CFG): a default run that fails its own requests measures none."""
    from api_client.errors import RequestRejected
    from api_client.manifest import load_manifest_dir, manifest_dirs
    from api_client.resolve import check_servable, resolve_request
    from api_client.schema import RenderRequest
    from tests.conftest import ROOT
    from worker.ops.bench import Matrix, Suite, _load, plan

    suite = _load(Suite, ROOT / "bench" / "suites" / "prompts-8.json")
    matrix = _load(Matrix, ROOT / "bench" / "matrices" / "tiny-steps.json")
    manifests, _ = load_manifest_dir(manifest_dirs(None))
    refused = []
    for _cell, request in plan(suite, matrix):
        parsed = RenderRequest.parse(request)
        try:
            resolve_request(parsed, check_servable(parsed, manifests))
        except RequestRejected as exc:
            refused.append(str(exc))
    assert refused == [], refused[:3]
