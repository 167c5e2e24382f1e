"""What a live worker publishes: written for a gateway test that needs a model served (the
gateway answers at once, or warns, when no live worker serves it) while the jobs themselves are
rendered by a burst worker in the test's process, and read back from a real worker."""

from __future__ import annotations

import time

from redis import Redis

from api_client import keys
from api_client.schema import WorkerState


def live_worker(
    conn: Redis, models: list[str], running: str | None = None, name: str = "gpu-0"
) -> WorkerState:
    """A live worker's state for models, as its heartbeat writes it (for two minutes)."""
    state = WorkerState(
        name=name,
        models=models,
        resident=[],
        device="cpu",
        device_name="cpu",
        state="busy" if running else "idle",
        heartbeat=time.time(),
        pid=1,
        host="box",
        running=running,
    )
    conn.set(keys.worker_key(name), state.model_dump_json(), ex=120)
    conn.zadd(keys.WORKERS_KEY, {name: time.time()})
    return state


def blocked(conn: Redis, name: str) -> str | None:
    """Why the worker called name waits (its published state's blocked), None while it does not
    or before it has published."""
    raw = conn.get(keys.worker_key(name))
    return WorkerState.model_validate_json(raw).blocked if raw else None  # type: ignore[arg-type]
