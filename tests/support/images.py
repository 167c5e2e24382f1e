"""Images a test sends and reads back: PNG bytes to upload (noise, an inpaint mask, a square
with clear edges), an output's pixels to compare, and the details a tiny-sd15 image carries."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from api_client.schema import OutputFormat
from worker.files.details import ImageDetails, kiln_version


def encoded(image: Image.Image, fmt: str = "PNG", **save: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def png(size: tuple[int, int] = (128, 128), seed: int = 0) -> bytes:
    """Noise, different for each seed."""
    noise = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    return encoded(Image.fromarray(noise))


def mask_png(size: tuple[int, int] = (128, 128)) -> bytes:
    """White (repaint) in the middle half, black around it."""
    mask = Image.new("L", size, 0)
    mask.paste(255, (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4))
    return encoded(mask)


def square_png(size: tuple[int, int] = (128, 128)) -> bytes:
    """A white square on black: its Canny edges are the square's outline."""
    image = Image.new("RGB", size, (0, 0, 0))
    image.paste((255, 255, 255), (32, 32, 96, 96))
    return encoded(image)


def pixels(path: str | Path | None) -> Any:
    """An image file's RGB pixels, as int16 so that differences between two do not wrap."""
    assert path is not None
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def tiny_details(fmt: OutputFormat, **changes: Any) -> ImageDetails:
    """Details as a tiny-sd15 job at 128 px would carry them."""
    values: dict[str, Any] = {
        "kiln": kiln_version(),
        "model": "tiny-sd15",
        "revision": None,
        "prompt": "a fox",
        "negative_prompt": "",
        "seed": 1,
        "steps": 2,
        "guidance": 7.0,
        "true_cfg": None,
        "scheduler": "PNDMScheduler",
        "width": 128,
        "height": 128,
        "num_images": 1,
        "index": 0,
        "format": fmt,
        "rung": "full",
        "dtype": "fp32",
        "compiled": False,
        "device": "cpu",
        "quantized": {},
        "loras": [],
        "inputs": [],
    }
    return ImageDetails(**{**values, **changes})
