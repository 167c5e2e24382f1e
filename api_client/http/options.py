"""OPTIONS on a path: 204 with Allow naming every method the app's routes take there. Starlette
alone answers 405 naming the methods of the first route whose path matched (GET of
/v1/jobs/{id}, never its PUT), which schemathesis rightly reports."""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response
from starlette.routing import Match

PROBED = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed(request: Request) -> list[str]:
    """The methods some route of the app takes on the request's path, asked of the routes
    themselves (the router's own matching, through included routers), and OPTIONS."""
    routes: list[Any] = request.app.router.routes
    methods = [
        method
        for method in PROBED
        if any(route.matches(_probe(request, method))[0] is Match.FULL for route in routes)
    ]
    return [*methods, "OPTIONS"]


def answer(request: Request) -> Response:
    """No credentials needed: the method list is what a 405's Allow header tells anyone."""
    return Response(status_code=204, headers={"Allow": ", ".join(allowed(request))})


def _probe(request: Request, method: str) -> dict[str, Any]:
    """A fresh scope for one method: matching writes into a scope, never into the request's."""
    scope = request.scope
    return {
        "type": "http",
        "method": method,
        "path": scope["path"],
        "root_path": scope.get("root_path", ""),
        "headers": [],
        "query_string": b"",
    }
