"""Build the gateway: the Guard before everything, the public routes (/healthz, /readyz, the
login), and one private router under the auth dependency holding everything else: /v1, the
OpenAPI document, /docs and its assets, the page and its assets. A route is private by being
declared on `private` or in routes.py; tests/test_api_auth.py walks the finished route table and
calls every route without credentials.

Errors leave as RFC 9457 problem details (application/problem+json). A refused request carries
errors [{field, value, rule}] and the same detail text as the Python client's RequestRejected."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api_client.client import KilnClient
from api_client.errors import Problem, RequestRejected, UnknownJob, short
from api_client.http import routes
from api_client.http.auth import COOKIE, caller
from api_client.http.guard import Guard
from api_client.http.hub import EventHub, connect_async
from api_client.http.settings import ApiSettings
from api_client.http.tokens import Tokens
from api_client.http.views import PROBLEM_JSON, Health, ProblemDetail
from api_client.schema import RenderRequest

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"app.js": "text/javascript", "app.css": "text/css"}
DOCS_FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}
PAGE_CSP = (
    "default-src 'self'; img-src 'self' data: blob: https:; script-src 'self'; "
    "style-src 'self'; connect-src 'self'; frame-ancestors 'none'; form-action 'self'; "
    "base-uri 'none'"
)
LOGIN_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'"
)
DOCS_CSP = (
    "default-src 'self'; img-src 'self' data:; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"
)
HUB_POOL = 8  # connections the event streams' catch-up reads share, however many watch


def create_app(settings: ApiSettings, client: KilnClient | None = None) -> FastAPI:
    """The gateway's app over settings' Redis (or the given client's)."""
    client = client or settings.client()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = connect_async(settings.redis_url, max_connections=HUB_POOL)
        reader = connect_async(settings.redis_url, max_connections=1, socket_timeout=None)
        app.state.hub = EventHub(pool, reader)
        app.state.hub.start()
        try:
            yield
        finally:
            await app.state.hub.stop()
            await pool.aclose()
            await reader.aclose()

    app = FastAPI(
        title="kiln",
        summary="Render jobs on kiln workers: submit, follow, fetch.",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.client = client
    app.state.tokens = Tokens(client.connection)
    app.add_middleware(Guard, settings=settings)
    _errors(app)
    _public(app)
    private = APIRouter(dependencies=[Depends(caller)])
    private.include_router(routes.router)
    _private(private, app)
    app.include_router(private)
    return app


# -- errors --------------------------------------------------------------------------------------


def problem(
    status: int,
    title: str,
    detail: str,
    problems: list[Problem] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ProblemDetail(
        title=title,
        status=status,
        detail=detail,
        errors=[
            {"field": p.field, "value": _json_safe(p.value), "rule": p.rule} for p in problems or []
        ],  # type: ignore[misc]
    )
    return JSONResponse(
        body.model_dump(), status_code=status, media_type=PROBLEM_JSON, headers=headers or None
    )


def _json_safe(value: Any) -> Any:
    value = short(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return problem(422, "Request rejected", str(exc), exc.problems)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        body_errors = [e for e in exc.errors() if e.get("loc", ("",))[0] == "body"]
        if body_errors and _takes_render_request(request):
            # The body is a RenderRequest: refuse it in RenderRequest.parse's own words.
            try:
                RenderRequest.parse(exc.body)
            except RequestRejected as rejected:
                return problem(422, "Request rejected", str(rejected), rejected.problems)
        problems = [
            Problem(
                ".".join(str(p) for p in e.get("loc", ())[1:])
                or str(e.get("loc", ("request",))[0]),
                short(e.get("input")),
                e.get("msg", "invalid"),
            )
            for e in exc.errors()
        ]
        return problem(422, "Request rejected", str(RequestRejected(problems)), problems)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        titles = {
            400: "Bad request",
            401: "Unauthorized",
            403: "Forbidden",
            404: "Not found",
            409: "Conflict",
            413: "Body too large",
            415: "Unsupported media type",
            405: "Method not allowed",
        }
        headers = dict(exc.headers or {})
        return problem(
            exc.status_code, titles.get(exc.status_code, "Error"), str(exc.detail), headers=headers
        )

    @app.exception_handler(UnknownJob)
    async def unknown(request: Request, exc: UnknownJob) -> JSONResponse:
        return problem(404, "Not found", str(exc))

    @app.exception_handler(RedisConnectionError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        return problem(503, "Redis unreachable", "the gateway cannot reach Redis; try again")


def _field(loc: Any) -> str:
    """A FastAPI error location as RequestRejected names fields: body.steps -> steps."""
    parts = [str(p) for p in loc]
    return ".".join(parts[1:]) or (parts[0] if parts else "request")


def _takes_render_request(request: Request) -> bool:
    """Whether the route's body is a RenderRequest, as the route itself declares it."""
    body = getattr(request.scope.get("route"), "body_field", None)
    return body is not None and body.field_info.annotation is RenderRequest


# -- public: health, the login -------------------------------------------------------------------


def _public(app: FastAPI) -> None:
    @app.get("/healthz", response_model=Health, tags=["health"])
    def healthz() -> Health:
        """200 while the process runs."""
        return Health(status="ok")

    @app.get(
        "/readyz",
        response_model=Health,
        tags=["health"],
        responses={503: {"model": Health, "description": "Redis does not answer"}},
    )
    def readyz(request: Request) -> Any:
        """200 when Redis answers, else 503."""
        try:
            request.app.state.client.connection.ping()
        except Exception:
            return JSONResponse({"status": "redis unreachable"}, status_code=503)
        return Health(status="ok")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page(request: Request, token: str | None = None) -> Response:
        """The page for a session; the login form without one. /?token=... logs in and drops
        the token from the address bar."""
        tokens: Tokens = request.app.state.tokens
        if token is not None:
            if tokens.caller(token) is None:
                return _login(request, "That token is unknown or revoked.", status=401)
            return _session(request, token)
        session = request.cookies.get(COOKIE)
        if session and tokens.caller(session) is not None:
            return FileResponse(
                STATIC / "index.html",
                media_type="text/html",
                headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-store"},
            )
        return _login(request)

    @app.post("/login", include_in_schema=False)
    def login(request: Request, token: str = Form(max_length=200)) -> Response:
        if request.app.state.tokens.caller(token) is None:
            return _login(request, "That token is unknown or revoked.", status=401)
        return _session(request, token)

    @app.post("/logout", include_in_schema=False)
    def logout() -> Response:
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response


def _session(request: Request, token: str) -> Response:
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(
        COOKIE,
        token,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
        max_age=30 * 24 * 3600,
    )
    return response


def _login(request: Request, message: str = "", status: int = 200) -> HTMLResponse:
    html = (STATIC / "login.html").read_text()
    from html import escape

    html = html.replace("<!--message-->", escape(message))
    return HTMLResponse(
        html,
        status_code=status,
        headers={"Content-Security-Policy": LOGIN_CSP, "Cache-Control": "no-store"},
    )


# -- private: the contract, /docs, the page's assets ---------------------------------------------


def _private(router: APIRouter, app: FastAPI) -> None:
    @router.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="kiln API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon.png",
        )
        page.headers["Content-Security-Policy"] = DOCS_CSP
        return page

    @router.get("/docs/assets/{name}", include_in_schema=False)
    def docs_asset(name: str) -> Response:
        if name == "favicon.png":
            return FileResponse(_docs_static() / name, media_type="image/png")
        if name not in DOCS_FILES:
            return problem(404, "Not found", f"no docs asset {name[:80]!r}")
        return FileResponse(_docs_static() / name, media_type=DOCS_FILES[name])

    @router.get("/static/{name}", include_in_schema=False)
    def page_asset(name: str) -> Response:
        if name not in PAGE_FILES:
            return problem(404, "Not found", f"no page asset {name[:80]!r}")
        return FileResponse(STATIC / name, media_type=PAGE_FILES[name])


def _docs_static() -> Path:
    """Swagger UI's files, shipped by fastapi-offline, so /docs needs no CDN."""
    return Path(str(resources.files("fastapi_offline") / "static"))
