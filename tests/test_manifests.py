"""Manifests: the shipped ones are valid; every kind of broken one is named by file, field,
value and rule; a worker refuses to start on one."""

from __future__ import annotations

from pathlib import Path

import pytest

from api_client.manifest import load_manifest_dir
from tests.conftest import MANIFESTS, kiln

GOOD = """\
id: {id}
family: sd15
source: tiny-sd15
steps: {{default: 8, max: 50}}
guidance: {{default: 7.0, max: 15.0}}
resolutions: [[128, 128]]
min_vram_gb: 0.1
"""


def test_shipped_manifests_are_valid() -> None:
    manifests, failures = load_manifest_dir(MANIFESTS)
    assert failures == []
    expected = {
        "tiny-sd15",
        "tiny-sdxl",
        "tiny-sd3",
        "sd-turbo",
        "sdxl-turbo",
        "sdxl-base",
        "ssd-1b",
        "ssd-1b-lightning",
        "sd35-medium",
    }
    assert expected <= set(manifests)
    assert manifests["sd35-medium"].quantize == {"text_encoder_3": ["int8"]}
    for distilled in ("sd-turbo", "sdxl-turbo", "ssd-1b-lightning"):
        assert manifests[distilled].guidance.default == 0
        assert manifests[distilled].guidance.max == 2
    assert manifests["sdxl-base"].steps.default == 15
    assert manifests["ssd-1b"].steps.default == 15


BROKEN = [
    ("unknown key", "colour: blue\n", "colour", "Extra inputs are not permitted"),
    ("wrong type", None, "min_vram_gb", "valid number"),
    ("max below default", None, "steps", "must be >= default"),
    ("id differs from stem", None, "id", "file stem"),
    ("size not multiple of 8", None, "resolutions", "multiple of 8"),
    ("size off a flux grid", None, "resolutions", "off the flux grid"),
    ("true_cfg for a CFG family", None, "true_cfg", "its CFG is guidance"),
    ("quantize scheme twice", None, "quantize", "once each"),
    ("unknown family", None, "family", "sd15"),
]


def _broken_text(case: str) -> str:
    text = GOOD.format(id="bad")
    if case == "unknown key":
        return text + "colour: blue\n"
    if case == "wrong type":
        return text.replace("min_vram_gb: 0.1", "min_vram_gb: lots")
    if case == "max below default":
        return text.replace("{default: 8, max: 50}", "{default: 8, max: 4}")
    if case == "id differs from stem":
        return text.replace("id: bad", "id: other")
    if case == "size not multiple of 8":
        return text.replace("[[128, 128]]", "[[130, 128]]")
    if case == "size off a flux grid":
        return text.replace("family: sd15", "family: flux").replace("[[128, 128]]", "[[136, 128]]")
    if case == "true_cfg for a CFG family":
        return text + "true_cfg: {default: 4.0, max: 8.0}\n"
    if case == "quantize scheme twice":
        return text + "quantize: {unet: [int8, int8]}\n"
    if case == "unknown family":
        return text.replace("family: sd15", "family: dalle")
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "_extra", "field", "rule"), BROKEN, ids=[b[0] for b in BROKEN])
def test_check_names_file_field_value_and_rule(
    tmp_path: Path, case: str, _extra: object, field: str, rule: str, kiln_env: dict[str, str]
) -> None:
    (tmp_path / "good.yaml").write_text(GOOD.format(id="good"))
    (tmp_path / "bad.yaml").write_text(_broken_text(case))
    done = kiln("manifests", "check", str(tmp_path), env=kiln_env)
    assert done.returncode == 1
    line = next(line for line in done.stderr.splitlines() if "bad.yaml" in line)
    assert f"field {field}" in line and rule in line, line
    assert "1 valid, 1 invalid" in done.stdout


def test_check_reports_every_problem_in_every_file(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    (tmp_path / "a.yaml").write_text(
        GOOD.format(id="a").replace("min_vram_gb: 0.1", "min_vram_gb: -1") + "x: 1\n"
    )
    (tmp_path / "b.yaml").write_text("just a string\n")
    done = kiln("manifests", "check", str(tmp_path), env=kiln_env)
    assert done.returncode == 1
    assert "a.yaml: field min_vram_gb: value -1" in done.stderr
    assert "a.yaml: field x: value 1" in done.stderr
    assert "b.yaml" in done.stderr and "YAML mapping" in done.stderr


def test_worker_refuses_to_start_on_an_invalid_manifest(
    tmp_path: Path, kiln_env: dict[str, str]
) -> None:
    (tmp_path / "bad.yaml").write_text(_broken_text("max below default"))
    env = {**kiln_env, "KILN_MANIFESTS": str(tmp_path)}
    done = kiln("worker", "--burst", env=env)
    assert done.returncode == 1
    assert (
        "refusing to start" in done.stderr and "bad.yaml" in done.stderr and "steps" in done.stderr
    )


def test_worker_refuses_models_it_has_no_manifest_for(kiln_env: dict[str, str]) -> None:
    done = kiln("worker", "--burst", "--models", "tiny-sd15,nope", env=kiln_env)
    assert done.returncode == 1
    assert "nope" in done.stderr and "no manifest with this id" in done.stderr
