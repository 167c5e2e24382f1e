"""Webhooks: targets an operator names in KILN_WEBHOOKS, and the senders that deliver each job's
end (done, failed, stopped) from the Redis outbox to the target its request named, signed, with
retries on the schedule KILN_WEBHOOK_RETRIES; `kiln webhooks` lists and resends.

KILN_WEBHOOKS is a JSON object, or the path of a file holding one:

    {"studio": {"url": "https://backend.example/kiln-hook", "secret": "whsec_<base64>"}}

A request names a target ("webhook": "studio"), never a URL, so a producer cannot make a worker
POST anywhere the operator did not list. The secret is a Standard Webhooks `whsec_` secret
(base64 of 24-64 random bytes); any other string is refused when the worker starts, naming the
target and the expected form, so a receiver's stock library never meets a key it would decode
differently. Headers, signing and the outbox's keys and write: api_client/webhooks.py.

At least once: every delivery waits in Redis (written with the job's end) until a receiver
answers 2xx. Each target has one sender thread in every worker configured with it. A sender
takes one due delivery under a lease (CLAIM: from `due` to `taken`, scored by when the lease
lapses; a lapsed one goes back to `due`, for any sender), POSTs it with the same webhook-id
every try, and settles it (SETTLE): deleted on a 2xx; else due again after the schedule's next
delay, or, after the last try (or at once on a 4xx other than 408, 425 and 429), a dead letter,
with the receiver's last answer. A sender wakes when its own worker writes a delivery (wake) and
looks in Redis every POLL_S for those other writers left. A hung or failing receiver delays only
its own target. A worker that stops leaves what is undelivered in Redis.

Over 400 lines because the targets' grammar, the senders with their leases and retries, and the
command that lists and resends them are one delivery contract (Standard Webhooks), read together.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import RedisError
from rq.job import Job

from api_client import keys
from api_client.errors import short
from api_client.redact import redact
from api_client.schema import WEBHOOK_NAME, JobEvent
from api_client.webhooks import (
    OUTBOX_MAX,
    OUTBOX_PREFIX,
    OutboxEntry,
    delivery_id,
    outbox_key,
    queue_webhook,
    webhook_headers,
    webhook_target,
)
from worker.crashes import crash_point
from worker.settings import Settings, WebhookTarget

__all__ = ["Dispatcher", "command", "delivery_id", "end_delivery", "queue_failure_delivery"]

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0  # per socket operation of one try
# A taken delivery's lease (KILN_WEBHOOK_LEASE_S's default): longer than a try can last
# (connect, send and answer, TIMEOUT_S each), so only a sender that died gives one back.
LEASE_S = 60.0
POLL_S = 1.0  # how often a sender looks in Redis for deliveries others wrote or gave back
ERROR_WAIT_S = 5.0  # after a Redis error, before a sender looks again
MAX_RESPONSE_BYTES = 65536  # of a receiver's answer, read and dropped
ANSWER_CHARS = 200  # of a receiver's answer, kept as the delivery's last answer
LIST_LIMIT = 50  # `kiln webhooks`: entries shown per state and target (all are counted)

# KEYS: entries, due, taken, refused. ARGV: now, lease lapses at.
# Lapsed leases go back to due; then the earliest due delivery is taken. Returns {id or false,
# entry or false, the next due or lapse time (or false), the refused count}.
CLAIM = """
local lapsed = redis.call("ZRANGEBYSCORE", KEYS[3], "-inf", ARGV[1], "LIMIT", 0, 100)
for _, id in ipairs(lapsed) do
    redis.call("ZREM", KEYS[3], id)
    if redis.call("HEXISTS", KEYS[1], id) == 1 then
        redis.call("ZADD", KEYS[2], ARGV[1], id)
    end
end
local taken, entry = false, false
while true do
    local id = redis.call("ZRANGEBYSCORE", KEYS[2], "-inf", ARGV[1], "LIMIT", 0, 1)[1]
    if not id then break end
    redis.call("ZREM", KEYS[2], id)
    entry = redis.call("HGET", KEYS[1], id)
    if entry then
        redis.call("ZADD", KEYS[3], ARGV[2], id)
        taken = id
        break
    end
end
local next_at = false
for _, key in ipairs({KEYS[2], KEYS[3]}) do
    local first = redis.call("ZRANGE", key, 0, 0, "WITHSCORES")[2]
    if first and (not next_at or tonumber(first) < tonumber(next_at)) then next_at = first end
end
return {taken, entry, next_at, redis.call("HGET", KEYS[4], "count") or 0}
"""

# KEYS: entries, due, taken, dead. ARGV: id, "done" | "due" | "dead", entry JSON, score.
# Only the sender whose lease still holds settles a retry or a death (else another sender has
# it now); a 2xx deletes the delivery whoever holds it.
SETTLE = """
local held = redis.call("ZREM", KEYS[3], ARGV[1]) == 1
if ARGV[2] == "done" then
    redis.call("ZREM", KEYS[2], ARGV[1])
    return redis.call("HDEL", KEYS[1], ARGV[1])
end
if not held or redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call("HSET", KEYS[1], ARGV[1], ARGV[3])
redis.call("ZADD", ARGV[2] == "dead" and KEYS[4] or KEYS[2], ARGV[4], ARGV[1])
return 1
"""

# KEYS: entries, dead, due. ARGV: id, entry JSON (its tries reset), now.
RESEND = """
if redis.call("ZREM", KEYS[2], ARGV[1]) == 0 then
    return 0
end
redis.call("HSET", KEYS[1], ARGV[1], ARGV[2])
redis.call("ZADD", KEYS[3], ARGV[3], ARGV[1])
return 1
"""


def end_delivery(
    job: Job, kind: Literal["done", "failed", "stopped"]
) -> tuple[str | None, JobEvent | None]:
    """The webhook target a job's request names, and the end event it is sent, made from what
    the job holds as its end is committed (id, model, result or error), as its journal's end
    event says it; (None, None) when its request names no target, (target, None) when no
    event can be made of it (logged)."""
    try:
        request = job.kwargs.get("request")
    except Exception:  # unreadable data: refused before it ran, and no target to read
        return None, None
    target = webhook_target(request)
    if target is None:
        return None, None
    error = (job.meta.get("error") or {}).get("message") if kind != "done" else None
    try:
        event = JobEvent(
            kind=kind,
            job_id=job.id,
            model=keys.model_of(job.origin) if job.origin else None,
            at=time.time(),
            result=job._result if kind == "done" else None,
            error=error,
        )
    except ValidationError as exc:
        log.error("job %s: its %s webhook cannot be made: %s", job.id, kind, short(str(exc)))
        return target, None
    return target, event


_FAILURE_KINDS: dict[str, Literal["failed", "stopped"]] = {"failed": "failed", "stopped": "stopped"}


def queue_failure_delivery(pipe: Any, job: Job) -> None:
    """On the pipeline that commits a job's end (KilnWorker.cleanup_execution): its delivery,
    when the job's status there is failed or stopped and its request names a target."""
    status = job.get_status(refresh=False)
    kind = _FAILURE_KINDS.get(str(getattr(status, "value", status)))
    if kind is not None:
        target, event = end_delivery(job, kind)
        if target is not None and event is not None:
            queue_webhook(pipe, target, event)


def _keys(target: str, *parts: str) -> list[str]:
    return [outbox_key(target, part) for part in parts]


class Lane:
    """One target's sender thread: takes the target's due deliveries one at a time, sends each
    (Dispatcher.attempt), and sleeps until the next is due, a local write wakes it, or POLL_S.
    Whatever a try or Redis raises is logged and ends neither the thread nor the delivery."""

    def __init__(self, name: str, dispatcher: Dispatcher) -> None:
        self.name = name
        self._dispatcher = dispatcher
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._refused_seen: int | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name=f"kiln-webhooks-{self.name}", daemon=True
            )
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> threading.Thread | None:
        with self._lock:
            self._stop.set()
            self._wake.set()
            thread, self._thread = self._thread, None
        return thread

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.clear()
            try:
                wait_s = self._turn()
            except RedisError as exc:
                log.warning("webhooks to %s: Redis error, retrying: %s", self.name, short(str(exc)))
                wait_s = ERROR_WAIT_S
            except Exception:
                log.exception("webhooks to %s: unexpected error; carrying on", self.name)
                wait_s = ERROR_WAIT_S
            if wait_s > 0:
                self._wake.wait(wait_s)

    def _turn(self) -> float:
        """Take and send one due delivery; how long to wait before the next look (0: at once)."""
        dispatcher = self._dispatcher
        now = time.time()
        taken, raw, next_at, refused = dispatcher.claim_script(
            keys=_keys(self.name, "entries", "due", "taken", "refused"),
            args=[now, now + dispatcher.lease_s],
        )
        self._note_refused(int(refused))
        if taken:
            dispatcher.attempt(self.name, taken.decode(), raw)
            return 0.0
        if next_at:
            return max(min(float(next_at) - time.time(), POLL_S), 0.01)
        return POLL_S

    def _note_refused(self, count: int) -> None:
        if self._refused_seen is not None and count > self._refused_seen:
            log.error(
                "webhooks to %s: %d more deliveries refused, outbox full (%d, OUTBOX_MAX); "
                "%d refused in all (see `kiln webhooks`)",
                self.name,
                count - self._refused_seen,
                OUTBOX_MAX,
                count,
            )
        elif self._refused_seen is None and count:
            log.error("webhooks to %s: %d deliveries were refused, outbox full", self.name, count)
        self._refused_seen = count


class Dispatcher:
    """The senders of this worker's targets, one Lane each, over the outbox in Redis."""

    def __init__(
        self,
        targets: Mapping[str, WebhookTarget],
        connection: Redis,
        retries: tuple[float, ...] = (5, 60, 300, 1800, 7200, 21600),
        secrets: list[str] | None = None,
        lease_s: float | None = None,
    ) -> None:
        self.targets = targets
        self.connection = connection
        self.retries = tuple(retries)
        self.lease_s = LEASE_S if lease_s is None else lease_s
        self._secrets = [*(secrets or []), *(t.secret for t in targets.values())]
        self.claim_script = connection.register_script(CLAIM)
        self._settle = connection.register_script(SETTLE)
        self._lanes = {name: Lane(name, self) for name in targets}
        self._delivered_lock = threading.Lock()
        self.delivered: list[str] = []  # ids, newest last (bounded), for logs and tests

    @classmethod
    def from_settings(
        cls, settings: Settings, targets: Mapping[str, WebhookTarget], connection: Redis
    ) -> Dispatcher:
        return cls(
            targets,
            connection,
            settings.webhook_retries,
            settings.secrets(),
            lease_s=settings.webhook_lease_s,
        )

    def start(self) -> None:
        """Start every target's sender (again, after close)."""
        for lane in self._lanes.values():
            lane.start()

    def wake(self, target: str | None = None) -> None:
        """A delivery was written for target (None: any): its sender looks now, not at its next
        poll. Starts the senders if they are not running."""
        for name, lane in self._lanes.items():
            if target is None or name == target:
                lane.start()
                lane.wake()

    def pending(self) -> int:
        """Deliveries waiting or in flight for this worker's targets, in Redis."""
        with self.connection.pipeline(transaction=False) as pipe:
            for name in self._lanes:
                pipe.zcard(outbox_key(name, "due"))
                pipe.zcard(outbox_key(name, "taken"))
            return sum(int(n) for n in pipe.execute())

    def close(self, timeout: float = 10.0) -> None:
        """Stop the senders (a try under way ends first, for up to timeout seconds); what is
        undelivered stays in Redis for any sender, a try cut short once its lease lapses."""
        threads = [t for t in (lane.stop() for lane in self._lanes.values()) if t is not None]
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def attempt(self, target_name: str, taken: str, raw: bytes) -> None:
        """One try of a taken delivery, then settled in Redis by its outcome."""
        try:
            entry = OutboxEntry.model_validate_json(raw)
        except ValidationError as exc:
            log.error(
                "webhook %s to %s: unreadable entry dropped: %s", taken, target_name, short(exc)
            )
            self._settle_as(target_name, taken, "done")
            return
        crash_point("webhook")  # taken, not yet sent
        target = self.targets[target_name]
        entry.attempts += 1
        failure = self._post(target, taken, entry)
        if failure is None:
            self._settle_as(target_name, taken, "done")
            with self._delivered_lock:
                self.delivered = [*self.delivered[-99:], taken]
            return
        reason, permanent = failure
        entry.last_answer = reason
        where = redact(f"{target_name} ({target.url})", self._secrets)
        tries = len(self.retries) + 1
        if permanent or entry.attempts >= tries:
            self._settle_as(target_name, taken, "dead", entry, time.time())
            log.error(
                "webhook %s of job %s to %s is a dead letter after %d tries: %s "
                "(`kiln webhooks --resend %s` sends it again)",
                taken,
                short(entry.job_id),
                where,
                entry.attempts,
                reason,
                taken,
            )
            return
        delay = self.retries[entry.attempts - 1]
        self._settle_as(target_name, taken, "due", entry, time.time() + delay)
        log.warning(
            "webhook %s to %s failed (%s); try %d of %d in %.1f s",
            taken,
            where,
            reason,
            entry.attempts + 1,
            tries,
            delay,
        )

    def _settle_as(
        self,
        target: str,
        taken: str,
        outcome: str,
        entry: OutboxEntry | None = None,
        score: float = 0.0,
    ) -> None:
        self._settle(
            keys=_keys(target, "entries", "due", "taken", "dead"),
            args=[taken, outcome, entry.model_dump_json() if entry else "", score],
        )

    def _post(
        self, target: WebhookTarget, msg_id: str, entry: OutboxEntry
    ) -> tuple[str, bool] | None:
        """One signed POST: None when a 2xx came back, else (the answer, permanent). Whatever
        the try raises (a refused or reset connection, a timeout, TLS, a malformed answer that
        http.client rejects) is a failed try; only a 4xx other than 408, 425 and 429 is
        permanent."""
        body = entry.body.encode()
        headers = webhook_headers(target.secret, msg_id, entry.kind, body)
        request = urllib.request.Request(
            target.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "User-Agent": "kiln-webhooks/3",
                **headers,
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                response.read(MAX_RESPONSE_BYTES)
            return None
        except urllib.error.HTTPError as exc:
            permanent = 400 <= exc.code < 500 and exc.code not in (408, 425, 429)
            return _answer(exc), permanent
        except Exception as exc:
            return short(" ".join(f"{type(exc).__name__}: {exc}".split())), False


def _answer(exc: urllib.error.HTTPError) -> str:
    """`HTTP 503: <the start of its body>`, on one line."""
    try:
        said = exc.read(ANSWER_CHARS).decode("utf-8", "replace")
    except Exception:
        said = ""
    said = " ".join(said.split())
    return f"HTTP {exc.code}" + (f": {short(said, ANSWER_CHARS)}" if said else "")


# -- `kiln webhooks [--resend ID]` ----------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    state: str  # waiting | retrying | sending | dead
    at: float  # due, lease lapse or death (unix s)
    entry: OutboxEntry


def outbox_targets(conn: Redis) -> list[str]:
    """Targets with an outbox in Redis, and those workers publish."""
    names: list[Any] = [*conn.smembers(keys.WEBHOOK_TARGETS_KEY)]
    for raw in conn.scan_iter(match=f"{OUTBOX_PREFIX}*:entries", count=1000):
        names.append(raw[len(OUTBOX_PREFIX) : -len(":entries")])
    found = {n.decode() if isinstance(n, bytes) else str(n) for n in names}
    return sorted(n for n in found if WEBHOOK_NAME.fullmatch(n))


def listing(conn: Redis, target: str) -> tuple[list[Listed], dict[str, int]]:
    """Up to LIST_LIMIT deliveries of each set (due: waiting or retrying; sending; dead),
    earliest first, and each set's count, with `refused`: writes refused past OUTBOX_MAX."""
    with conn.pipeline(transaction=False) as pipe:
        for part in ("due", "taken", "dead"):
            pipe.zrange(outbox_key(target, part), 0, LIST_LIMIT - 1, withscores=True)
            pipe.zcard(outbox_key(target, part))
        pipe.hget(outbox_key(target, "refused"), "count")
        due, due_n, taken, taken_n, dead, dead_n, refused = pipe.execute()
    listed: list[Listed] = []
    for state, rows in (("due", due), ("sending", taken), ("dead", dead)):
        raws = conn.hmget(outbox_key(target, "entries"), [m for m, _ in rows]) if rows else []
        for (_, score), raw in zip(rows, raws, strict=True):
            try:
                entry = OutboxEntry.model_validate_json(raw or b"")
            except ValidationError:
                continue
            name = ("retrying" if entry.attempts else "waiting") if state == "due" else state
            listed.append(Listed(name, float(score), entry))
    counts = {"due": int(due_n), "sending": int(taken_n), "dead": int(dead_n)}
    counts["refused"] = int(refused or 0)
    return listed, counts


def resend(conn: Redis, delivery: str) -> str | None:
    """Put a dead letter back as due now, its tries reset (the same webhook-id); the target it
    was found under, or None when no target holds a dead letter of that id."""
    script = conn.register_script(RESEND)
    for target in outbox_targets(conn):
        if conn.zscore(outbox_key(target, "dead"), delivery) is None:
            continue
        raw = conn.hget(outbox_key(target, "entries"), delivery)
        try:
            entry = OutboxEntry.model_validate_json(raw or b"")
        except ValidationError:
            return None
        entry.attempts = 0
        moved = script(
            keys=_keys(target, "entries", "dead", "due"),
            args=[delivery, entry.model_dump_json(), time.time()],
        )
        return target if int(moved) else None
    return None


def command(conn: Redis, resend_id: str | None) -> int:
    """`kiln webhooks [--resend ID]`: deliveries waiting, retrying, being sent and dead (job,
    target, kind, attempts, the receiver's last answer); or one dead letter sent again."""
    if resend_id is not None:
        target = resend(conn, resend_id)
        if target is None:
            print(f"kiln webhooks: no dead letter {resend_id!r}")
            return 1
        print(f"webhook {resend_id} to {target}: due again now, tries reset")
        return 0
    now = time.time()
    totals: dict[str, int] = {}
    for target in outbox_targets(conn):
        listed, counts = listing(conn, target)
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        for item in listed:
            print(_line(item, now))
    parts = ("due", "sending", "dead", "refused")
    print(
        ", ".join(f"{totals.get(part, 0)} {part}" for part in parts) + " (waiting or retrying: due)"
    )
    return 0


def _line(item: Listed, now: float) -> str:
    entry = item.entry
    head = f"{item.state:<8}  {entry.id}  job {entry.job_id}  {entry.target}  {entry.kind}"
    if item.state == "dead":
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(item.at))
        return (
            f"{head}  {entry.attempts} tries, dead since {when}Z  last answer: {entry.last_answer}"
        )
    if item.state == "sending":
        return f"{head}  try {entry.attempts + 1} under way"
    line = f"{head}  next try in {max(item.at - now, 0):.0f} s"
    if entry.attempts:
        line += f"  ({entry.attempts} tries; last answer: {entry.last_answer})"
    return line
