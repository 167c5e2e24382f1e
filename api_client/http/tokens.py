"""API tokens and job ownership, in the Redis every gateway replica shares.

A token is `kiln_` + 32 random bytes (urlsafe base64), printed once by `kiln api token create`
and never stored: Redis keeps its sha256 (a fast hash is enough for a 256-bit random secret; a
password hash guards guessable secrets). Two hashes hold them: name -> {id, scope, sha256,
created, expires, max_queued, upload_mb} and sha256 -> name, so a request costs two HGETs to
authenticate.

A token's `id` (random, made with it) is the tenant: it owns jobs, uploads and sessions. The
name is only a label, so `revoke NAME` then `create NAME` is a new tenant that sees nothing of
the old one's. Scopes: `jobs` (its own jobs; read models, workers and queues) and `admin`
(every job, and the pins). A job created through the gateway is recorded in its owner's sorted
set (job id -> time), which is both the ownership check (ZSCORE) and the caller's job list;
every gateway job also goes in one set that admins list. Both are trimmed to JOBS_KEPT and
expire with the job records (RESULT_TTL_S after the last job)."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from api_client.enqueue import RESULT_TTL_S

if TYPE_CHECKING:
    from redis import Redis

Scope = Literal["jobs", "admin"]
SCOPES: tuple[Scope, ...] = ("jobs", "admin")
PREFIX = "kiln_"
TOKENS_KEY = "kiln:api:tokens"  # hash: name -> JSON {id, scope, sha256, created, ...}
HASHES_KEY = "kiln:api:token-hashes"  # hash: sha256 -> name
JOBS_KEY = "kiln:api:jobs"  # sorted set: every gateway job id -> unix time created
OWNED_PREFIX = "kiln:api:jobs:"  # sorted set per token id: its job ids -> unix time created
JOBS_KEPT = 1000  # newest job ids kept per list
DAY_S = 86400
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class TokenInvalid(ValueError):
    """A token name, scope or limit that cannot be used; the message names which and why."""


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its token's id (the tenant), name, scope, expiry and own
    limits (None: the gateway's default for its scope)."""

    id: str
    name: str
    scope: Scope
    expires: float | None = None
    max_queued: int | None = None
    upload_mb: float | None = None

    @property
    def admin(self) -> bool:
        return self.scope == "admin"


@dataclass(frozen=True)
class TokenInfo:
    name: str
    scope: Scope
    created: float
    expires: float | None = None
    max_queued: int | None = None
    upload_mb: float | None = None

    def line(self) -> str:
        """`kiln api token list`'s line: name, scope, made, expires, limits (`default`: the
        gateway's KILN_API_* default for its scope)."""
        queued = "default" if self.max_queued is None else str(self.max_queued)
        upload = "default" if self.upload_mb is None else f"{self.upload_mb:g} MB"
        return (
            f"{self.name}\t{self.scope}\t{_when(self.created)}\texpires {_when(self.expires)}"
            f"\tmax-queued {queued}\tupload {upload}"
        )


def _when(moment: float | None) -> str:
    if moment is None:
        return "never"
    return datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    """Create, list, revoke and check tokens; record and check who owns a job."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection

    def create(
        self,
        name: str,
        scope: str = "jobs",
        *,
        max_queued: int | None = None,
        upload_mb: float | None = None,
        expires_days: float | None = None,
    ) -> str:
        """A new token under name (refused if the name is taken: revoke it first); the token
        itself is returned once and kept nowhere. Limits left None take the gateway's
        defaults; expires_days None: it never expires."""
        if not NAME.fullmatch(name):
            raise TokenInvalid(f"token name {name[:80]!r}: must be 1-64 letters, digits, . _ or -")
        if scope not in SCOPES:
            raise TokenInvalid(f"scope {scope!r}: must be one of {', '.join(SCOPES)}")
        _check_limits(max_queued, upload_mb, expires_days)
        token = PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        entry = {
            "id": "t" + secrets.token_hex(12),
            "scope": scope,
            "sha256": digest(token),
            "created": now,
            "expires": None if expires_days is None else now + expires_days * DAY_S,
            "max_queued": max_queued,
            "upload_mb": upload_mb,
        }
        if not self.connection.hsetnx(TOKENS_KEY, name, json.dumps(entry)):
            raise TokenInvalid(f"a token named {name!r} exists: revoke it first")
        self.connection.hset(HASHES_KEY, digest(token), name)
        return token

    def listed(self) -> list[TokenInfo]:
        infos = []
        stored: dict[bytes, bytes] = self.connection.hgetall(TOKENS_KEY)  # type: ignore[assignment]
        for raw_name, raw in stored.items():
            entry = json.loads(raw)
            infos.append(
                TokenInfo(
                    _text(raw_name),
                    entry["scope"],
                    float(entry["created"]),
                    entry.get("expires"),
                    entry.get("max_queued"),
                    entry.get("upload_mb"),
                )
            )
        return sorted(infos, key=lambda info: info.created)

    def revoke(self, name: str) -> Caller | None:
        """The token that had that name (None: there was none); it no longer authenticates
        anywhere, and the sessions made with it end (sessions.Sessions checks the token)."""
        raw = self.connection.hget(TOKENS_KEY, name)
        if raw is None:
            return None
        entry = json.loads(raw)
        with self.connection.pipeline() as pipe:
            pipe.hdel(HASHES_KEY, entry["sha256"])
            pipe.hdel(TOKENS_KEY, name)
            pipe.execute()
        return _caller(name, entry)

    def any(self) -> bool:
        return bool(self.connection.hlen(TOKENS_KEY))

    def caller(self, token: str) -> Caller | None:
        """The caller a presented token belongs to, or None (unknown, revoked or expired)."""
        if not token.startswith(PREFIX) or len(token) > 200:
            return None
        name = self.connection.hget(HASHES_KEY, digest(token))
        if name is None:
            return None
        raw = self.connection.hget(TOKENS_KEY, name)
        if raw is None:
            return None
        entry = json.loads(raw)
        # Compare what was stored with what was presented, in constant time, rather than trust
        # that the reverse index agrees with the token's own entry.
        if not secrets.compare_digest(entry["sha256"], digest(token)):
            return None
        return _live(_caller(_text(name), entry))

    def by_name(self, name: str, token_id: str) -> Caller | None:
        """The live token named name whose id is token_id (a session's), or None: revoked,
        expired, or the name made again for a new tenant."""
        raw = self.connection.hget(TOKENS_KEY, name)
        if raw is None:
            return None
        found = _caller(name, json.loads(raw))
        return _live(found) if secrets.compare_digest(found.id, token_id) else None

    def record_job(self, caller: Caller, job_id: str) -> None:
        now = time.time()
        with self.connection.pipeline(transaction=False) as pipe:
            for key in (OWNED_PREFIX + caller.id, JOBS_KEY):
                pipe.zadd(key, {job_id: now}, nx=True)
                pipe.zremrangebyrank(key, 0, -JOBS_KEPT - 1)
                pipe.expire(key, RESULT_TTL_S)
            pipe.execute()

    def owns(self, caller: Caller, job_id: str) -> bool:
        """Whether the caller may see and cancel the job: an admin any job, a jobs token those
        it created."""
        if caller.admin:
            return True
        return self.made(caller, job_id)

    def made(self, caller: Caller, job_id: str) -> bool:
        """Whether this token created the job through a gateway (admin or not)."""
        return self.connection.zscore(OWNED_PREFIX + caller.id, job_id) is not None

    def recent_jobs(self, caller: Caller, limit: int) -> list[str]:
        """The caller's newest job ids (an admin's: every gateway job's), newest first."""
        key = JOBS_KEY if caller.admin else OWNED_PREFIX + caller.id
        found: list[bytes] = self.connection.zrevrange(key, 0, limit - 1)  # type: ignore[assignment]
        return [_text(job_id) for job_id in found]


def _check_limits(
    max_queued: int | None, upload_mb: float | None, expires_days: float | None
) -> None:
    if max_queued is not None and not 1 <= max_queued <= 100_000:
        raise TokenInvalid(f"--max-queued {max_queued}: must be 1-100000 jobs")
    if upload_mb is not None and not 0 < upload_mb <= 100_000:
        raise TokenInvalid(f"--upload-mb {upload_mb:g}: must be above 0 and at most 100000 MB")
    if expires_days is not None and not 0 < expires_days <= 3650:
        raise TokenInvalid(f"--expires {expires_days:g}: must be above 0 and at most 3650 days")


def _caller(name: str, entry: dict[str, Any]) -> Caller:
    # A token made before ids existed is its own tenant under its name: its jobs stay its own.
    return Caller(
        id=entry.get("id") or name,
        name=name,
        scope=entry["scope"],
        expires=entry.get("expires"),
        max_queued=entry.get("max_queued"),
        upload_mb=entry.get("upload_mb"),
    )


def _live(caller: Caller) -> Caller | None:
    return None if caller.expires is not None and caller.expires <= time.time() else caller


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
