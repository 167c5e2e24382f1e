"""The memory ladder: rungs best first, the choice of a rung from free memory, and descent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from api_client.manifest import Manifest
from api_client.schema import RUNGS

Rung = Literal["full", "model_offload", "group_offload"]
GB = 1e9
# Allocation failures that do not come as torch.OutOfMemoryError: cuBLAS/cuDNN workspaces, HIP.
_OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")


def is_oom(exc: BaseException) -> bool:
    """Whether exc is the recoverable failure the ladder answers by freeing memory or descending."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MARKERS)


def oom_detail(exc: BaseException) -> str:
    """The first line of the error, short enough for a result's attempts list."""
    text = str(exc)
    return text.splitlines()[0][:300] if text else "out of memory"


def lower_rung(rung: Rung) -> Rung | None:
    index = RUNGS.index(rung)
    return cast(Rung, RUNGS[index + 1]) if index + 1 < len(RUNGS) else None


def rung_need_gb(manifest: Manifest, rung: Rung) -> float:
    """Memory a rung needs: min_vram_gb for full; rung_vram_gb, else a conservative share of it."""
    if rung == "full":
        return manifest.min_vram_gb
    default_share = {"model_offload": 0.6, "group_offload": 0.25}[rung]
    return manifest.rung_vram_gb.get(rung, manifest.min_vram_gb * default_share)


@dataclass(frozen=True)
class RungChoice:
    rung: Rung
    reason: str


def usable_gb(
    free_bytes: int,
    reclaimable_bytes: int,
    reserve_gb: float,
    budget_gb: float | None,
    in_use_bytes: int,
) -> float:
    """Free memory kiln may plan with: free + what evicting others would free, minus the reserve,
    capped so kiln's own use (what stays resident) never passes the budget."""
    usable = (free_bytes + reclaimable_bytes) / GB - reserve_gb
    if budget_gb is not None:
        usable = min(usable, budget_gb - (in_use_bytes - reclaimable_bytes) / GB)
    return max(usable, 0.0)


def pick_rung(manifest: Manifest, usable: float, mode: str) -> RungChoice:
    """A pinned mode is used as is; auto takes the best rung whose need fits, else the lowest."""
    if mode != "auto":
        return RungChoice(cast(Rung, mode), f"pinned by KILN_MEMORY_MODE={mode}")
    for rung in cast(tuple[Rung, ...], RUNGS):
        need = rung_need_gb(manifest, rung)
        if need <= usable:
            return RungChoice(rung, f"needs {need:.2f} GB, {usable:.2f} GB usable")
    lowest = cast(Rung, RUNGS[-1])
    return RungChoice(
        lowest,
        f"no rung fits {usable:.2f} GB usable; trying {lowest} anyway (estimates are conservative)",
    )


@dataclass
class RungMemory:
    """The rung that last worked per (model, width, height), so the next job starts there."""

    _worked: dict[tuple[str, int, int], Rung] = field(default_factory=dict)

    def get(self, model_id: str, width: int, height: int) -> Rung | None:
        return self._worked.get((model_id, width, height))

    def remember(self, model_id: str, width: int, height: int, rung: Rung) -> None:
        self._worked[(model_id, width, height)] = rung
