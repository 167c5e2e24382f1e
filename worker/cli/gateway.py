"""The gateway's verbs: `kiln api` (the HTTP gateway and web page over the same Redis) and
`kiln api token create|list|revoke`. The web framework (the api extra) loads in `kiln api`
alone, which says in one line how to install it where it is missing; the token verbs need only
the base install."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from worker.cli import client, extras

if TYPE_CHECKING:
    from api_client.http.tokens import Tokens


def register(verbs: Any) -> None:
    api = verbs.add_parser(
        "api",
        help="the HTTP gateway and web page over the same Redis (the api extra:"
        f" {extras.install_line('api')})",
    )
    api.add_argument("--host", help="bind address (KILN_API_HOST, default 127.0.0.1)")
    api.add_argument("--port", type=int, help="port (KILN_API_PORT, default 8700)")
    api.set_defaults(handler=serve_api)
    extras.needs(api, "api")  # FastAPI and uvicorn; its token verbs need the base install alone
    actions = api.add_subparsers(title="api commands", metavar="ACTION")
    token = actions.add_parser("token", help="API tokens, kept hashed in Redis")
    _token_verbs(token.add_subparsers(title="token commands", metavar="ACTION"))


def _token_verbs(tokens: Any) -> None:
    create = tokens.add_parser("create", help="make a token; it is printed once, alone")
    create.add_argument("name", help="1-64 letters, digits, . _ or -")
    create.add_argument(
        "--scope", choices=["jobs", "admin"], default="jobs", help="jobs: its own jobs (default)"
    )
    create.add_argument(
        "--max-queued",
        type=int,
        metavar="N",
        help="its jobs queued or running at once (default KILN_API_MAX_QUEUED, 100; admin: none)",
    )
    create.add_argument(
        "--upload-mb",
        type=float,
        metavar="M",
        help="its upload MB held in Redis at once (default KILN_API_UPLOAD_MB, 256; admin: none)",
    )
    create.add_argument(
        "--expires", type=float, metavar="DAYS", help="it stops working after DAYS (default never)"
    )
    create.set_defaults(handler=token_create)
    listed = tokens.add_parser(
        "list", help="token names, scopes, when each was made and expires, limits"
    )
    listed.set_defaults(handler=token_list)
    revoke = tokens.add_parser("revoke", help="revoke a token by name, on every replica")
    revoke.add_argument("name")
    revoke.set_defaults(handler=token_revoke)


def serve_api(args: argparse.Namespace) -> int:
    """`kiln api`: the gateway. Its web framework loads here, not before."""
    from api_client.http.settings import ApiSettings, ApiSettingsInvalid

    try:
        settings = ApiSettings.from_env(host=args.host, port=args.port)
    except ApiSettingsInvalid as exc:
        print(f"kiln api: {exc}", file=sys.stderr)
        return 2
    from api_client.http.serve import serve

    return serve(settings)


def _tokens() -> Tokens:
    from api_client.connection import connect
    from api_client.http.tokens import Tokens

    return Tokens(connect(client.redis_url()))


def token_create(args: argparse.Namespace) -> int:
    from api_client.http.tokens import TokenInvalid

    try:
        token = _tokens().create(
            args.name,
            args.scope,
            max_queued=args.max_queued,
            upload_mb=args.upload_mb,
            expires_days=args.expires,
        )
    except TokenInvalid as exc:
        print(f"kiln api token create: {exc}", file=sys.stderr)
        return 1
    print(token)
    return 0


def token_list(args: argparse.Namespace) -> int:
    for info in _tokens().listed():
        print(info.line())
    return 0


def token_revoke(args: argparse.Namespace) -> int:
    if not _tokens().revoke(args.name):
        print(f"kiln api token revoke: no token named {args.name!r}", file=sys.stderr)
        return 1
    print(f"revoked {args.name}", file=sys.stderr)
    return 0
