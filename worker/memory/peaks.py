"""Placement from kiln's own measurements: the memory every job took, per card kind and job shape
(model, size, dtype, quantization, mode, a video's frames) and rung, shared through Redis
(kiln:peaks) so the next worker on the same kind of card starts informed, and turned into each
rung's need.

A job's measurement is two numbers: what its pipeline held on the device at that rung (measured
at load: allocated after minus before) and what the job added on top (its peak minus what was
allocated when it started). Together they are the rung's need. A rung not measured is derived
from one that was: the job's working memory beside the weights a rung holds (its row's
peak_weights in worker.memory.rungs: all of them at full, the largest component at
model_offload, none at group_offload), weights counted from the loaded modules themselves.
Needs are planned with MARGIN on top. On a CPU, "device" memory is the process's resident set
(its peak read from VmHWM), so the numbers are real but include the allocator's slack.

Clients can write kiln:peaks too. A figure no card could hold (PLAUSIBLE_GB) is ignored, and the
book is read again (at most every REREAD_S) each time the memory gate asks, so a forged or stale
figure deleted from Redis stops blocking a worker that already read it.

Over 400 lines because the book's keys (a video's frames among them), its reading and writing
and the fit between frame counts are one record of what a model needed, read together."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from worker.memory import rungs
from worker.profiles import GIB, PROFILES

log = logging.getLogger(__name__)

KEY = "kiln:peaks"  # hash: "<card>|<shape>|<rung>" -> Peak JSON; bounded by models x sizes x rungs
MARGIN = 0.15  # needs are planned 15 % above what was measured: one job's peak is not the worst
GB = 1e9  # the ladder's unit (worker.memory.ladder.GB): needs are compared with its usable GB
# No measurement can exceed the memory of the card it was taken on. The largest card kiln knows
# (worker/profiles.py: MI300X, 192 GiB) times four leaves room for cards newer than the table,
# and for a CPU worker, whose "device" memory is its resident set: 768 GiB. A figure above it
# (a forged petabyte) is no card's, and is ignored.
PLAUSIBLE_GB = 4 * max(p.total_gib for p in PROFILES.values()) * GIB / GB
REREAD_S = 5.0  # the memory gate's question reads kiln:peaks again at most this often
SKIPPED_MAX = 1000  # ignored fields remembered as logged; past it they are logged again
FRAMES = "|frames="  # a video shape's last part: "<shape>|frames=<n>"


class Peak(BaseModel):
    """One (card, shape, rung)'s measurements, the largest seen."""

    resident_bytes: int  # the pipeline's own device memory at this rung, measured at load
    working_bytes: int  # the most a job added on top of what was allocated when it started
    weights_bytes: int  # every component's parameters and buffers, as loaded
    largest_bytes: int  # the largest component's
    jobs: int = 1
    # The most usable memory this rung ran out of memory with: its need is above it.
    oom_above_gb: float | None = None

    @property
    def need_bytes(self) -> int:
        return self.resident_bytes + self.working_bytes


@dataclass(frozen=True)
class Shape:
    """What a job's memory depends on besides the rung."""

    model: str
    width: int
    height: int
    dtype: str
    quantized: tuple[tuple[str, str], ...]
    mode: str
    # A step cache keeps a residual per context (a latent's size each) beside the activations.
    step_cache: bool = False
    # The ControlNets loaded beside it (their sources, sorted): their weights and activations.
    controls: tuple[str, ...] = ()
    reference: bool = False  # an IP-Adapter beside it: its weights and the image encoder's pass
    hires: str = ""  # a hires pass's final size ("256x256"): its second pass's activations
    # A video job's frame count (0 for an image job): its latents, activations and decoded
    # frames grow with it. Last in the field, so the other frame counts of a shape are found.
    frames: int = 0

    @property
    def field(self) -> str:
        quant = ",".join(f"{c}={s}" for c, s in self.quantized) or "none"
        # Absent when unused: the fields written before these existed read the same.
        cached = "|step_cache" if self.step_cache else ""
        control = f"|controls={','.join(self.controls)}" if self.controls else ""
        control += "|reference" if self.reference else ""
        hires = f"|hires={self.hires}" if self.hires else ""
        frames = f"{FRAMES}{self.frames}" if self.frames else ""
        return (
            f"{self.model}|{self.width}x{self.height}|{self.dtype}|{quant}|{self.mode}"
            f"{cached}{control}{hires}{frames}"
        )


@dataclass
class PeakBook:
    """This worker's view of kiln:peaks for its card kind, read at start and again by refresh(),
    written through. Its own measurements are kept apart too: a refresh never loses them."""

    connection: Any  # Redis, or None: measurements kept in this process only
    card: str
    peaks: dict[str, Peak] = field(default_factory=dict)  # "<shape>|<rung>" -> Peak
    own: dict[str, Peak] = field(default_factory=dict)  # what this process measured
    read_at: float | None = None  # time.monotonic() of the last read
    skipped: set[tuple[str, bytes]] = field(default_factory=set, init=False, repr=False)

    def read(self) -> None:
        """Every measurement workers on this card kind made (HSCAN), over this process's own:
        the book becomes what Redis holds now, so a field deleted there is gone here."""
        self.read_at = time.monotonic()
        if self.connection is None:
            return
        prefix = f"{self.card}|"
        found: dict[str, Peak] = {}
        try:
            for raw_name, value in self.connection.hscan_iter(
                KEY, match=f"{_glob(prefix)}*", count=1000
            ):
                name = _text(raw_name)
                peak = self._readable(name, value)
                if peak is not None:
                    found[name[len(prefix) :]] = peak
        except Exception as exc:  # Redis down: plan from what this book already holds
            log.warning("kiln:peaks unreadable (%s): planning from what was read before", exc)
            return
        for key, peak in self.own.items():
            known = found.get(key)
            if known is None or peak.need_bytes > known.need_bytes:
                found[key] = peak
        self.peaks = found

    def refresh(self) -> None:
        """read() again when the last read is REREAD_S old: one HSCAN every few seconds at most."""
        if self.read_at is None or time.monotonic() - self.read_at >= REREAD_S:
            self.read()

    def _readable(self, name: str, value: bytes | str) -> Peak | None:
        """The field's Peak; None (logged once per field and value) when it is no measurement
        or holds a figure no card could (negative, or above PLAUSIBLE_GB)."""
        try:
            peak = Peak.model_validate_json(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "value"
            self._skip(name, value, f"not a measurement ({where}: {first['msg']})")
            return None
        why = implausible(peak)
        if why is not None:
            self._skip(name, value, why)
            return None
        return peak

    def _skip(self, name: str, value: bytes | str, why: str) -> None:
        seen = (name, value if isinstance(value, bytes) else value.encode())
        if seen in self.skipped:
            return
        if len(self.skipped) >= SKIPPED_MAX:
            self.skipped.clear()
        self.skipped.add(seen)
        log.warning("%s field %r ignored: %s", KEY, name[:200], why)

    def observe(self, shape: Shape, rung: str, measured: Peak) -> Peak:
        """Keep the largest of this and what was known; write it through when it grew."""
        key = f"{shape.field}|{rung}"
        known = self.peaks.get(key)
        if known is not None:
            measured = Peak(
                resident_bytes=max(known.resident_bytes, measured.resident_bytes),
                working_bytes=max(known.working_bytes, measured.working_bytes),
                weights_bytes=measured.weights_bytes or known.weights_bytes,
                largest_bytes=measured.largest_bytes or known.largest_bytes,
                jobs=known.jobs + measured.jobs,
                oom_above_gb=_larger(known.oom_above_gb, measured.oom_above_gb),
            )
        self.peaks[key] = measured
        self.own[key] = measured
        grew = (
            known is None
            or measured.need_bytes > known.need_bytes * 1.05
            or measured.oom_above_gb != known.oom_above_gb
        )
        if grew and self.connection is not None:
            try:
                self.connection.hset(KEY, f"{self.card}|{key}", measured.model_dump_json())
            except Exception as exc:
                log.warning("kiln:peaks not written (%s): kept in this worker", exc)
        return measured

    def observe_oom(self, shape: Shape, rung: str, usable_gb: float) -> None:
        """A rung ran out of memory with usable_gb to plan with: a floor under its need."""
        floor = Peak(
            resident_bytes=0,
            working_bytes=0,
            weights_bytes=0,
            largest_bytes=0,
            jobs=0,
            oom_above_gb=usable_gb,
        )
        self.observe(shape, rung, floor)

    def needs_gb(self, shape: Shape) -> dict[str, float]:
        """Each rung's need in GB for this shape, margin included, where anything is measured.
        A video shape's rung not measured at its frame count is fitted from the counts that
        were (by_frames)."""
        measured = self.measured(shape.field)
        if shape.frames:
            base = dataclasses.replace(shape, frames=0).field
            for rung in rungs.names():
                if rung not in measured:
                    fitted = by_frames(self._frame_counts(base, rung), shape.frames)
                    if fitted is not None:
                        measured[rung] = fitted
        return needs_from(measured)

    def _frame_counts(self, base: str, rung: str) -> dict[int, Peak]:
        """Frame count -> what was measured at this rung for the video shape base (no frames)."""
        found: dict[int, Peak] = {}
        prefix, suffix = f"{base}{FRAMES}", f"|{rung}"
        for key, peak in self.peaks.items():
            count = key[len(prefix) : -len(suffix)]
            if key.startswith(prefix) and key.endswith(suffix) and count.isdigit():
                found[int(count)] = peak
        return found

    def measured(self, shape: str) -> dict[str, Peak]:
        """Rung -> what was measured for this shape ("<model>|<WxH>|...")."""
        found: dict[str, Peak] = {}
        for rung in rungs.names():
            if (peak := self.peaks.get(f"{shape}|{rung}")) is not None:
                found[rung] = peak
        return found


def implausible(peak: Peak) -> str | None:
    """Why no card could have measured this (a figure below 0 or above PLAUSIBLE_GB); None
    when every figure could be real."""
    figures = {
        "resident_bytes": peak.resident_bytes / GB,
        "working_bytes": peak.working_bytes / GB,
        "weights_bytes": peak.weights_bytes / GB,
        "largest_bytes": peak.largest_bytes / GB,
        "need (resident + working)": peak.need_bytes / GB,
        "oom_above_gb": peak.oom_above_gb or 0.0,
    }
    for name, gb in figures.items():
        if not math.isfinite(gb) or not 0 <= gb <= PLAUSIBLE_GB:
            return f"{name} is {gb:.4g} GB; a real card's figures lie in 0..{PLAUSIBLE_GB:.0f} GB"
    if peak.jobs < 0:
        return f"jobs is {peak.jobs}; a count is never negative"
    return None


def lowest_need_gb(book: PeakBook, model: str) -> float | None:
    """The least any measured shape of this model needs at the ladder's lowest rung; None when
    none is measured (a static estimate is tried anyway). The memory gate asks this before every
    pop: the book is refreshed first, so what blocks a worker is what Redis holds now."""
    book.refresh()
    shapes = {key.rpartition("|")[0] for key in book.peaks if key.startswith(f"{model}|")}
    lowest = rungs.lowest().name
    found = []
    for shape in shapes:
        need = needs_from(book.measured(shape)).get(lowest)
        if need is not None:
            found.append(need)
    return min(found, default=None)


def by_frames(measured: dict[int, Peak], frames: int) -> Peak | None:
    """A rung's peak at a frame count not measured, from the counts that were (frames -> Peak).

    A video job's working memory grows about linearly with its frames: the latents, the
    denoiser's activations (its tokens are latent frames x cells; SDPA's flash and
    memory-efficient kernels keep attention linear in them) and the decoded frames; Wan's VAE
    decodes one latent frame at a time and LTX's tiles in time after an out of memory. What the
    pipeline holds (resident_bytes) does not change with frames. So, never below the truth of
    a line a + b x frames with a >= 0: between two measured counts, the line through them; above
    the largest, its working memory scaled by frames over its count (the line through the
    origin, above any such line there); below the smallest, the smallest as it is (fewer frames
    never need more). An out-of-memory floor measured at a count at or under frames holds too.
    None when no count was measured with a job. The job's own measurement replaces the fit."""
    floors = [p.oom_above_gb for n, p in measured.items() if n <= frames and p.oom_above_gb]
    sized = {n: p for n, p in measured.items() if p.jobs}
    below = max((n for n in sized if n < frames), default=None)
    above = min((n for n in sized if n > frames), default=None)
    if below is None and above is None:
        return None
    if below is not None and above is not None:
        low, high = sized[below], sized[above]
        share = (frames - below) / (above - below)
        working = low.working_bytes + share * (high.working_bytes - low.working_bytes)
        held = max(low, high, key=lambda p: p.resident_bytes)
    elif below is not None:
        held = sized[below]
        working = held.working_bytes * frames / below
    else:
        assert above is not None
        held = sized[above]
        working = held.working_bytes
    return held.model_copy(
        update={
            "working_bytes": math.ceil(working),
            "oom_above_gb": max(floors, default=None),
        }
    )


def needs_from(measured: dict[str, Peak]) -> dict[str, float]:
    """Rung -> GB from the rungs measured: a measured rung as measured, the others from the
    working memory one of them showed beside the weights each rung holds."""
    sized = [p for p in measured.values() if p.jobs]
    if not measured:
        return {}
    any_peak = sized[0] if sized else next(iter(measured.values()))
    working = _working({r: p for r, p in measured.items() if p.jobs})
    needs: dict[str, float] = {}
    for row in rungs.walk():
        rung, held = row.name, row.peak_weights
        peak = measured.get(rung)
        if peak is not None and peak.jobs:
            need = peak.need_bytes
        elif held is not None and working:
            need = held(any_peak.weights_bytes, any_peak.largest_bytes) + working
        else:
            need = 0  # a rung with no rule of its own here plans from the manifest
        gb = need * (1 + MARGIN) / GB
        if peak is not None and peak.oom_above_gb is not None:
            gb = max(gb, peak.oom_above_gb * (1 + MARGIN))
        if gb:
            needs[rung] = gb
    return needs


def _larger(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _working(measured: dict[str, Peak]) -> int:
    """The job's own memory: what it added at a rung whose peak weights are placed before it
    (full, group_offload), else what it added less the weights it brought onto the device
    (model_offload's largest component)."""
    rows = [r for r in rungs.walk() if r.name in measured and r.peak_weights is not None]
    if not rows:
        return max((p.working_bytes for p in measured.values()), default=0)
    row = min(rows, key=lambda r: r.onloads)  # the best such rung: min keeps the first of equals
    peak, held = measured[row.name], row.peak_weights
    onloaded = held(peak.weights_bytes, peak.largest_bytes) if row.onloads and held else 0
    return max(peak.working_bytes - onloaded, 0)


def component_bytes(pipe: Any) -> tuple[int, int]:
    """(all components', the largest one's) parameter and buffer bytes, as loaded."""
    import torch

    sizes = [
        module_bytes(component)
        for component in pipe.components.values()
        if isinstance(component, torch.nn.Module)
    ]
    return sum(sizes), max(sizes, default=0)


def module_bytes(module: Any) -> int:
    """One module's parameter and buffer bytes."""
    tensors = (*module.parameters(), *module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _glob(text: str) -> str:
    """Escape Redis MATCH's glob characters in a card name."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def card_kind(name: str, simulated: str | None) -> str:
    """Whose measurements these are: a card by its name; a profile's decisions on another
    device under both names, so a CPU drill never feeds a real card's plans."""
    return name if simulated is None else f"{name} as {simulated}"


WRONG_BY = 0.20  # a declared figure this far from the measured one is reported by kiln doctor


@dataclass(frozen=True)
class Comparison:
    """One measured rung of one shape beside what the manifest declares for it."""

    shape: str  # model|WxH|dtype|quantization|mode
    rung: str
    jobs: int
    measured_gb: float
    declared_gb: float

    @property
    def off(self) -> float:
        """How far the declared figure is from the measured one, as a share of the measured."""
        return (self.declared_gb - self.measured_gb) / self.measured_gb

    @property
    def wrong(self) -> bool:
        return abs(self.off) > WRONG_BY


def comparisons(book: PeakBook, declared: Callable[[str, str], float | None]) -> list[Comparison]:
    """Every measured (shape, rung) of the book; declared(model, rung) gives the manifest's need
    in GB, None for a model this worker does not know."""
    found = []
    for key, peak in sorted(book.peaks.items()):
        shape, _, rung = key.rpartition("|")
        wanted = declared(shape.split("|", 1)[0], rung)
        if not peak.jobs or wanted is None or not peak.need_bytes:
            continue
        found.append(Comparison(shape, rung, peak.jobs, peak.need_bytes / GB, wanted))
    return found
