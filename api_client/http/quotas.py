"""Per-tenant limits, so one token cannot take Redis or the queues from the others: jobs queued
or running at once (KILN_API_MAX_QUEUED, or the token's --max-queued) and upload bytes held in
Redis at once (KILN_API_UPLOAD_MB, or --upload-mb), inline data: inputs included (the gateway
keeps them as uploads). An admin token has no limit unless it was made with one.

Jobs: a sorted set per token of its jobs not yet seen to end. Each submit first drops the ones
that ended (one pipelined HGET of RQ's status each; the set never holds more than the limit),
then adds the new id and takes it back if that went over. Uploads: a ledger per token, a sorted
set sha256 -> when its bytes leave Redis and a hash sha256 -> bytes charged, with the running
total beside them, kept by one script so concurrent uploads cannot both fit in the last room."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from api_client import keys
from api_client.http.tokens import Caller

if TYPE_CHECKING:
    from redis import Redis

    from api_client.http.settings import ApiSettings

ACTIVE_PREFIX = "kiln:api:active:"  # sorted set per token id: job ids -> time submitted
LEDGER_PREFIX = "kiln:api:uploads:"  # + token id + :until (zset), :bytes (hash), :total
ENDED = {b"finished", b"failed", b"stopped", b"canceled"}
JOB_RETRY_S = 30  # Retry-After for a full job quota: about one job's render on a small card
# Every upload costs Redis its key and the ledger's entries besides its bytes: charged at least
# this much, so a flood of tiny images still meets the limit.
MIN_CHARGE = 1024

CHARGE = """
local leaving, sizes, total = KEYS[1], KEYS[2], KEYS[3]
local now, sha, size, expiry, limit = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]),
    tonumber(ARGV[4]), tonumber(ARGV[5])
local gone = redis.call('ZRANGEBYSCORE', leaving, '-inf', now)
for _, old in ipairs(gone) do
    redis.call('DECRBY', total, tonumber(redis.call('HGET', sizes, old) or '0'))
    redis.call('HDEL', sizes, old)
end
redis.call('ZREMRANGEBYSCORE', leaving, '-inf', now)
local held = tonumber(redis.call('GET', total) or '0')
if redis.call('HEXISTS', sizes, sha) == 0 then
    if held + size > limit then
        local first = redis.call('ZRANGE', leaving, 0, 0, 'WITHSCORES')
        return {0, held, first[2] or tostring(now + 1)}
    end
    redis.call('HSET', sizes, sha, size)
    redis.call('INCRBY', total, size)
    held = held + size
end
redis.call('ZADD', leaving, expiry, sha)
-- The ledger outlives its last entry by nothing: each key lives until the latest expiry.
local ttl = math.ceil(expiry - now)
for _, key in ipairs({leaving, sizes, total}) do
    if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
end
return {1, held, '0'}
"""


class OverQuota(Exception):
    """A tenant's limit is reached: 429 with Retry-After; the message names the limit."""

    def __init__(self, limit: str, detail: str, retry_after_s: int) -> None:
        super().__init__(detail)
        self.limit = limit
        self.retry_after_s = max(1, retry_after_s)


@dataclass(frozen=True)
class Limits:
    max_queued: int | None  # None: no limit
    upload_bytes: int | None


class Quotas:
    def __init__(self, connection: Redis, settings: ApiSettings) -> None:
        self.connection = connection
        self.settings = settings
        self._charge = connection.register_script(CHARGE)

    def limits(self, caller: Caller) -> Limits:
        """The caller's own limits, else the gateway's defaults for a jobs token; an admin
        token is unlimited unless it was made with limits."""
        default = not caller.admin
        queued = caller.max_queued
        if queued is None and default:
            queued = self.settings.max_queued
        upload_mb = caller.upload_mb
        if upload_mb is None and default:
            upload_mb = self.settings.upload_mb
        return Limits(queued, None if upload_mb is None else int(upload_mb * 1024 * 1024))

    def take_job(self, caller: Caller, job_id: str) -> None:
        """Count job_id as one of the caller's jobs queued or running; OverQuota past the
        limit (and then it is not counted)."""
        limit = self.limits(caller).max_queued
        key = ACTIVE_PREFIX + caller.id
        self._drop_ended(key)
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {job_id: time.time()}, nx=True)
            pipe.zcard(key)
            pipe.expire(key, 7 * 86400)
            _, count, _ = pipe.execute()
        if limit is not None and count > limit:
            self.connection.zrem(key, job_id)
            detail = (
                f"this token has {limit} jobs queued or running, its limit (KILN_API_MAX_QUEUED"
                " or the token's --max-queued): wait for one to end, or cancel one"
            )
            raise OverQuota("max_queued", detail, JOB_RETRY_S)

    def give_back_job(self, caller: Caller, job_id: str) -> None:
        """A job counted by take_job that was never enqueued."""
        self.connection.zrem(ACTIVE_PREFIX + caller.id, job_id)

    def active_jobs(self, caller: Caller) -> int:
        key = ACTIVE_PREFIX + caller.id
        self._drop_ended(key)
        return int(self.connection.zcard(key))

    def _drop_ended(self, key: str) -> None:
        ids: list[bytes] = self.connection.zrange(key, 0, -1)  # type: ignore[assignment]
        if not ids:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(keys.rq_job_key(job_id.decode()), "status")
            statuses = pipe.execute()
        ended = [
            job_id
            for job_id, status in zip(ids, statuses, strict=True)
            if status is None or status in ENDED
        ]
        if ended:
            self.connection.zrem(key, *ended)

    def charge_upload(self, caller: Caller, sha256: str, size: int, ttl_s: int) -> None:
        """Charge an input's bytes to the caller until it leaves Redis (ttl_s from now; the
        same sha256 again only moves that time); OverQuota when it does not fit."""
        limit = self.limits(caller).upload_bytes
        if limit is None:
            return
        now = time.time()
        prefix = LEDGER_PREFIX + caller.id
        charged = max(size, MIN_CHARGE)
        fits, held, first = self._charge(
            keys=[prefix + ":until", prefix + ":bytes", prefix + ":total"],
            args=[now, sha256, charged, now + ttl_s, limit],
        )
        if not int(fits):
            wait = math.ceil(float(first) - now)
            detail = (
                f"this token holds {_mb(int(held))} MB of uploads in Redis; {_mb(charged)} MB more"
                f" would pass its limit of {_mb(limit)} MB (KILN_API_UPLOAD_MB or the token's"
                f" --upload-mb); uploads leave after KILN_INPUT_TTL_S, the next in {wait} s"
            )
            raise OverQuota("upload_mb", detail, wait)

    def holds_upload(self, caller: Caller, sha256: str) -> bool:
        """Whether the caller uploaded these bytes and they have not yet left Redis."""
        until = self.connection.zscore(LEDGER_PREFIX + caller.id + ":until", sha256)
        return until is not None and float(until) > time.time()


def _mb(size: int) -> str:
    return f"{size / 1024 / 1024:.2f}".rstrip("0").rstrip(".")
