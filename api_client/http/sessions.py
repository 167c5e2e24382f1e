"""The page's sessions: the `kiln_session` cookie holds a random session id, never the token.
Redis keeps sha256(session id) -> the token's name and id, for at most SESSION_S and never past
the token's own expiry; a session is checked against its token on every request, so revoking or
expiring the token ends it on every replica at once."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import TYPE_CHECKING

from api_client.http.tokens import Caller, Tokens

if TYPE_CHECKING:
    from redis import Redis

SESSION_S = 30 * 86400
SESSION_PREFIX = "kiln:api:session:"  # string per sha256(session id): JSON {name, id}
MAX_SESSION_CHARS = 100


class Sessions:
    def __init__(self, connection: Redis, tokens: Tokens) -> None:
        self.connection = connection
        self.tokens = tokens

    def start(self, caller: Caller) -> tuple[str, int]:
        """A new session for the caller's token: (session id for the cookie, its lifetime in
        seconds)."""
        lifetime = SESSION_S
        if caller.expires is not None:
            lifetime = min(lifetime, int(caller.expires - time.time()))
        session = secrets.token_urlsafe(32)
        entry = json.dumps({"name": caller.name, "id": caller.id})
        self.connection.set(_key(session), entry, ex=max(lifetime, 1))
        return session, max(lifetime, 1)

    def caller(self, session: str) -> Caller | None:
        """The live token a session belongs to, or None (unknown, over, or its token revoked,
        expired or made again under its name)."""
        if not session or len(session) > MAX_SESSION_CHARS:
            return None
        raw = self.connection.get(_key(session))
        if raw is None:
            return None
        entry = json.loads(raw)
        return self.tokens.by_name(entry["name"], entry["id"])

    def end(self, session: str) -> None:
        if session and len(session) <= MAX_SESSION_CHARS:
            self.connection.delete(_key(session))


def _key(session: str) -> str:
    return SESSION_PREFIX + hashlib.sha256(session.encode()).hexdigest()
