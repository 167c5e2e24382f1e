"""Who is calling: `Authorization: Bearer <token>` for programs, the page's session cookie for a
browser. The private router hangs under `caller` (app.py), so a route is behind it by being
declared there; only /healthz, /readyz and the login page are declared outside it."""

from __future__ import annotations

from fastapi import HTTPException, Request

from api_client.http.tokens import Caller, Tokens

COOKIE = "kiln_session"


def presented(request: Request) -> str | None:
    """The token a request carries, from its Authorization header or its session cookie."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.cookies.get(COOKIE) or None


def caller(request: Request) -> Caller:
    """The route's dependency: the caller, or 401. A plain def, so FastAPI runs its Redis read
    in the thread pool, off the event loop."""
    tokens: Tokens = request.app.state.tokens
    token = presented(request)
    found = tokens.caller(token) if token else None
    if found is None:
        detail = "a valid token is needed: Authorization: Bearer <token>, or log in on the page"
        if token:
            detail = "the token is unknown or revoked"
        raise HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})
    request.state.caller = found
    return found
