"""Who is calling: `Authorization: Bearer <token>` for programs, the page's session cookie for a
browser. The private router hangs under `caller` (app.py), so a route is behind it by being
declared there; only /healthz, /readyz and the login page are declared outside it."""

from __future__ import annotations

from fastapi import HTTPException, Request

from api_client.http.sessions import Sessions
from api_client.http.tokens import Caller, Tokens

COOKIE = "kiln_session"


def bearer(request: Request) -> str | None:
    """The token an Authorization header carries, if any."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def caller(request: Request) -> Caller:
    """The route's dependency: the caller, or 401. A plain def, so FastAPI runs its Redis read
    in the thread pool, off the event loop."""
    tokens: Tokens = request.app.state.tokens
    sessions: Sessions = request.app.state.sessions
    token = bearer(request)
    session = request.cookies.get(COOKIE)
    if token is not None:
        found = tokens.caller(token)
    else:
        found = sessions.caller(session) if session else None
    if found is None:
        detail = "a valid token is needed: Authorization: Bearer <token>, or log in on the page"
        if token:
            detail = "the token is unknown, revoked or expired"
        elif session:
            detail = "the session is over (its token was revoked or expired): log in again"
        raise HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})
    request.state.caller = found
    return found
