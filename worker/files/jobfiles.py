"""What each store remembers between a job's writes: the names of the files it began for a job
(so close_job can remove them) and the last few previews' bytes (so an event can carry them)."""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict

PREVIEW_INLINE_MAX = 64 * 1024  # previews up to this size also travel as bytes in events
PREVIEW_FILE = "preview.jpg"


class JobFiles:
    """The names of the files begun for each job still rendering, until close_job takes them.
    Bounded (a worker renders one job at a time): a caller that never closes a job costs a
    few names, not a leak."""

    def __init__(self, size: int = 64) -> None:
        self._names: OrderedDict[str, list[str]] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def add(self, job_id: str, name: str) -> None:
        with self._lock:
            names = self._names.setdefault(job_id, [])
            if name not in names:
                names.append(name)
            self._names.move_to_end(job_id)
            while len(self._names) > self._size:
                self._names.popitem(last=False)

    def take(self, job_id: str) -> list[str]:
        with self._lock:
            return self._names.pop(job_id, [])


class RecentPreviews:
    """The last few previews' bytes, so an event can carry them without reading them back."""

    def __init__(self, size: int = 8) -> None:
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def put(self, uri: str, data: bytes) -> None:
        with self._lock:
            self._items[uri] = data
            self._items.move_to_end(uri)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def inline(self, uri: str) -> str | None:
        with self._lock:
            data = self._items.get(uri)
        if data is None or len(data) > PREVIEW_INLINE_MAX:
            return None
        return base64.b64encode(data).decode()
