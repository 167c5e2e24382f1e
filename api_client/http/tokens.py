"""API tokens and job ownership, in the Redis every gateway replica shares.

A token is `kiln_` + 32 random bytes (urlsafe base64), printed once by `kiln api token create`
and never stored: Redis keeps its sha256 (a fast hash is enough for a 256-bit random secret; a
password hash guards guessable secrets). Two hashes hold them: name -> {scope, sha256, created}
and sha256 -> name, so a request costs one HGET to authenticate.

Scopes: `jobs` (submit, see and cancel its own jobs; read models, workers and queues) and
`admin` (every job). A job created through the gateway is recorded in its token's sorted set
(job id -> time), which is both the ownership check (ZSCORE) and the caller's job list; every
gateway job also goes in one set that admins list. Both are trimmed to JOBS_KEPT and expire with
the job records (RESULT_TTL_S after the last job)."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from api_client.enqueue import RESULT_TTL_S

if TYPE_CHECKING:
    from redis import Redis

Scope = Literal["jobs", "admin"]
SCOPES: tuple[Scope, ...] = ("jobs", "admin")
PREFIX = "kiln_"
TOKENS_KEY = "kiln:api:tokens"  # hash: name -> JSON {scope, sha256, created}
HASHES_KEY = "kiln:api:token-hashes"  # hash: sha256 -> name
JOBS_KEY = "kiln:api:jobs"  # sorted set: every gateway job id -> unix time created
OWNED_PREFIX = "kiln:api:jobs:"  # sorted set per token name: its job ids -> unix time created
JOBS_KEPT = 1000  # newest job ids kept per list
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class TokenInvalid(ValueError):
    """A token name or scope that cannot be used; the message names which and why."""


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its token's name and scope."""

    name: str
    scope: Scope

    @property
    def admin(self) -> bool:
        return self.scope == "admin"


@dataclass(frozen=True)
class TokenInfo:
    name: str
    scope: Scope
    created: float


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    """Create, list, revoke and check tokens; record and check who owns a job."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection

    def create(self, name: str, scope: str = "jobs") -> str:
        """A new token under name (refused if the name is taken: revoke it first); the token
        itself is returned once and kept nowhere."""
        if not NAME.fullmatch(name):
            raise TokenInvalid(f"token name {name[:80]!r}: must be 1-64 letters, digits, . _ or -")
        if scope not in SCOPES:
            raise TokenInvalid(f"scope {scope!r}: must be one of {', '.join(SCOPES)}")
        token = PREFIX + secrets.token_urlsafe(32)
        entry = json.dumps({"scope": scope, "sha256": digest(token), "created": time.time()})
        if not self.connection.hsetnx(TOKENS_KEY, name, entry):
            raise TokenInvalid(f"a token named {name!r} exists: revoke it first")
        self.connection.hset(HASHES_KEY, digest(token), name)
        return token

    def listed(self) -> list[TokenInfo]:
        infos = []
        stored: dict[bytes, bytes] = self.connection.hgetall(TOKENS_KEY)  # type: ignore[assignment]
        for raw_name, raw in stored.items():
            entry = json.loads(raw)
            infos.append(TokenInfo(_text(raw_name), entry["scope"], float(entry["created"])))
        return sorted(infos, key=lambda info: info.created)

    def revoke(self, name: str) -> bool:
        """Whether a token of that name existed; it no longer authenticates anywhere."""
        raw = self.connection.hget(TOKENS_KEY, name)
        if raw is None:
            return False
        with self.connection.pipeline() as pipe:
            pipe.hdel(HASHES_KEY, json.loads(raw)["sha256"])
            pipe.hdel(TOKENS_KEY, name)
            pipe.execute()
        return True

    def any(self) -> bool:
        return bool(self.connection.hlen(TOKENS_KEY))

    def caller(self, token: str) -> Caller | None:
        """The caller a presented token belongs to, or None (unknown or revoked)."""
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
        return Caller(_text(name), entry["scope"])

    def record_job(self, caller: Caller, job_id: str) -> None:
        now = time.time()
        with self.connection.pipeline(transaction=False) as pipe:
            for key in (OWNED_PREFIX + caller.name, JOBS_KEY):
                pipe.zadd(key, {job_id: now}, nx=True)
                pipe.zremrangebyrank(key, 0, -JOBS_KEPT - 1)
                pipe.expire(key, RESULT_TTL_S)
            pipe.execute()

    def owns(self, caller: Caller, job_id: str) -> bool:
        """Whether the caller may see and cancel the job: an admin any job, a jobs token those
        it created."""
        if caller.admin:
            return True
        return self.connection.zscore(OWNED_PREFIX + caller.name, job_id) is not None

    def recent_jobs(self, caller: Caller, limit: int) -> list[str]:
        """The caller's newest job ids (an admin's: every gateway job's), newest first."""
        key = JOBS_KEY if caller.admin else OWNED_PREFIX + caller.name
        found: list[bytes] = self.connection.zrevrange(key, 0, limit - 1)  # type: ignore[assignment]
        return [_text(job_id) for job_id in found]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
