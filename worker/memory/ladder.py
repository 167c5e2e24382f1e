"""The memory ladder: the walk down the rung table (worker.memory.rungs), the choice of a rung
from free memory, and the out-of-memory rules (Ladder) that the renderer and `kiln doctor` both
follow. What each rung holds and how its need is estimated are its row's; the arithmetic that
adds them up (Fit), the choice and the rules (loading, generating, decoding) are one policy,
read together. Over 400 lines because of that: one policy, one module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from api_client.manifest import Manifest
from api_client.schema import Attempt, Rung
from worker.errors import OutOfMemory
from worker.memory import rungs

GB = 1e9
# Allocation failures that do not come as torch.OutOfMemoryError: cuBLAS/cuDNN workspaces, HIP.
_OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE")


def is_oom(exc: BaseException) -> bool:
    """Whether exc is the recoverable failure the ladder answers by freeing memory or descending
    (not OutOfMemory: that is the ladder's own verdict that no rule is left)."""
    if isinstance(exc, OutOfMemory):
        return False
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MARKERS)


def oom_detail(exc: BaseException) -> str:
    """The first line of the error, short enough for a result's attempts list."""
    text = str(exc)
    return text.splitlines()[0][:300] if text else "out of memory"


def lower_rung(rung: Rung) -> Rung | None:
    order = rungs.names()
    index = order.index(rung)
    return order[index + 1] if index + 1 < len(order) else None


# Bytes a quantized weight keeps per byte of its 16-bit original.
SIZE_VS_16BIT: dict[str, float] = {"float8": 0.5, "int8": 0.5, "int8_dynamic": 0.5, "int4": 0.25}


@dataclass(frozen=True)
class Fit:
    """How a model's weights sit on a card: in fp32 (twice the 16-bit bytes: sd3 or FLUX on a
    T4, which has no bf16 and must not run them in fp16) and with these components quantized."""

    fp32: bool = False
    quantized: Mapping[str, str] = field(default_factory=dict)  # component -> scheme applied
    # GB per rung measured on this card kind for the job's shape (worker.memory.peaks), margin
    # included; a rung named here plans with it instead of the manifest's figures.
    measured: Mapping[str, float] = field(default_factory=dict)
    denoiser: str = "unet"  # the component partial streams (the family's FamilySpec.denoiser)
    # 16-bit GB of the models a job loads beside the pipeline (its ControlNets), counted at the
    # rungs whose row holds them on the device through the denoise (RungSpec.beside_share).
    beside_gb: float = 0.0


def rung_need_gb(manifest: Manifest, rung: Rung, fit: Fit = Fit()) -> float:
    """Memory a rung needs on a card: what this card kind measured for the job's shape when it
    has (fit.measured), else from the manifest's 16-bit figures: min_vram_gb for full,
    rung_vram_gb (else the row's default_share of min_vram_gb) below it, twice that in fp32.

    With component_gb, the figures are split into the weights a rung holds on the device (its
    row's holds: every component at full, the largest one at model_offload, ...) and the working
    memory beside them; each held component at its own size (quantized: the scheme's bytes),
    the rest scaled for fp32; a job's ControlNets (fit.beside_gb) where the row holds them."""
    if rung in fit.measured:
        return fit.measured[rung]
    row = rungs.rung_spec(rung)
    scale = 2.0 if fit.fp32 else 1.0
    beside = fit.beside_gb * row.beside_share * scale  # a job's ControlNets, where held
    # full has no rung_vram_gb entry (the manifest refuses one): min_vram_gb is its figure.
    declared = manifest.rung_vram_gb.get(rung, manifest.min_vram_gb * row.default_share)
    sizes = manifest.component_gb
    if not sizes:
        return declared * scale + beside
    held = row.holds(sizes, fit.denoiser)
    working = max(declared - sum(sizes[c] * share for c, share in held.items()), 0.0)
    weights = sum(
        sizes[c] * share * (SIZE_VS_16BIT[fit.quantized[c]] if c in fit.quantized else scale)
        for c, share in held.items()
    )
    return working * scale + weights + beside


@dataclass(frozen=True)
class RungChoice:
    rung: Rung
    reason: str
    usable_gb: float | None = None  # what the choice planned with, when it looked at memory
    measured: bool = False  # the rung's need came from this card kind's measurements
    # full's need from those measurements, if any: what the partial rung splits its blocks by.
    full_need_gb: float | None = None


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


def pick_rung(manifest: Manifest, usable: float, mode: str, fit: Fit = Fit()) -> RungChoice:
    """A pinned mode is used as is; auto takes the best rung whose need fits, else the lowest."""
    order = rungs.names()
    for rung in order:
        if mode == rung:
            return RungChoice(rung, f"pinned by KILN_MEMORY_MODE={mode}")
    for rung in order:
        need = rung_need_gb(manifest, rung, fit)
        if need <= usable:
            return RungChoice(rung, f"needs {need:.2f} GB, {usable:.2f} GB usable")
    lowest = order[-1]
    return RungChoice(
        lowest,
        f"no rung fits {usable:.2f} GB usable; trying {lowest} anyway (estimates are conservative)",
    )


def rung_rank(rung: Rung) -> int:
    """0 for full; larger is lower on the ladder (less memory, slower)."""
    return rungs.names().index(rung)


@dataclass
class Ceiling:
    """The highest rung that worked at one size after a higher rung ran out of memory."""

    rung: Rung
    usable_gb: float  # what the model could plan with when the higher rung failed
    clean_jobs: int = 0  # jobs at this size since, none of them out of memory


# A job's size as the ladder remembers it: (width, height, frames), frames 0 for an image job.
Size = tuple[int, int, int]


def size_text(size: Size) -> str:
    width, height, frames = size
    return f"{width}x{height}" + (f"x{frames}f" if frames else "")


@dataclass
class RungMemory:
    """Per (model, width, height, frames), the rung a size was pushed down to by an out-of-memory
    error: a 33-frame video's ceiling is not a 9-frame one's at the same width and height.

    A ceiling is forgotten, so the next job at that size tries higher again, after
    `forget_after` clean jobs at that size, or when the memory the model may plan with has
    grown by `grown_gb` since the failure (another model evicted, a budget raised). A job that
    succeeds higher than its ceiling (the resident rung was higher) lifts it at once.
    """

    forget_after: int = 50
    grown_gb: float = 1.0
    _ceilings: dict[tuple[str, Size], Ceiling] = field(default_factory=dict)

    def get(self, model_id: str, size: Size, usable_gb: float | None = None) -> Rung | None:
        key = (model_id, size)
        ceiling = self._ceilings.get(key)
        if ceiling is None:
            return None
        if usable_gb is not None and usable_gb >= ceiling.usable_gb + self.grown_gb:
            del self._ceilings[key]
            return None
        return ceiling.rung

    def ceilings(self, model_id: str) -> dict[Size, Rung]:
        """Every size of this model held below the top of the ladder, with its ceiling."""
        return {size: c.rung for (m, size), c in self._ceilings.items() if m == model_id}

    def remember(
        self,
        model_id: str,
        size: Size,
        rung: Rung,
        *,
        pushed_down: bool = True,
        usable_gb: float = 0.0,
    ) -> None:
        """A job at this size succeeded at rung; pushed_down when a higher rung failed first."""
        key = (model_id, size)
        if pushed_down:
            self._ceilings[key] = Ceiling(rung, usable_gb)
            return
        ceiling = self._ceilings.get(key)
        if ceiling is None:
            return
        ceiling.clean_jobs += 1
        if rung_rank(rung) < rung_rank(ceiling.rung) or ceiling.clean_jobs >= self.forget_after:
            del self._ceilings[key]


def choose_rung(
    manifest: Manifest,
    resident: _Resident | None,
    ceiling: Rung | None,
    ceilings: dict[Size, Rung],
    usable: float,
    fit: Fit = Fit(),
) -> RungChoice:
    """Auto mode, for one job: its size's ceiling (a rung an OOM pushed it down to) or the
    estimate, weighed against the rung the model is resident at, so that sizes with different
    ceilings do not reload the model at each switch:

    - at or below the ceiling, the resident rung is kept (a lower rung needs less memory);
    - without a ceiling, a resident rung below the estimate is kept while some size of this
      model still has a ceiling at or below it, and otherwise the model goes back up;
    - a resident rung above the estimate is kept (it has worked; an OOM would push it down).
    """
    if ceiling is not None:
        if resident is not None and rung_rank(resident.rung) >= rung_rank(ceiling):
            why = f"resident at {resident.rung}, at or below this size's remembered {ceiling}"
            return RungChoice(resident.rung, f"remembered: {why}", usable)
        return RungChoice(ceiling, "remembered: worked after an OOM at this model and size", usable)
    estimate = pick_rung(manifest, usable, "auto", fit)
    estimate = RungChoice(estimate.rung, estimate.reason, usable)
    if resident is None:
        return estimate
    if rung_rank(resident.rung) <= rung_rank(estimate.rung):
        return RungChoice(resident.rung, "already resident", usable)
    held = [
        size_text(size) for size, r in ceilings.items() if rung_rank(r) >= rung_rank(resident.rung)
    ]
    if held:
        why = f"already resident at {resident.rung}: {', '.join(held)} remembered at or below it"
        return RungChoice(resident.rung, why, usable)
    return RungChoice(
        estimate.rung,
        f"back up from {resident.rung}: no size remembers a lower rung; {estimate.reason}",
        usable,
    )


class _Resident(Protocol):
    @property
    def rung(self) -> Rung: ...


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
    - Decoding (decode(), inside a generating try): the denoised latents are kept and the decode
      alone is retried, tiled on the same rung, then (auto) tiled one rung lower, reloaded.
    Each failed try is an Attempt (the caller's list, so results and records show them); when no
    rule is left, OutOfMemory names the model, the rung, why the ladder stopped and the attempts.
    """

    def __init__(self, model_id: str, mode: str, attempts: list[Attempt]) -> None:
        self.model_id = model_id
        self.mode = mode
        self.attempts = attempts
        self._decode_recorded = False  # decode() appended how the current try ended

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
            self._decode_recorded = False
            try:
                result = run(loaded)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                detail = oom_detail(exc)
            else:
                if not self._decode_recorded:
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

    def decode(
        self,
        loaded: Loaded,
        run: Callable[[Loaded, bool], tuple[T, str]],
        reclaim: Callable[[], None],
        reload: Callable[[Rung], Loaded],
    ) -> tuple[T, Loaded]:
        """run(loaded, tiled) decodes the latents it holds and says how ("tiled and sliced").
        Out of memory there keeps them: free memory and decode again tiled; if that fails too,
        auto reloads one rung lower (the VAE placed as that rung places it) and decodes tiled
        there, so the text encode and the denoise never run twice; a pinned mode fails. Returns
        the result and the pipeline it was decoded on; a retried success is the try's ok attempt,
        its detail saying how it got there."""
        done = self._decode_once(loaded, run, tiled=False)
        if done is not None:
            return done[0], loaded
        reclaim()  # outside the except block: the failed decode's tensors died with it
        done = self._decode_once(loaded, run, tiled=True)
        if done is not None:
            return self._decoded(loaded, done, f"decode retried {done[1]}")
        reclaim()
        lower = None if self.pinned else lower_rung(loaded.rung)
        if lower is None:
            raise OutOfMemory(self._message(loaded.rung, "decoding"))
        lowered = reload(lower)
        done = self._decode_once(lowered, run, tiled=True)
        if done is None:
            raise OutOfMemory(self._message(lowered.rung, "decoding"))
        return self._decoded(lowered, done, f"decode retried {done[1]} one rung lower, at {lower}")

    def _decode_once(
        self, loaded: Loaded, run: Callable[[Loaded, bool], tuple[T, str]], tiled: bool
    ) -> tuple[T, str] | None:
        """run's result, or None after an out-of-memory attempt (the latents are kept)."""
        try:
            return run(loaded, tiled)
        except Exception as exc:
            if not is_oom(exc):
                raise
            detail = oom_detail(exc)
        how = "tiled decode" if tiled else "decode"
        self.attempts.append(
            Attempt(rung=loaded.rung, outcome="oom", phase="decode", detail=f"{how}: {detail}")
        )
        return None

    def _decoded(self, on: Loaded, done: tuple[T, str], how: str) -> tuple[T, Loaded]:
        note = f"{how}; latents kept, text encode and denoise not run again"
        self.attempts.append(Attempt(rung=on.rung, outcome="ok", phase="decode", detail=note))
        self._decode_recorded = True
        return done[0], on

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
