"""Model files as self-hosters have them (#39): never a pickle (refused by `kiln manifests check`
and at load), kohya / A1111 LoRA files, `kiln manifests new` from a file's header, single-file
checkpoints and a component from its own (GGUF) file, each against the tiny diffusers-layout
pipeline it was converted from."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from api_client.loras import LoraSpec
from api_client.manifest import Manifest
from api_client.model_files import PickleRefused
from tests.conftest import MANIFESTS, kiln
from worker.manifest import load_manifests
from worker.memory.device import probe
from worker.pipelines.adapters import read_adapter
from worker.pipelines.loading import read_pipeline

TINY_SD15 = """\
id: {id}
family: sd15
source: {source}
steps: {{default: 2, max: 8}}
guidance: {{default: 7.0, max: 15.0}}
resolutions: [[128, 128]]
min_vram_gb: 0.1
"""


def _manifest(**fields: Any) -> Manifest:
    """A tiny-sd15 manifest with fields replaced, unvalidated: what a load meets when a manifest
    came from somewhere other than a checked file."""
    shipped = load_manifests(MANIFESTS, ["tiny-sd15"])["tiny-sd15"]
    return shipped.model_copy(update=fields)


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_check_refuses_a_pickle_checkpoint_lora_or_component(
    tmp_path: Path, kiln_env: dict[str, str], suffix: str
) -> None:
    (tmp_path / "a.yaml").write_text(TINY_SD15.format(id="a", source=f"dreamshaper{suffix}"))
    lora = TINY_SD15.format(id="b", source="tiny-sd15")
    lora += f"loras: {{x: {{source: loras/x{suffix}, max_rank: 4}}}}\n"
    (tmp_path / "b.yaml").write_text(lora)
    part = TINY_SD15.format(id="c", source="tiny-sd15")
    part += f"components: {{unet: {{file: unet{suffix}, gb: 1.0}}}}\n"
    (tmp_path / "c.yaml").write_text(part)
    done = kiln("manifests", "check", str(tmp_path), env=kiln_env)
    assert done.returncode == 1, done.stdout
    for name in ("a.yaml", "b.yaml", "c.yaml"):
        line = next(line for line in done.stderr.splitlines() if name in line)
        assert "is a pickle" in line and "arbitrary code on load" in line, line
        assert "convert it to safetensors" in line, line
    assert "0 valid, 3 invalid" in done.stdout


def test_the_load_refuses_a_pickle_whatever_the_manifest_said(
    tiny_dir: Path, settings: Any, tmp_path: Path
) -> None:
    info = probe(settings)
    with pytest.raises(PickleRefused, match=r"model tiny-sd15: source 'x\.ckpt' is a pickle"):
        read_pipeline(_manifest(source="x.ckpt"), info, settings)
    spec = LoraSpec.model_construct(source="loras/x.pt", weight_name="w.pt", max_rank=4)
    with pytest.raises(PickleRefused, match="is a pickle"):
        read_pipeline(_manifest(loras={"x": spec}), info, settings)
    # A LoRA's directory holding a pickle under a safetensors-looking name is never unpickled
    # either: the adapter file is read by safetensors alone.
    torch.save({"x": torch.zeros(1)}, tmp_path / "adapter.pth")
    spec = LoraSpec.model_construct(source=str(tmp_path), weight_name="adapter.pth", max_rank=4)
    with pytest.raises(PickleRefused, match=r"adapter\.pth' is a pickle"):
        read_adapter(_manifest(), "x", spec, object, "unet", tiny_dir)


def test_a_diffusers_layout_with_only_pickled_weights_is_never_unpickled(
    tiny_dir: Path, make_settings: Any, tmp_path: Path
) -> None:
    """from_pretrained never falls back to a repository's .bin weights (use_safetensors)."""
    models = tmp_path / "models"
    shutil.copytree(tiny_dir / "tiny-sd15", models / "tiny-sd15")
    unet = models / "tiny-sd15" / "unet"
    weights = unet / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(weights), unet / "diffusion_pytorch_model.bin")
    weights.unlink()
    settings = make_settings(models_dir=models)
    with pytest.raises(OSError, match="safetensors"):
        read_pipeline(_manifest(), probe(settings), settings)
