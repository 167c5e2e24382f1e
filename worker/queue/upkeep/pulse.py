"""The worker's side thread: keeps the running job's heartbeat fresh, publishes the worker's
state, and hands jobs whose worker died back to their queue. It also watches the worker's Redis
connection, so an outage leaves one `redis_lost` and one `redis_regained` line in the log, and
tells the lease keeper and the sweeper when Redis is too freshly back to trust a lapsed lease
(Outages)."""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

log = logging.getLogger(__name__)
events = structlog.get_logger("kiln.redis")
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
T = TypeVar("T")


class RedisWatch:
    """Whether the worker's Redis answers. An outage spans many commands, threads and retries;
    the log gets one `redis_lost` (with the first error) as it starts and one `redis_regained`
    (with down_s, seconds from that error to the first answer) as it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lost_at: float | None = None
        self.regained_at = -math.inf
        # Set when the worker stops holding no job: a command that fails raises at once instead
        # of retrying for a minute, so a shutdown never waits on an absent Redis.
        self.leaving = threading.Event()
        self.calls = threading.local()  # depth: a connect retried inside a command's retry

    def failed(self, error: BaseException, attempt_started: float | None = None) -> None:
        """A command failed. One sent before Redis last came back (attempt_started, monotonic)
        and failing after it is a straggler of the outage already logged, not a new one."""
        with self._lock:
            if self.lost_at is not None:
                return
            if attempt_started is not None and attempt_started < self.regained_at:
                return
            self.lost_at = time.monotonic()
        events.warning("redis_lost", error=f"{type(error).__name__}: {error}")

    def quiet_pubsub(
        self, otherwise: Callable[[Exception, Any, Any], None]
    ) -> Callable[[Exception, Any, Any], None]:
        """The handler of RQ's pub/sub thread (`otherwise`: RQ's own) without RQ's line every
        2 s while Redis is away: each failed try already told the watch (WatchedRetry). Once
        the worker is leaving, the thread stops trying."""

        def handle(error: Exception, pubsub: Any, thread: Any) -> None:
            if not isinstance(error, REDIS_ERRORS):
                otherwise(error, pubsub, thread)
            elif self.leaving.wait(2.0):
                thread.stop()  # on its own thread, redis-py's stop() does not join

        return handle

    def answered(self) -> None:
        """A command succeeded: the end of the outage, if there is one."""
        if self.lost_at is None:  # every command passes here: no lock when all is well
            return
        with self._lock:
            if self.lost_at is None:
                return
            moment = time.monotonic()
            down_s, self.lost_at, self.regained_at = moment - self.lost_at, None, moment
        events.info("redis_regained", down_s=round(down_s, 2))


class WatchedRetry(Retry):
    """redis-py's Retry that tells a RedisWatch about every failed attempt and every success.

    The worker's connection retries each command for about a minute (worker/queue/lease.py
    worker_connection), so a short outage never raises into kiln or RQ: only the retry policy
    sees it. redis-py deep-copies the policy into each connection; the copies share the watch.
    """

    def __init__(
        self,
        watch: RedisWatch,
        backoff: Any,
        retries: int,
        supported_errors: tuple[type[Exception], ...],
    ) -> None:
        super().__init__(backoff, retries, supported_errors)
        self.watch = watch

    def __deepcopy__(self, memo: dict[int, Any]) -> WatchedRetry:
        backoff = copy.deepcopy(self._backoff, memo)
        return WatchedRetry(self.watch, backoff, self._retries, self._supported_errors)

    def call_with_retry(
        self, do: Callable[[], T], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> T:
        """Only the outermost call's success is Redis answering: a connect (retried inside the
        command's retry) that opens a socket is not, e.g. to a proxy whose Redis is down."""
        started = time.monotonic()
        calls = self.watch.calls
        depth = getattr(calls, "depth", 0)

        def attempt() -> T:
            nonlocal started
            started = time.monotonic()
            return do()

        def failed(error: Exception, *count: Any) -> Any:
            self.watch.failed(error, started)
            outcome = fail(error, *count)
            if self.watch.leaving.is_set():
                raise error
            return outcome

        calls.depth = depth + 1
        try:
            result: T = super().call_with_retry(attempt, failed, *args, **kwargs)
        finally:
            calls.depth = depth
        if depth == 0:
            self.watch.answered()
        return result


def watch_connection(connection: Redis) -> RedisWatch:
    """The watch on a connection's commands: its retry policy (backoff, retries, errors) is kept,
    wrapped in a WatchedRetry the first time; later calls return the same watch."""
    retry = connection.get_retry()
    if isinstance(retry, WatchedRetry):
        return retry.watch
    watch = RedisWatch()
    if retry is None:  # redis-py's policy when none is given and none is asked for: no retry
        retry = Retry(NoBackoff(), 0)
    watched = WatchedRetry(watch, retry._backoff, retry.get_retries(), retry._supported_errors)
    watched.update_supported_errors(connection.get_connection_kwargs().get("retry_on_error") or [])
    connection.set_retry(watched)
    pool = connection.connection_pool
    pool.connection_class = _connecting_unheard(pool.connection_class, watch)
    return watch


def _connecting_unheard(base: type[Any], watch: RedisWatch) -> type[Any]:
    """The pool's connection class whose connect() is never Redis answering: the pool calls it on
    every connection it hands out, and on a socket left from before an outage it returns at once
    (redis-py checks the socket only after). Counted as an answer, that logged redis_regained and
    a second redis_lost inside one outage. Its failures still reach the watch."""

    class Connecting(base):  # type: ignore[misc]
        def connect(self) -> None:
            calls = watch.calls
            depth = getattr(calls, "depth", 0)
            calls.depth = depth + 1
            try:
                super().connect()
            finally:
                calls.depth = depth

    Connecting.__name__ = Connecting.__qualname__ = f"Watched{base.__name__}"
    return Connecting


class Outages:
    """When the worker's Redis was last away, as its leases see it: a command that failed, one
    that took longer than a beat (the connection retries through an outage of up to a minute),
    or the watch on the connection's retries (RedisWatch)."""

    def __init__(self, watch: RedisWatch, lease_s: float, beat_s: float) -> None:
        self.watch = watch
        self.lease_s = lease_s  # a lease's TTL: how long after an outage every lease may lapse
        self.beat_s = beat_s
        self._back_at = -math.inf  # when Redis last came back (inf while it is away)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Notes when Redis was away around the commands inside."""
        began = time.monotonic()
        try:
            yield
        except REDIS_ERRORS:
            self._back_at = math.inf
            raise
        if self._back_at == math.inf or time.monotonic() - began > self.beat_s:
            self._back_at = time.monotonic()

    def unsettled(self) -> bool:
        """Redis is away, or came back less than a lease ago. Every running job's lease may
        have lapsed while no worker could push it: they are not abandoned, and their workers
        push them within a beat. Sweeping now would re-queue every running job."""
        if self.watch.lost_at is not None:
            return True
        back_at = max(self._back_at, self.watch.regained_at)
        return time.monotonic() - back_at < self.lease_s


@dataclass(frozen=True)
class Beats:
    """How often the Pulse does each thing, in seconds."""

    heartbeat_s: float  # push the running job's lease
    sweep_s: float  # look for abandoned jobs, then deliver the webhook outbox
    state_s: float  # publish the worker's state and look for a lost cancel


class Pulse(threading.Thread):
    """Beside the render: every heartbeat_s the running job's lease pushed, every sweep_s a look
    for abandoned jobs, every state_s the worker's state and a look for a cancel of the running
    job that did not arrive over pub/sub.

    SimpleWorker only heartbeats between jobs; a render that outlives the heartbeat TTL would look
    abandoned, and a TTL long enough to cover any render would leave a killed worker's job stuck
    for that long. Every Redis call here goes through the worker's pool, which is thread-safe.

    Its RedisWatch sees every command on the worker's connection (RQ's dequeue, the render's
    events, these beats), so an outage is logged whichever thread meets it first.
    """

    def __init__(
        self,
        name: str,
        watch: RedisWatch,
        beats: Beats,
        *,
        push_lease: Callable[[bool], bool],
        publish_state: Callable[[], None],
        sweep: Callable[[], None],
    ) -> None:
        super().__init__(name=f"kiln-pulse-{name}", daemon=True)
        self.beats = beats
        self.push_lease = push_lease  # True when Redis took the push (or nothing runs)
        self.publish_state = publish_state
        self.sweep = sweep
        self.stopping = threading.Event()
        self._state_at = time.monotonic()  # the worker publishes its state as it starts
        self._swept_at = float("-inf")
        self.redis = watch

    def run(self) -> None:
        while not self.stopping.wait(self.beats.heartbeat_s):
            self.beat()

    def beat(self) -> None:
        try:
            state_due = time.monotonic() - self._state_at >= self.beats.state_s
            fresh = self.push_lease(state_due)  # with the state: a look at the stop key
            if state_due:
                self._state_at = time.monotonic()
                self.publish_state()
            # Only sweep after our own heartbeat landed: after a Redis outage our own job's entry
            # may have lapsed, and it must not be mistaken for an abandoned one.
            if fresh and time.monotonic() - self._swept_at >= self.beats.sweep_s:
                self._swept_at = time.monotonic()
                self.sweep()
        except REDIS_ERRORS as exc:
            # The connection's retries ran out (or an error they do not cover): the next beat
            # tries again. Logged once per outage, not once a beat.
            self.redis.failed(exc)
        except Exception:
            log.exception("pulse: unexpected error; carrying on")

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)
