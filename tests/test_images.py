"""What the container images must carry to serve every mode (issue 40 item 9), read from the
files: each worker image installs the Makefile's torch and its matching torchvision (the
upscalers import it through spandrel) and spandrel itself, and no image is unpinned. Building
the images takes GBs of CUDA torch and is not part of the suite."""

from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT

WORKER_IMAGES = ("Dockerfile.cuda", "Dockerfile.rocm")


def makefile_torch() -> str:
    found = re.search(r"^TORCH \?= (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile names no TORCH"
    return found.group(1).strip()


def test_worker_images_carry_the_tested_torch_torchvision_and_spandrel() -> None:
    torch = makefile_torch()
    assert "torchvision==" in torch
    for name in WORKER_IMAGES:
        text = (ROOT / "docker" / name).read_text()
        assert f'ARG TORCH="{torch}"' in text, name
        assert "--no-deps 'spandrel==" in text, name  # never lets a resolver swap the torch


def test_every_image_is_pinned() -> None:
    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    images = [service["image"] for service in services.values() if "image" in service]
    bases = [
        line.split("=", 1)[1]
        for name in (*WORKER_IMAGES, "Dockerfile.api")
        for line in (ROOT / "docker" / name).read_text().splitlines()
        if line.startswith("ARG BASE=")
    ]
    assert images and bases
    for image in images + bases:
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        assert tag and tag != "latest", image
