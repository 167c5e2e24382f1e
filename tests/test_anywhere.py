"""Installable and runnable anywhere: the distribution ships the manifests (read through
importlib.resources, KILN_MANIFESTS after them), models and outputs default to a per-user data
directory, and `kiln worker` renders from a directory that is not the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import tomllib
from redis import Redis

from api_client import KilnClient
from api_client.manifest import load_manifest_dir, manifest_dirs, shipped_manifests
from worker.errors import ManifestDirectoryInvalid
from worker.files.details import DISTRIBUTION, kiln_version
from worker.manifest import load_manifests
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_lists_every_package_on_disk_and_ships_the_manifests() -> None:
    """pyproject lists its packages (find cannot rename manifests/ to kiln_manifests): every
    directory of worker/ and api_client/ must be there, or a wheel would lack it while an
    editable install, and so this suite, still found it."""
    tool = PYPROJECT["tool"]["setuptools"]
    on_disk = {
        ".".join(path.relative_to(ROOT).parts)
        for top in ("worker", "api_client")
        for path in [ROOT / top, *(ROOT / top).rglob("*")]
        if path.is_dir() and "__pycache__" not in path.parts
    }
    assert set(tool["packages"]) == on_disk | {"kiln_manifests"}
    assert tool["package-dir"] == {"kiln_manifests": "manifests"}
    assert tool["package-data"] == {"kiln_manifests": ["*.yaml"], "api_client.http.static": ["*"]}


def test_the_version_is_asked_for_by_the_distribution_name() -> None:
    assert PYPROJECT["project"]["name"] == DISTRIBUTION
    assert kiln_version() == PYPROJECT["project"]["version"]


def test_the_shipped_manifests_are_the_packages_and_the_tiny_ones_are_among_them() -> None:
    shipped = shipped_manifests()
    assert shipped == Path(str(files("kiln_manifests")))
    assert {p.name for p in ROOT.joinpath("manifests").glob("*.yaml")} == {
        p.name for p in shipped.glob("*.yaml")
    }
    manifests, failures = load_manifest_dir(manifest_dirs())
    assert failures == []
    assert {"tiny-sd15", "tiny-sdxl", "tiny-flux", "sdxl-turbo"} <= set(manifests)


def test_kiln_manifests_directories_are_read_in_order_after_the_shipped_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped_text = (shipped_manifests() / "tiny-sd15.yaml").read_text()
    first, second = tmp_path / "first", tmp_path / "second"
    for directory, steps in ((first, 5), (second, 6)):
        directory.mkdir()
        text = shipped_text.replace("steps: {default: 8,", f"steps: {{default: {steps},")
        assert text != shipped_text, "tiny-sd15.yaml changed shape"
        (directory / "tiny-sd15.yaml").write_text(text)
    (first / "tiny-mine.yaml").write_text(shipped_text.replace("id: tiny-sd15", "id: tiny-mine"))
    monkeypatch.setenv("KILN_MANIFESTS", f"{first}{os.pathsep}{second}")

    settings = Settings()
    assert list(settings.manifests) == [shipped_manifests(), first, second]
    assert str(settings.manifests) == os.pathsep.join(map(str, settings.manifests))
    manifests = load_manifests(settings.manifests)
    assert manifests["tiny-sd15"].steps.default == 6  # the last directory's
    assert manifests["tiny-mine"].steps.default == 8  # added beside the shipped ones
    assert manifests["tiny-sdxl"].id == "tiny-sdxl"  # the shipped ones stay
    # The client reads the same, given the same value (KilnClient.from_env: KILN_MANIFESTS).
    assert KilnClient.from_env().manifests_dir == settings.manifests


def test_a_kiln_manifests_directory_that_does_not_exist_is_an_error_naming_it(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "not-there"
    with pytest.raises(ManifestDirectoryInvalid) as raised:
        load_manifests(Settings(manifests=str(missing)).manifests, ["tiny-sd15"])
    assert f"{missing}: (dir) = {str(missing)!r}: manifest directory not found" in str(raised.value)


def test_models_and_outputs_default_to_the_per_user_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("KILN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(sys, "platform", "linux")
    settings = Settings()
    data = tmp_path / "data" / "kiln"
    assert settings.models_dir == data / "models"
    assert settings.output_dir == data / "outputs"
    assert settings.timings_log == data / "outputs" / "timings.jsonl"
    assert settings.inductor_cache_dir.is_absolute()
    assert settings.models == ()
    # The log follows an output directory that is set; XDG's relative values are ignored.
    monkeypatch.setenv("KILN_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")
    settings = Settings()
    assert settings.timings_log == tmp_path / "out" / "timings.jsonl"
    assert settings.models_dir == Path.home() / ".local" / "share" / "kiln" / "models"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert Settings().models_dir == Path.home() / "Library/Application Support/kiln/models"


def test_kiln_models_names_what_a_worker_serves_and_models_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KILN_MODELS", "tiny-sd15, tiny-sdxl,")
    assert Settings().models == ("tiny-sd15", "tiny-sdxl")
    assert Settings(models="tiny-flux").models == ("tiny-flux",)  # --models, as _worker passes it


def _elsewhere_env(redis_url: str, data: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any KILN_* or PYTHONPATH: only the installed package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") and k != "PYTHONPATH"}
    env.update(
        KILN_REDIS_URL=redis_url,
        XDG_DATA_HOME=str(data),  # the per-user data directory, here a temporary one
        KILN_INDUCTOR_CACHE_DIR=str(data / "inductor"),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def _kiln_command() -> list[str]:
    """The installed console script where there is one, else the module it runs."""
    script = shutil.which("kiln", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "worker.cli"]


def test_a_worker_renders_from_any_directory(
    tmp_path: Path, tiny_dir: Path, redis_url: str, redis_conn: Redis
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert ROOT not in elsewhere.parents
    data = tmp_path / "data"
    job = KilnClient(connection=redis_conn).submit(
        {"model": "tiny-sd15", "prompt": "a fox", "steps": 2, "seed": 7}
    )
    done = subprocess.run(
        [*_kiln_command(), "worker", "--burst", "--models", "tiny-sd15"],
        cwd=elsewhere,
        env=_elsewhere_env(redis_url, data, KILN_MODELS_DIR=str(tiny_dir)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = job.wait(timeout=10)
    image = Path(result.images[0].path)
    assert image.is_file()
    assert data / "kiln" / "outputs" / job.id in image.parents
    assert (data / "kiln" / "outputs" / "timings.jsonl").is_file()
    assert list(elsewhere.iterdir()) == []  # nothing written where it ran


def test_a_worker_with_nothing_it_can_run_names_what_it_found_and_how_to_serve_one(
    tmp_path: Path, redis_url: str, redis_conn: Redis
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _elsewhere_env(
        redis_url,
        tmp_path / "data",  # an empty data directory: no tiny models built
        HF_HOME=str(tmp_path / "hf"),  # an empty hub cache: no real model's weights either
        HF_HUB_OFFLINE="1",
    )
    done = subprocess.run(
        [*_kiln_command(), "worker", "--burst"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (error,) = [line["error"] for line in lines if line.get("event") == "no_models"]
    assert "found: flux1-dev, " in error and "tiny-sd15" in error and "sdxl-turbo" in error
    assert "`kiln worker --models ID`" in error and "KILN_MODELS=ID" in error
    assert str(tmp_path / "data" / "kiln" / "models") in error
