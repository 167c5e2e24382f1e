"""A dialect's call held open until its job ends: the job's events from the gateway's one
EventHub reader (no thread waits per call, however many calls wait), and whether a model is
served now (a call for a model no live worker serves is answered at once, not held)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from api_client import keys
from api_client.client import KilnClient
from api_client.http.hub import EventHub
from api_client.schema import JobEvent, RenderResult

KEEPALIVE_S = 15.0


class EndedWithout(Exception):
    """The job ended with no result: failed, stopped, canceled, or gone; the message says which
    and, where the worker said it, why."""


def served_now(client: KilnClient, model: str) -> bool:
    return any(model in state.models for state in client.workers())


async def events(request: Request, job_id: str) -> AsyncIterator[JobEvent | None]:
    """The job's events to its end, None for each quiet KEEPALIVE_S (a job that ends with no
    event, quarantined or deleted, ends the iteration)."""
    hub: EventHub = request.app.state.hub
    client: KilnClient = request.app.state.client
    async for event in hub.watch(keys.events_key(job_id), "0", KEEPALIVE_S):
        if event is None and await run_in_threadpool(_ended_silently, client, job_id):
            return
        yield event
        if event is not None and event.terminal:
            return


async def result(request: Request, job_id: str) -> RenderResult:
    """The job's result once it is done; EndedWithout when it ends any other way."""
    async for event in events(request, job_id):
        if event is None:
            continue
        if event.kind == "done" and event.result is not None:
            return event.result
        if event.terminal:
            raise EndedWithout(f"job {job_id} {event.kind}: {event.error or event.kind}")
    raise EndedWithout(f"job {job_id} ended without a result")


def _ended_silently(client: KilnClient, job_id: str) -> bool:
    return client.job(job_id).ended()
