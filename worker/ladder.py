"""The memory ladder: rungs best first, the choice of a rung from free memory, and the
out-of-memory rules (Ladder) that the renderer and `kiln doctor` both follow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from api_client.manifest import Manifest
from api_client.schema import RUNGS, Attempt, Rung
from worker.errors import OutOfMemory

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
    return RUNGS[index + 1] if index + 1 < len(RUNGS) else None


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
    for rung in RUNGS:
        if mode == rung:
            return RungChoice(rung, f"pinned by KILN_MEMORY_MODE={mode}")
    for rung in RUNGS:
        need = rung_need_gb(manifest, rung)
        if need <= usable:
            return RungChoice(rung, f"needs {need:.2f} GB, {usable:.2f} GB usable")
    lowest = RUNGS[-1]
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


class OnRung(Protocol):
    rung: Rung


Loaded = TypeVar("Loaded", bound=OnRung)
T = TypeVar("T")


class Ladder:
    """The out-of-memory rules, in one place for every caller.

    - Loading: an OOM frees everything else; auto descends one rung and loads again, down to the
      last rung; a pinned mode (KILN_MEMORY_MODE=<rung>) retries once on its rung.
    - Generating: the exception is dropped first (its frames hold tensors), memory is freed and
      other pipelines evicted, then one retry on the same rung; if that fails too, auto descends
      one rung, reloads and retries once more; a pinned mode never descends.
    Each failed try is an Attempt (the caller's list, so results and records show them); when no
    rule is left, OutOfMemory names the model, the rung, why the ladder stopped and the attempts.
    """

    def __init__(self, model_id: str, mode: str, attempts: list[Attempt]) -> None:
        self.model_id = model_id
        self.mode = mode
        self.attempts = attempts

    @property
    def pinned(self) -> bool:
        return self.mode != "auto"

    def load(self, rung: Rung, load: Callable[[Rung], T], reclaim: Callable[[], None]) -> T:
        """load(rung) under the loading rules; reclaim() frees memory after each OOM."""
        retried = False
        while True:
            try:
                return load(rung)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                detail = oom_detail(exc)
            # Outside the except block: the half-built pipeline died with the exception.
            self.attempts.append(Attempt(rung=rung, outcome="oom", phase="load", detail=detail))
            reclaim()
            if self.pinned and not retried:
                retried = True
                continue
            lower = None if self.pinned else lower_rung(rung)
            if lower is None:
                raise OutOfMemory(self._message(rung, "loading"))
            rung = lower

    def generate(
        self,
        loaded: Loaded,
        run: Callable[[Loaded], T],
        reclaim: Callable[[], None],
        reload: Callable[[Rung], Loaded],
        phase: Callable[[], str | None],
    ) -> T:
        """run(loaded) under the generating rules; reload(rung) brings the model back one rung
        lower; phase() names where the failed try stopped."""
        retried = descended = False
        while True:
            try:
                result = run(loaded)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                detail = oom_detail(exc)
            else:
                self.attempts.append(Attempt(rung=loaded.rung, outcome="ok"))
                return result
            self.attempts.append(
                Attempt(rung=loaded.rung, outcome="oom", phase=phase(), detail=detail)
            )
            reclaim()
            if not retried:
                retried = True
                continue
            lower = lower_rung(loaded.rung)
            if self.pinned or descended or lower is None:
                raise OutOfMemory(self._message(loaded.rung, "generating"))
            descended = True
            loaded = reload(lower)

    def _message(self, rung: Rung, when: str) -> str:
        if self.pinned:
            how = f"pinned by KILN_MEMORY_MODE={self.mode}"
        else:
            how = "no lower rung left" if lower_rung(rung) is None else "descended once already"
        tried = ", ".join(f"{a.rung}:{a.outcome}@{a.phase or '-'}" for a in self.attempts)
        return (
            f"model {self.model_id} ran out of memory while {when} at rung {rung} ({how}); "
            f"no retries left; attempts: {tried}"
        )
