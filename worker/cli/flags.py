"""The flags of the verbs that queue a job: submit's request flags (each a RenderRequest field of
the same name, unset: the manifest's default) and the flags submit and replay share (what to do
once the job is queued). Request flags are parsed by api_client's own parsers, imported when
read."""

from __future__ import annotations

import argparse
from typing import Any

from api_client.samplers import SAMPLERS, SIGMAS


def request_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of a request, in groups: what to render, its input images, its pins, its queue."""
    _render_flags(parser)
    _input_flags(parser)
    _pin_flags(parser)
    _queue_flags(parser)


def _render_flags(parser: argparse.ArgumentParser) -> None:
    """What to render."""
    parser.add_argument("prompt")
    parser.add_argument("--model", required=True)
    parser.add_argument("--negative-prompt")
    parser.add_argument("--steps", type=int)
    parser.add_argument(
        "--guidance", type=float, help="CFG; FLUX.1: its embedded guidance (dev 3.5, schnell 0)"
    )
    parser.add_argument(
        "--true-cfg",
        type=float,
        help="true CFG against the negative prompt (FLUX.1, Qwen-Image; where the manifest allows)",
    )
    parser.add_argument("--width", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--num-images", type=int)
    parser.add_argument(
        "--sampler",
        choices=SAMPLERS,
        help="the sampler (ComfyUI's names), one the model takes (its manifest's samplers; any"
        " other is refused naming them); default: the manifest's scheduler",
    )
    parser.add_argument(
        "--sigmas",
        choices=SIGMAS,
        help="the sampler's noise schedule (with --sampler); default: the sampler's own",
    )
    parser.add_argument(
        "--format",
        dest="output_format",
        choices=["png", "webp", "jpeg", "mp4", "webm"],
        help="an image model's png, webp or jpeg; a video model's mp4 (its default), webm or"
        " webp (animated)",
    )
    parser.add_argument(
        "--frames",
        type=int,
        help="a video model's frames (its family's rule, e.g. wan 4k+1; default: the manifest's)",
    )
    parser.add_argument(
        "--fps", type=int, help="a video model's frames a second (default: the manifest's)"
    )
    parser.add_argument(
        "--previews",
        action="store_true",
        default=None,
        help="draw TAESD previews while denoising (models whose manifest names taesd)",
    )


def _input_flags(parser: argparse.ArgumentParser) -> None:
    """The images a job starts from or is steered by, and the hires pass."""
    parser.add_argument(
        "--mode",
        choices=["txt2img", "img2img", "inpaint", "edit", "txt2video", "img2video"],
        help="default: from --image/--mask (an edit model's --image: edit; a video model's:"
        " img2video, the image its first frame)",
    )
    parser.add_argument("--image", help="input image: a local file (uploaded) or a kiln-input: uri")
    parser.add_argument("--mask", help="inpaint mask (white: repaint), as --image")
    parser.add_argument("--strength", type=float, help="img2img/inpaint: 0-1, how much to repaint")
    parser.add_argument(
        "--lora",
        dest="loras",
        action="append",
        type=request_flag("api_client.loras", "parse_lora_flag"),
        metavar="NAME[:WEIGHT]",
        help="an adapter the manifest allows, at its default weight or WEIGHT (repeatable)",
    )
    parser.add_argument(
        "--control",
        dest="controls",
        action="append",
        type=request_flag("api_client.controls", "parse_control_flag"),
        metavar="NAME:PATH[:STRENGTH]",
        help="a ControlNet the manifest allows, steered by the image at PATH (a local file,"
        " uploaded, or a kiln-input: uri; the job's size) at STRENGTH 0-2 (default 1);"
        " repeatable, up to 2",
    )
    parser.add_argument(
        "--control-preprocess",
        choices=["none", "canny"],
        help="what the worker computes from each --control image first (default none: the image"
        " is the map; canny: its edges)",
    )
    parser.add_argument(
        "--reference",
        type=request_flag("api_client.references", "parse_reference_flag"),
        metavar="PATH[:STRENGTH]",
        help="a reference image through the manifest's IP-Adapter (a local file, uploaded, or a"
        " kiln-input: uri; any size) at STRENGTH 0-2 (default 1)",
    )
    parser.add_argument(
        "--hires",
        type=float,
        metavar="SCALE",
        help="a hires pass: render, make SCALE times larger (above 1, at most 4), img2img again",
    )
    parser.add_argument(
        "--hires-upscaler",
        metavar="ID",
        help="the hires pass's upscaler manifest (default latent: the latents, bilinear)",
    )
    parser.add_argument("--hires-strength", type=float, help="the hires img2img's strength (0.5)")
    parser.add_argument("--hires-steps", type=int, help="the hires img2img's steps (the request's)")


def _pin_flags(parser: argparse.ArgumentParser) -> None:
    """What the worker would otherwise decide (a replay's request carries them pinned)."""
    parser.add_argument(
        "--rung",
        help="pin a rung of the memory ladder, e.g. full (never descends; replays pin it)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="pin torch.compile of the denoiser on or off (fails naming why if it cannot)",
    )
    parser.add_argument(
        "--step-cache",
        action=argparse.BooleanOptionalAction,
        help="reuse denoiser steps (a fast draft) or compute every step (the exact final);"
        " unset: the worker's KILN_STEP_CACHE decides",
    )


def _queue_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--webhook", help="a webhook target named in the workers' KILN_WEBHOOKS")
    parser.add_argument("--job-id", help="idempotency key: the same id twice renders once")
    parser.add_argument(
        "--front", action="store_true", help="put the job at the front of its queue"
    )
    parser.add_argument(
        "--priority",
        choices=["interactive", "batch"],
        help="its lane: interactive (default) goes ahead of batch; batch is never starved",
    )


def follow_flags(parser: argparse.ArgumentParser) -> None:
    """After the job is queued (submit and replay alike): print its id, or wait for its end."""
    parser.add_argument("--wait", action="store_true", help="wait for the result, showing progress")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds --wait gives up after (exit 3)"
    )
    parser.add_argument(
        "--queue-anyway",
        action="store_true",
        help="--wait even when no live worker serves the model (else: exit 4 within seconds)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the job id, or with --wait the new RenderResult",
    )


def request_flag(module: str, parser: str) -> Any:
    """An argparse type for a request flag (`--lora NAME[:WEIGHT]`, `--control
    NAME:PATH[:STRENGTH]`, `--reference PATH[:STRENGTH]`): api_client's parser of it, checked as
    the request will be, imported when the flag is read."""

    def parsed(text: str) -> dict[str, Any]:
        import importlib

        try:
            choice = getattr(importlib.import_module(module), parser)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        result: dict[str, Any] = choice.model_dump(exclude_none=True)
        return result

    return parsed
