"""A reference image through an IP-Adapter beside a resident pipeline (SD1.5, SDXL): the adapter
and its image encoder read at the first job with a reference and kept with the pipeline (never
a second copy of the base model), placed as the pipeline's rung places a model beside it
(RungSpec.place_beside), and engaged in the denoiser for the jobs with a reference only: a job
without one runs the denoiser's own attention processors, at no cost. The reference's image
embeddings are computed in the job's text encode phase and handed to the pipeline's call.

The request side (what a manifest allows, what a request may ask) is api_client.references."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from api_client.manifest import Manifest
from api_client.schema import RenderRequest
from worker.manifest import weights_source

if TYPE_CHECKING:
    from PIL import Image

    from worker.memory.device import DeviceInfo
    from worker.pipelines.resident import LoadedPipeline

log = logging.getLogger(__name__)


class ReferenceAdapter(torch.nn.Module):
    """An IP-Adapter as one module, so a rung places it and the planner counts it as one: the
    image encoder, the image projection, and the denoiser's attention processors that carry the
    adapter's key and value projections (`engaged`: every processor while a reference job runs,
    by the denoiser's own names)."""

    def __init__(
        self,
        encoder: torch.nn.Module,
        features: Any,
        projection: torch.nn.Module,
        engaged: dict[str, Any],
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.features = features  # CLIPImageProcessor: the encoder's resize, crop and normalise
        self.projection = projection
        self.engaged = engaged
        layers = {n: p for n, p in engaged.items() if isinstance(p, torch.nn.Module)}
        # ModuleDict keys may not hold dots; the processors' names do.
        self.layers = torch.nn.ModuleDict({n.replace(".", "__"): p for n, p in layers.items()})

    @property
    def hidden_states(self) -> bool:
        """Whether the projection reads the encoder's penultimate hidden states (IP-Adapter Plus)
        rather than its image embedding, as diffusers' prepare_ip_adapter_image_embeds decides."""
        from diffusers.models.embeddings import ImageProjection

        layers = getattr(self.projection, "image_projection_layers", [self.projection])
        return not isinstance(layers[0], ImageProjection)

    def set_strength(self, strength: float) -> None:
        """Every value layer's gain, in place: the compiled graphs read it as a tensor."""
        for layer in self.modules():
            if isinstance(layer, ScaledLinear):
                layer.gain.fill_(strength)  # in place: the graphs hold this tensor


class ScaledLinear(torch.nn.Linear):
    """An IP-Adapter value layer (to_v_ip) whose output is scaled by the reference's strength,
    held as a tensor. diffusers scales the adapter's attention output by a float on the
    processor (and skips it at 0): a compiled denoiser guards on that float and builds new
    graphs for every strength (measured: strength 0 after 1 rebuilt 2 graphs). Attention is
    linear in its values, so scaling them scales its output the same; the processor's own scale
    stays 1, and strength 0 adds exact zeros (the same pixels as no reference)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        features = (linear.in_features, linear.out_features)
        super().__init__(*features, bias=linear.bias is not None, device="meta")  # no init
        self.weight, self.bias = linear.weight, linear.bias
        weight = linear.weight
        self.gain: torch.Tensor
        self.register_buffer("gain", torch.ones((), dtype=weight.dtype, device=weight.device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) * self.gain


def beside_gb(manifest: Manifest, request: RenderRequest) -> float:
    """16-bit GB of the IP-Adapter and its encoder, as the manifest declares them, for a job
    with a reference image."""
    spec = manifest.ip_adapter
    return spec.gb if spec is not None and request.reference is not None else 0.0


def attach(loaded: LoadedPipeline, info: DeviceInfo, models_dir: Path) -> ReferenceAdapter:
    """The pipeline's IP-Adapter: the one it holds, else read from disk (or the hub) in the
    pipeline's precision and placed on its rung. Its bytes on the device count in the
    pipeline's (LoadedPipeline.device_bytes)."""
    if isinstance(loaded.reference, ReferenceAdapter):
        return loaded.reference
    from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

    from worker.memory import device as dev
    from worker.memory.peaks import module_bytes

    spec = loaded.manifest.ip_adapter
    assert spec is not None, "resolve_request refuses a reference where the manifest has none"
    manifest = loaded.manifest
    marker = "/".join(part for part in (spec.subfolder, spec.weight_name) if part)
    source = weights_source(manifest, models_dir, source=spec.source, marker=marker)
    encoder_spec = spec.image_encoder
    encoder_marker = "/".join(p for p in (encoder_spec.subfolder, "config.json") if p)
    encoder_source = weights_source(
        manifest, models_dir, source=encoder_spec.source, marker=encoder_marker
    )
    before = dev.allocated_bytes(info)
    options: dict[str, Any] = {"dtype": loaded.dtype}
    if encoder_spec.subfolder:
        options["subfolder"] = encoder_spec.subfolder
    if encoder_spec.revision:
        options["revision"] = encoder_spec.revision
    encoder = CLIPVisionModelWithProjection.from_pretrained(encoder_source.location, **options)
    size = encoder.config.image_size
    features = CLIPImageProcessor(size=size, crop_size=size)  # as diffusers' load_ip_adapter
    denoiser = loaded.pipe.unet
    own = denoiser.attn_processors
    # diffusers' loader builds the adapter's processors and projection into the denoiser; kiln
    # takes them out again at once and keeps them here, the denoiser as it was (also when the
    # read fails part-way).
    try:
        loaded.pipe.load_ip_adapter(
            source.location,
            subfolder=spec.subfolder or "",
            weight_name=spec.weight_name,
            image_encoder_folder=None,
            revision=spec.revision,
        )
        processors, projection = denoiser.attn_processors, denoiser.encoder_hid_proj
    except torch.OutOfMemoryError:
        raise  # the ladder's to handle
    except Exception as exc:  # a missing, truncated or foreign file: name it
        raise RuntimeError(
            f"model {manifest.id}: ip_adapter {source.location}/{marker} could not be read:"
            f" {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        _restore(denoiser, own)
    for processor in processors.values():  # strength on the values, as a tensor (ScaledLinear)
        if isinstance(getattr(processor, "to_v_ip", None), torch.nn.ModuleList):
            processor.to_v_ip = torch.nn.ModuleList(ScaledLinear(v) for v in processor.to_v_ip)
    adapter = ReferenceAdapter(encoder, features, projection, processors)
    adapter.eval().to(dtype=loaded.dtype)
    target = loaded.execution_device
    loaded.rung_spec.place_beside(adapter, target, target.type == "cuda" and info.streams)
    if info.torch_device == "cpu":
        loaded.device_bytes += module_bytes(adapter)
    else:
        loaded.device_bytes += max(dev.allocated_bytes(info) - before, 0)
    loaded.reference = adapter
    log.info("ip_adapter %s loaded beside %s at %s", marker, manifest.id, loaded.rung)
    return adapter


def _restore(denoiser: Any, processors: dict[str, Any]) -> None:
    denoiser.set_attn_processor(dict(processors))
    denoiser.encoder_hid_proj = None
    denoiser.config.encoder_hid_dim_type = None


@contextmanager
def engaged(
    loaded: LoadedPipeline, adapter: ReferenceAdapter | None, strength: float
) -> Iterator[None]:
    """Around a job's denoise with a reference: the adapter's processors and projection in the
    denoiser at the reference's strength, the denoiser's own back after (also on an error)."""
    if adapter is None:
        yield
        return
    denoiser = loaded.pipe.unet
    own = denoiser.attn_processors
    adapter.set_strength(strength)
    denoiser.set_attn_processor(dict(adapter.engaged))
    denoiser.encoder_hid_proj = adapter.projection
    denoiser.config.encoder_hid_dim_type = "ip_image_proj"
    try:
        yield
    finally:
        _restore(denoiser, own)


@torch.inference_mode()
def image_embeds(
    loaded: LoadedPipeline, adapter: ReferenceAdapter, image: Image.Image, count: int, cfg: bool
) -> list[torch.Tensor]:
    """The reference's embeddings as the pipeline's ip_adapter_image_embeds takes them, one
    per image of the batch (and the unconditional first where CFG runs), as diffusers' own
    encode_image makes them: a zero image's hidden states, or zero embeddings, unconditional."""
    device = loaded.execution_device
    pixels = adapter.features(image, return_tensors="pt").pixel_values
    pixels = pixels.to(device=device, dtype=next(adapter.encoder.parameters()).dtype)
    with loaded.rung_spec.onloaded([adapter.encoder], device):
        if adapter.hidden_states:
            positive = adapter.encoder(pixels, output_hidden_states=True).hidden_states[-2]
            zero = torch.zeros_like(pixels)
            negative = adapter.encoder(zero, output_hidden_states=True).hidden_states[-2]
        else:
            positive = adapter.encoder(pixels).image_embeds
            negative = torch.zeros_like(positive)
    positive, negative = positive[:, None], negative[:, None]  # one reference image
    batch = positive.repeat(count, *([1] * (positive.ndim - 1)))
    if cfg:
        batch = torch.cat([negative.repeat(count, *([1] * (negative.ndim - 1))), batch])
    return [batch.to(device)]
