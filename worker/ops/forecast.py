"""How long renders take by the timing fits (seconds = fixed + steps x per_step, per image):
`kiln bench` says it before it starts, from the fits workers publish in kiln:fits, and again as
it measures its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from api_client.schema import TimingFit
from worker.render.timings import FitTracker, TimingRecord

FitKey = tuple[str, int, int]  # model, width, height: a kiln:fits field


class Cell(Protocol):
    """A bench matrix cell, as far as fits go: the settings its renders run with."""

    @property
    def settings_label(self) -> str: ...


Request = tuple[Cell, dict[str, Any]]


def published_fits(redis_url: str) -> dict[FitKey, TimingFit]:
    """The timing fits workers publish in kiln:fits; none when Redis cannot be read (a bench in
    process needs no Redis)."""
    from redis.exceptions import RedisError

    from api_client import keys
    from api_client.connection import connect
    from api_client.eta import fit_key, read_fits

    try:
        connection = connect(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
        with connection:
            raw = connection.hgetall(keys.FITS_KEY)
    except (RedisError, OSError, ValueError):
        return {}
    return {key: fit for name, fit in read_fits(raw).items() if (key := fit_key(name)) is not None}


def duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@dataclass(frozen=True)
class Forecast:
    """How long some renders take by the fits: the sum over those with one, and who has none."""

    renders: int
    known: int  # renders with a fit
    seconds: float  # what those take
    unknown: list[str]  # models, or models at sizes, with no fit yet

    def __str__(self) -> str:
        if not self.unknown:
            return f"about {duration(self.seconds)}"
        missing = f"unknown until the first renders of {', '.join(self.unknown)}"
        if not self.known:
            return missing
        return (
            f"about {duration(self.seconds)} for {self.known} renders, "
            f"the other {self.renders - self.known} {missing}"
        )

    @property
    def short(self) -> str:
        """For the bar: a few words."""
        if not self.renders:
            return ""
        if not self.unknown:
            return f"~{duration(self.seconds)} left"
        if not self.known:
            return f"time left unknown until the first renders of {', '.join(self.unknown)}"
        return f"~{duration(self.seconds)} left + {', '.join(self.unknown)} unknown"


class Estimate:
    """Seconds renders will take by timing fits, seconds = fixed + steps x per_step per image:
    the bench's own, measured as it goes (FitTracker, as the workers fit), for the cell's settings
    or else the latest under other settings; before it has one, the workers' published fit for
    the model and size. Model loads are not counted."""

    def __init__(self, published: dict[FitKey, TimingFit]) -> None:
        self.published = published
        self._trackers: dict[str, FitTracker] = {}
        self._measured: dict[tuple[str, FitKey], TimingFit] = {}

    def add(self, cell: Cell, record: TimingRecord) -> None:
        tracker = self._trackers.setdefault(cell.settings_label, FitTracker())
        key = tracker.add(record)
        if key is not None:
            self._measured[(cell.settings_label, key)] = tracker.fit(key)

    def fit(self, cell: Cell, key: FitKey) -> TimingFit | None:
        own = self._measured.get((cell.settings_label, key))
        other = next((f for (_, k), f in reversed(self._measured.items()) if k == key), None)
        return own or other or self.published.get(key)

    def of(self, requests: Sequence[Request]) -> Forecast:
        seconds, known = 0.0, 0
        sizes: dict[str, set[tuple[int, int]]] = {}
        unknown: dict[str, set[tuple[int, int]]] = {}
        for cell, request in requests:
            model, size = request["model"], (request["width"], request["height"])
            sizes.setdefault(model, set()).add(size)
            fit = self.fit(cell, (model, *size))
            if fit is None:
                unknown.setdefault(model, set()).add(size)
            else:
                seconds += fit.eta(request["steps"], request["num_images"])
                known += 1
        names = [
            model
            if missing == sizes[model]
            else f"{model} at {', '.join(f'{w}x{h}' for w, h in sorted(missing))}"
            for model, missing in unknown.items()
        ]
        return Forecast(len(requests), known, seconds, names)
