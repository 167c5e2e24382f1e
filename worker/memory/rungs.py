"""The rung table: each rung of the memory ladder as one row (RungSpec), best first. A row says
what the rung holds on the device, how it is placed there, which switches it allows and how its
need is estimated; the ladder walks the rows in order, and loading, the switches, the peaks and
`kiln doctor --profile` read the row of the rung they act at instead of branching on its name.

Adding a rung is one row here, its name in api_client.schema's Rung (the public contract, in the
same place in the order), and its tests (tests/test_tables.py holds the two lists equal)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from api_client.schema import Rung

if TYPE_CHECKING:
    import torch

    from worker.memory.partial import PartialSplit


class Placeable(Protocol):
    """What a placement acts on (worker.pipelines.resident.LoadedPipeline)."""

    pipe: Any
    partial: PartialSplit | None

    @property
    def denoiser(self) -> torch.nn.Module: ...


# (placeable, the device, whether CUDA copy streams are used) -> the pipeline on its rung.
Place = Callable[[Placeable, "torch.device", bool], None]
# (a model loaded beside the pipeline, the device, streams) -> that model on the rung.
PlaceBeside = Callable[["torch.nn.Module", "torch.device", bool], None]
# (component -> size, the denoiser's component name) -> component -> the share of it on the device
# at the rung's peak.
Holds = Callable[[Mapping[str, float], str], dict[str, float]]


@dataclass(frozen=True)
class RungSpec:
    """One rung: its name (api_client.schema.Rung) and everything kiln does differently there."""

    name: Rung
    # Share of the manifest's min_vram_gb the rung needs where its rung_vram_gb declares none.
    default_share: float
    # The components on the device at the rung's peak, with the share of each: with the
    # manifest's component_gb, each counts at its own (quantized or fp32) size there.
    holds: Holds
    # Puts a pipeline read on the host onto the device as the rung holds it.
    place: Place
    # Whether the denoiser is torch.compiled here: accelerate's offload hooks and Inductor
    # conflict, so only a rung with no hooks compiles.
    compiles: bool = False
    # Whether vae_tiling's auto turns tiling on: off the fully resident rung the decode's peak
    # is what is left to bound.
    tiles_vae: bool = True
    # Whether placement first splits the denoiser's blocks by the memory usable then
    # (worker.memory.partial.split_for) and places by that split.
    splits: bool = False
    # Whether, with CUDA copy streams, the rung streams weights from pinned host copies that a
    # LoRA hotswap would not reach (so loras are refused there with streams).
    pinned_streams: bool = False
    # For needs derived from a measured job (worker.memory.peaks): (every weight's bytes, the
    # largest component's) -> the weights on the device at the rung's peak; None where those two
    # cannot tell (the manifest's figures are planned with instead).
    peak_weights: Callable[[int, int], int] | None = None
    # Whether those weights come onto the device during the job (so inside what it measured as
    # added) rather than at placement.
    onloads: bool = False
    # `kiln doctor --profile`'s line for the rung ({streams}: how weights are copied), if any.
    note: str | None = None
    # A model loaded beside the pipeline for some jobs (a ControlNet: worker.pipelines.control):
    # how the rung places it, and the share of its weights on the device through the denoise.
    # Where the row onloads, it is moved on for each denoise and off after, as model offload
    # moves the denoiser.
    place_beside: PlaceBeside = lambda module, target, _streams: _beside_resident(module, target)
    beside_share: float = 1.0

    @contextmanager
    def onloaded(self, modules: list[torch.nn.Module], target: torch.device) -> Iterator[None]:
        """Where the row onloads (model offload), models placed beside the pipeline on the
        device while they run (a ControlNet's denoise, an image encoder's pass) and back on the
        host after, as the offload hook moves the denoiser; elsewhere nothing."""
        if not self.onloads or not modules:
            yield
            return
        for module in modules:
            module.to(target)
        try:
            yield
        finally:
            for module in modules:
                module.to("cpu")


def _holds_all(sizes: Mapping[str, float], _denoiser: str) -> dict[str, float]:
    return dict.fromkeys(sizes, 1.0)


# With component_gb: the share of the denoiser partial holds at its least (non-block parts and
# one block), before a load measures the blocks; every other component stays resident, as at full.
PARTIAL_DENOISER_SHARE = 0.25


def _holds_partial(sizes: Mapping[str, float], denoiser: str) -> dict[str, float]:
    return {c: PARTIAL_DENOISER_SHARE if c == denoiser else 1.0 for c in sizes}


def _holds_largest(sizes: Mapping[str, float], _denoiser: str) -> dict[str, float]:
    """One component on the device at a time: the largest sets the peak."""
    return {max(sizes, key=lambda c: sizes[c]): 1.0} if sizes else {}


def _holds_none(_sizes: Mapping[str, float], _denoiser: str) -> dict[str, float]:
    return {}


def _place_resident(loaded: Placeable, target: torch.device, _streams: bool) -> None:
    loaded.pipe.to(target)


def _place_partial(loaded: Placeable, target: torch.device, streams: bool) -> None:
    from worker.memory.partial import place_partial

    assert loaded.partial is not None, "rung partial is placed with its split"
    place_partial(loaded.pipe, loaded.denoiser, loaded.partial, target, streams)


def _place_model_offload(loaded: Placeable, target: torch.device, _streams: bool) -> None:
    loaded.pipe.enable_model_cpu_offload(device=target)


def _beside_resident(module: torch.nn.Module, target: torch.device) -> None:
    module.to(target)


def _beside_on_host(module: torch.nn.Module, _target: torch.device, _streams: bool) -> None:
    module.to("cpu")  # onloaded while it runs (RungSpec.onloaded)


def _beside_group_offload(module: torch.nn.Module, target: torch.device, streams: bool) -> None:
    import torch
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(  # any module: a ControlNet, the IP-Adapter with its image encoder
        module,
        onload_device=target,
        offload_device=torch.device("cpu"),
        offload_type="leaf_level",
        use_stream=streams,
        non_blocking=streams,
    )


def _place_group_offload(loaded: Placeable, target: torch.device, streams: bool) -> None:
    import torch

    loaded.pipe.enable_group_offload(
        onload_device=target,
        offload_device=torch.device("cpu"),
        offload_type="leaf_level",
        use_stream=streams,
        non_blocking=streams,
    )


# The ladder, best first. partial's default share is its least (one block resident) before a
# load measures the blocks: the denoiser's blocks are most of a model's weights; a real split
# keeps more where they fit.
TABLE: tuple[RungSpec, ...] = (
    RungSpec(
        "full",
        default_share=1.0,
        holds=_holds_all,
        place=_place_resident,
        compiles=True,
        tiles_vae=False,
        peak_weights=lambda weights, _largest: weights,
    ),
    RungSpec(
        "partial",
        default_share=0.8,
        holds=_holds_partial,
        place=_place_partial,
        splits=True,
        pinned_streams=True,
        note="as many denoiser blocks resident as fit (counted from the loaded blocks' bytes),"
        " the rest streamed at leaf level, {streams}",
    ),
    RungSpec(
        "model_offload",
        default_share=0.6,
        holds=_holds_largest,
        place=_place_model_offload,
        peak_weights=lambda _weights, largest: largest,
        onloads=True,
        place_beside=_beside_on_host,
    ),
    RungSpec(
        "group_offload",
        default_share=0.25,
        holds=_holds_none,
        place=_place_group_offload,
        pinned_streams=True,
        peak_weights=lambda _weights, _largest: 0,
        place_beside=_beside_group_offload,
        beside_share=0.0,
        note="leaf level, {streams}",
    ),
)


def walk() -> tuple[RungSpec, ...]:
    """Every row, best first (read at each call, so a table patched in a test is walked)."""
    return TABLE


def names() -> tuple[Rung, ...]:
    return tuple(row.name for row in TABLE)


def rung_spec(name: str) -> RungSpec:
    """The row of a rung; ValueError naming the rungs there are."""
    for row in TABLE:
        if row.name == name:
            return row
    raise ValueError(f"rung {name!r} is not on the ladder; rungs: {', '.join(names())}")


def lowest() -> RungSpec:
    return TABLE[-1]


def compiling() -> str:
    """The rungs whose row compiles, for a reason's text ("full")."""
    return ", ".join(row.name for row in TABLE if row.compiles)
