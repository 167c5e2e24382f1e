"""torch.compile policy: only at full, auto off on CPU, compile: required honoured, a failing
first compiled forward falls back to eager, and (slow) a real regional compile with recompiles."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from redis import Redis

from tests.support.inprocess import burst, client_for, make_renderer
from tests.support.records import records
from worker.errors import CompileRequired
from worker.manifest import load_manifests
from worker.memory.faults import FaultPlan
from worker.pipelines.loading import load_pipeline
from worker.pipelines.resident import LoadedPipeline
from worker.settings import Settings

MODEL = "tiny-sd15"


def load(settings: Settings, rung: str = "full", **manifest: Any) -> LoadedPipeline:
    base = load_manifests(settings.manifests, [MODEL])[MODEL]
    from worker.memory.device import probe

    return load_pipeline(
        base.model_copy(update=manifest), rung, probe(settings), settings, FaultPlan()
    )  # type: ignore[arg-type]


def compile_note(loaded: LoadedPipeline) -> tuple[str, str]:
    for kind in ("applied", "skipped", "fell_back"):
        for note in getattr(loaded.settings, kind):
            if note.name == "compile":
                return kind, note.reason
    raise AssertionError("no compile note")


def test_auto_does_not_compile_on_cpu(settings: Settings) -> None:
    loaded = load(settings)
    assert not loaded.compiled
    assert compile_note(loaded) == (
        "skipped",
        "auto: off on CPU (tiny UNet: 76 s compile to save ~8 ms a step)",
    )


@pytest.mark.parametrize("rung", ["model_offload", "group_offload"])
def test_never_compiles_below_full_even_when_required(make_settings: Any, rung: str) -> None:
    loaded = load(make_settings(compile="on"), rung, compile="required")
    assert not loaded.compiled
    kind, reason = compile_note(loaded)
    assert kind == "skipped" and f"rung {rung}" in reason and reason.startswith("required")


def test_required_with_the_switch_off_refuses_to_load(make_settings: Any) -> None:
    with pytest.raises(CompileRequired, match=r"tiny-sd15: compile is required .* switch is off"):
        load(make_settings(compile="off"), compile="required")


def test_a_failing_first_compiled_forward_falls_back_to_eager(
    redis_conn: Redis, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake: a torch.compile backend that refuses every graph, as a broken Inductor would."""
    import worker.pipelines.compile

    def broken_backend(gm: Any, inputs: Any) -> Any:
        raise RuntimeError("injected compiler failure")

    def compile_with_broken_backend(
        denoiser: torch.nn.Module,
        settings: Settings,
        method: str = "auto",
        step_cache: bool = False,
    ) -> str:
        # A small region keeps Dynamo's tracing cheap; the failure path is the same.
        denoiser.time_embedding.compile(backend=broken_backend)  # type: ignore[operator]
        return "test: time_embedding with a broken backend"

    monkeypatch.setattr(worker.pipelines.compile, "compile_denoiser", compile_with_broken_backend)
    settings = make_settings(compile="on")
    handle = client_for(redis_conn, settings).submit({"model": MODEL, "prompt": "c", "steps": 2})
    burst(redis_conn, make_renderer(settings, [MODEL]), [MODEL])
    result = handle.wait(timeout=30)
    assert not result.compiled
    assert [(a.rung, a.outcome) for a in result.attempts] == [("full", "error"), ("full", "ok")]
    [note] = [n for n in result.settings.fell_back if n.name == "compile"]
    assert "injected compiler failure" in note.reason
    assert "compile" not in result.settings.names("applied")


@pytest.mark.slow
def test_regional_compile_renders_and_counts_recompiles(
    redis_conn: Redis, make_settings: Any
) -> None:
    settings = make_settings(compile="on")
    renderer = make_renderer(settings, [MODEL])
    client = client_for(redis_conn, settings)
    sizes = [(128, 128), (128, 128), (192, 128)]
    jobs = [
        client.submit({"model": MODEL, "prompt": "compiled", "steps": 2, "width": w, "height": h})
        for w, h in sizes
    ]
    burst(redis_conn, renderer, [MODEL])
    results = [job.wait(timeout=600) for job in jobs]
    assert all(r.compiled and r.rung == "full" for r in results)
    assert "regional" in next(n.reason for n in results[0].settings.applied if n.name == "compile")
    first, same_size, new_size = records(settings.timings_log)
    assert first.cold and not same_size.cold and new_size.cold
    assert same_size.recompiles == 0  # same shape: the graphs from the first job are reused
    assert new_size.recompiles > 0  # a new latent size makes Dynamo build new graphs
    assert same_size.recompile_causes == []
    assert new_size.recompile_causes == [f"new size 192x128: {new_size.recompiles} graph(s)"]


def test_a_recompile_is_named_by_what_the_job_asked_first(settings: Settings) -> None:
    loaded = load(settings)
    assert loaded.novelty(128, 128, 1, cfg=True) == "new size 128x128"
    loaded.warm_shapes.add((128, 128, 1))
    loaded.cfg_seen.add(True)
    assert loaded.novelty(128, 128, 2, cfg=True) == "new batch of 2 at 128x128"
    assert loaded.novelty(128, 128, 1, cfg=False).startswith("guidance off")
    assert "a guard on another input" in loaded.novelty(128, 128, 1, cfg=True)


@pytest.mark.parametrize(
    ("method", "expected"),
    [("auto", "regional: torch.compile of UNet2DConditionModel's repeated"), ("whole", "whole")],
)
def test_compile_method_picks_regional_or_whole(
    make_settings: Any, method: str, expected: str
) -> None:
    # The wrap is lazy: nothing is traced until the first forward, so this costs no compile.
    loaded = load(make_settings(compile="on"), compile_method=method)
    kind, reason = compile_note(loaded)
    assert kind == "applied" and reason.startswith(expected), reason


def test_regional_without_repeated_blocks_falls_back_naming_the_class(make_settings: Any) -> None:
    settings = make_settings(compile="on")
    base = load_manifests(settings.manifests, ["tiny-sd3"])["tiny-sd3"]
    from worker.memory.device import probe

    loaded = load_pipeline(
        base.model_copy(update={"compile_method": "regional"}),
        "full",
        probe(settings),
        settings,
        FaultPlan(),
    )
    kind, reason = compile_note(loaded)
    assert kind == "fell_back" and "SD3Transformer2DModel declares no repeated blocks" in reason
