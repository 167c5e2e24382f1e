"""Per-job LoRA on a resident pipeline, without recompiling a compiled denoiser.

At load, before placement and compile, every adapter the manifest allows is read into host
memory, and the denoiser gets N adapter slots (N: as many as one request may name), each a
zero-valued placeholder covering every layer any allowed adapter touches, at the largest rank
any may have. Scalings become tensors (peft's prepare_model_for_compiled_hotswap). A job then
copies its adapters' weights into slots (diffusers' hotswap, an in-place copy) and sets each
slot's strength in place on its scaling tensors; a slot the job does not use is scaled to 0.
Shapes and Python values the compiled graphs guard on never change, so nothing recompiles.

Measured facts this rests on (diffusers 0.42, peft 0.21, tiny-sd15, regional compile): a swap
takes 10-20 ms with 0 new graphs, swapping back reproduces an image exactly, and a zero
placeholder renders the base model's pixels. Found on the way: the first (non-hotswap) load
keeps the tensors it is given as the adapter's parameters, so later swaps would write through
them into whatever dict supplied them; placeholders are built fresh for each slot.

Only the denoiser's layers are swapped: diffusers cannot hotswap a text encoder's adapter, so
an adapter that trains the text encoder is refused at load, naming it.

A job that uses no slot (names no adapter, or all at weight 0) must not pay for them: on
tiny-sd15 two zero slots made every step slower (1.34-1.38x the call without slots, 8 steps at
128x128), and peft's own disable switch still left its wrappers' Python on every layer (1.07-1.08x).
So while such a job runs, each wrapped layer's own module stands in its parent in place of the
wrapper (bypassed()): the call is the base model's, pixel for pixel, and the wrappers are back
before anything else (a swap, a placement, an eviction) sees the denoiser. A compiled denoiser
then keeps two sets of graphs, the plain one and the slotted one, each built once."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from api_client.loras import LoraSpec, slot_count
from api_client.manifest import Manifest
from api_client.model_files import refuse_pickle
from api_client.schema import LoraChoice
from worker.manifest import weights_source
from worker.pipelines.single_file import hub_or_local_file, offline

log = logging.getLogger(__name__)


class _DenoiserOnly(logging.Filter):
    """Every load of a denoiser-only adapter through a pipeline with a text encoder warns that the
    text encoder got no LoRA keys; kiln's adapters are denoiser-only by rule (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No LoRA keys associated to" not in record.getMessage()


for _name in ("diffusers.loaders.lora_base", "diffusers.loaders.peft"):
    logging.getLogger(_name).addFilter(_DenoiserOnly())


class AdapterRefused(ValueError):
    """An allowed adapter this worker cannot hot-swap (names the adapter and the rule)."""


@dataclass(frozen=True)
class AdapterFile:
    """One allowed adapter as read: the file's tensors, handed to diffusers on every swap (it
    converts kohya, peft and older diffusers layouts itself, alphas included), and the layers
    and rank they come to once converted."""

    name: str
    raw: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]  # converted key -> shape, lora_A/down and lora_B/up only
    rank: int


def _is_down(key: str) -> bool:
    return ".lora_A." in key or ".lora.down." in key or ".lora_down." in key


def _is_up(key: str) -> bool:
    return ".lora_B." in key or ".lora.up." in key or ".lora_up." in key


def read_adapter(
    manifest: Manifest, name: str, spec: LoraSpec, pipeline_cls: Any, denoiser: str, models: Path
) -> AdapterFile:
    """Read one of the manifest's adapters; AdapterRefused for one kiln cannot hot-swap."""
    from safetensors.torch import load_file

    where = f"model {manifest.id}: lora {name}"
    path = adapter_path(manifest, name, spec, models)
    refuse_pickle(f"{where}: file", path.name)
    raw = load_file(path)
    # diffusers' lora_state_dict converts kohya / A1111 key names (lora_unet_..., lora_te_...,
    # .lora_down/.lora_up/.alpha) for SD1.5, SDXL and FLUX as it converts peft's.
    converted = pipeline_cls.lora_state_dict(dict(raw))
    state = converted[0] if isinstance(converted, tuple) else converted
    if any("_lora.down." in k for k in state):
        # kohya's come back in diffusers' older attention-processor names (to_k_lora.down),
        # which load_lora_weights turns into peft's as here: the layers the slots must cover.
        from diffusers.utils import convert_unet_state_dict_to_peft

        state = convert_unet_state_dict_to_peft(state)
    foreign = sorted(k for k in state if not k.startswith(f"{denoiser}."))
    if foreign:
        raise AdapterRefused(
            f"{where}: {path.name} trains more than the {denoiser} ({len(foreign)} tensors, e.g."
            f" {foreign[0]}); kiln hot-swaps the {denoiser}'s layers only (diffusers cannot"
            " hotswap a text encoder's adapter)"
        )
    shapes = {k: tuple(t.shape) for k, t in state.items() if _is_down(k) or _is_up(k)}
    if not shapes:
        raise AdapterRefused(f"{where}: {path.name} holds no LoRA layers")
    rank = max(shapes[k][0] for k in shapes if _is_down(k))
    if rank > spec.max_rank:
        raise AdapterRefused(f"{where}: has rank {rank}, above its max_rank {spec.max_rank}")
    return AdapterFile(name, raw, shapes, rank)


def adapter_path(manifest: Manifest, name: str, spec: LoraSpec, models: Path) -> Path:
    """The adapter's safetensors file: source itself (a kohya / A1111 file, on this disk or
    owner/repo/file on the hub), or weight_name in source's directory or hub repo."""
    if spec.is_file:
        where = f"model {manifest.id}: loras.{name}.source"
        return hub_or_local_file(spec.source, models, spec.revision, where)
    source = weights_source(manifest, models, source=spec.source, marker=spec.weight_name)
    if source.local:
        return Path(source.location) / spec.weight_name
    from huggingface_hub import hf_hub_download

    return Path(
        hf_hub_download(
            source.location, spec.weight_name, revision=spec.revision, local_files_only=offline()
        )
    )


@dataclass
class AdapterSlots:
    """The adapter slots on one resident pipeline: what each holds, and its layers' scalings."""

    pipe: Any
    adapters: dict[str, AdapterFile]
    names: list[str]  # the slots' adapter names in peft: kiln0, kiln1, ...
    held: list[str | None] = field(default_factory=list)  # the allowed adapter in each slot
    weights: list[float] = field(default_factory=list)  # the strength each slot is set to
    # Each slot's (scaling dict of a LoRA layer, alpha/rank) pairs, for setting strength.
    scalings: list[list[tuple[dict[str, torch.Tensor], float]]] = field(default_factory=list)
    # Each LoRA wrapper in the denoiser: (its parent module, its attribute name there, itself).
    wrappers: list[tuple[torch.nn.Module, str, Any]] = field(default_factory=list)
    swaps: int = 0

    @classmethod
    def prepare(cls, pipe: Any, manifest: Manifest, denoiser: str, models: Path) -> AdapterSlots:
        """Read the allowed adapters and give the denoiser its zero placeholder slots."""
        from peft.utils.hotswap import prepare_model_for_compiled_hotswap

        pipeline_cls = type(pipe)
        adapters = {
            name: read_adapter(manifest, name, spec, pipeline_cls, denoiser, models)
            for name, spec in manifest.loras.items()
        }
        target_rank = max(spec.max_rank for spec in manifest.loras.values())
        union: dict[str, tuple[int, ...]] = {}
        for adapter in adapters.values():
            union.update(adapter.shapes)
        dtype = getattr(pipe, denoiser).dtype
        names = [f"kiln{i}" for i in range(slot_count(manifest.loras))]
        with warnings.catch_warnings():
            # peft warns that a second adapter makes a model hold several: the slots are that.
            warnings.filterwarnings("ignore", "Already found a `peft_config` attribute")
            # On a torchao-quantized layer peft cannot merge an adapter; kiln never merges.
            warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without")
            for name in names:
                pipe.load_lora_weights(_placeholder(union, target_rank, dtype), adapter_name=name)
        pipe.set_adapters(names)
        # Scalings to tensors (and ranks padded) before compile, so a swap changes values only.
        prepare_model_for_compiled_hotswap(getattr(pipe, denoiser), target_rank=target_rank)
        slots = cls(pipe, adapters, names, [None] * len(names), [0.0] * len(names))
        slots.scalings = [slots._scalings(name) for name in names]
        slots.wrappers = _wrappers(getattr(pipe, denoiser))
        for index in range(len(names)):
            slots._scale(index, 0.0)
        return slots

    def differs(self, choices: list[LoraChoice]) -> bool:
        """Whether these adapters at these weights are not what the slots hold now."""
        now = {h: w for h, w in zip(self.held, self.weights, strict=True) if h and w}
        return now != {c.name: float(c.weight or 0.0) for c in choices if c.weight}

    def apply(self, choices: list[LoraChoice]) -> bool:
        """Put these adapters (resolved: every weight set) in slots at their weights; unused
        slots go to 0. Adapters already in a slot stay there. Returns whether anything changed."""
        wanted = {c.name: float(c.weight or 0.0) for c in choices}
        if len(wanted) > len(self.names):
            raise AdapterRefused(f"{len(wanted)} loras asked; this pipeline has {len(self.names)}")
        free = [i for i, held in enumerate(self.held) if held not in wanted]
        changed = False
        for name in wanted:
            if name in self.held:
                continue
            index = free.pop(0)
            started = time.perf_counter()
            # A shallow copy: diffusers pops from the dict it is given. Hotswap copies values
            # into the slot's own tensors, so the raw tensors stay as read.
            with _model_offload_lifted(self.pipe):
                self.pipe.load_lora_weights(
                    dict(self.adapters[name].raw), adapter_name=self.names[index], hotswap=True
                )
            self.held[index] = name
            self.scalings[index] = self._scalings(self.names[index])
            self.weights[index] = 1.0  # the swap set alpha/rank: strength 1
            self.swaps += 1
            changed = True
            log.info("lora %s into slot %s: %.1f ms", name, index, _ms(started))
        for index, held in enumerate(self.held):
            weight = wanted.get(held, 0.0) if held is not None else 0.0
            if weight != self.weights[index]:
                self._scale(index, weight)
                changed = True
        return changed

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """While a job that uses no slot runs (every weight 0), the denoiser's own layers stand
        where their LoRA wrappers were; the wrappers are back when it ends, however it ends."""
        if any(self.weights):
            yield
            return
        for parent, name, wrapper in self.wrappers:
            setattr(parent, name, wrapper.base_layer)
        try:
            yield
        finally:
            for parent, name, wrapper in self.wrappers:
                setattr(parent, name, wrapper)

    def _scalings(self, slot: str) -> list[tuple[dict[str, torch.Tensor], float]]:
        from peft.tuners.lora import LoraLayer

        found = []
        for module in self.pipe.components.values():
            if not isinstance(module, torch.nn.Module):
                continue
            for layer in module.modules():
                if isinstance(layer, LoraLayer) and slot in layer.scaling:
                    found.append((layer.scaling, float(layer.scaling[slot])))
        return found

    def _scale(self, index: int, weight: float) -> None:
        """Strength in place on the scaling tensors: a new Python float would be a new guard."""
        slot = self.names[index]
        for scaling, base in self.scalings[index]:
            scaling[slot].fill_(base * weight)
        self.weights[index] = weight


def _wrappers(denoiser: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Any]]:
    """Every peft LoRA wrapper in the denoiser, with the parent it is an attribute of."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = []
    for path, module in denoiser.named_modules():
        if isinstance(module, BaseTunerLayer):
            parent_path, _, name = path.rpartition(".")
            found.append((denoiser.get_submodule(parent_path), name, module))
    return found


def _placeholder(
    shapes: dict[str, tuple[int, ...]], rank: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Zeros over every layer in shapes at rank: a slot that changes nothing until swapped."""
    tensors = {}
    for key, shape in shapes.items():
        padded = (rank, *shape[1:]) if _is_down(key) else (shape[0], rank, *shape[2:])
        tensors[key] = torch.zeros(padded, dtype=dtype)
    return tensors


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


@contextmanager
def _model_offload_lifted(pipe: Any) -> Iterator[None]:
    """The model_offload rung's hooks off while an adapter loads, and back on the device they
    had. diffusers lifts and restores them itself, but restores with no device: on a CPU worker
    that raises "requires accelerator", so a pinned model_offload job with a LoRA failed."""
    device = getattr(pipe, "_offload_device", None)
    hooked = device is not None and bool(getattr(pipe, "_all_hooks", None))
    if hooked:
        pipe.remove_all_hooks()
    try:
        yield
    finally:
        if hooked:
            pipe.enable_model_cpu_offload(device=device)
