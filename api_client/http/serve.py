"""`kiln api`: check the settings, make the first admin token if Redis holds none (printing the
page's address with it, as Jupyter does), and serve the app on uvicorn."""

from __future__ import annotations

import sys

from api_client.http.settings import ApiSettings
from api_client.http.tokens import Tokens


def first_token(tokens: Tokens) -> str | None:
    """An admin token named `admin` when no token exists yet (a fresh install); else None."""
    if tokens.any():
        return None
    return tokens.create("admin", "admin")


def serve(settings: ApiSettings) -> int:
    import uvicorn

    from api_client.connection import connect
    from api_client.http.app import create_app

    tokens = Tokens(connect(settings.redis_url))
    token = first_token(tokens)
    tokens.connection.close()  # the app opens its own pools
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    if settings.host in ("0.0.0.0", "::"):
        shown = "localhost"
    address = f"http://{shown}:{settings.port}/"
    if token is not None:
        print(
            f"kiln api: no token in Redis yet; made the admin token. Open the page with it:\n"
            f"    {address}?token={token}\n"
            f"(kiln api token create NAME makes more; it is shown once)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"kiln api: serving on {address} (log in with a token; one is shown only when it is"
            " made: `kiln api token create NAME --scope admin` makes another admin token)",
            file=sys.stderr,
            flush=True,
        )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,  # an access log would print /?token=... lines
        proxy_headers=True,
        forwarded_allow_ips=list(settings.proxies),
    )
    return 0
