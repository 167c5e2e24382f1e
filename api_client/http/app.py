"""Build the gateway: the Guard before everything, the public routes (/healthz, /readyz, the
login), and one private router under the auth dependency holding everything else: /v1, the
OpenAPI document, /docs and its assets, the page and its assets. A route is private by being
declared on `private` or in routes.py; tests/test_api_auth.py walks the finished route table and
calls every route without credentials.

Errors leave as RFC 9457 problem details (application/problem+json). A refused request carries
errors [{field, value, rule}] and the same detail text as the Python client's RequestRejected."""

from __future__ import annotations

import base64
import hashlib
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
from api_client.connection import connect_async
from api_client.errors import Problem, RequestRejected, UnknownJob, short
from api_client.http import a1111, dialect, openai, options, routes
from api_client.http.asgi import echo, text
from api_client.http.auth import COOKIE, caller
from api_client.http.body import MAX_PROBLEMS
from api_client.http.guard import Guard
from api_client.http.hub import EventHub
from api_client.http.quotas import OverQuota, Quotas
from api_client.http.sessions import Sessions
from api_client.http.settings import ApiSettings
from api_client.http.tokens import Caller, Tokens
from api_client.http.views import PROBLEM_JSON, Health, ProblemDetail
from api_client.schema import RenderRequest

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"app.js": "text/javascript", "app.css": "text/css"}
DOCS_FILES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}
PAGE_CSP = (
    "default-src 'self'; img-src 'self' data: blob: https:; media-src 'self' blob: https:; "
    "script-src 'self'; "
    "style-src 'self'; connect-src 'self'; frame-ancestors 'none'; form-action 'self'; "
    "base-uri 'none'"
)
# The login page's one inline script drops a ?token= from the address and the history entry
# (where the browser allows); the CSP admits that script alone, by its hash.
LOGIN_SCRIPT = 'if (location.search) history.replaceState(null, "", location.pathname);'
LOGIN_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none';"
    " script-src 'sha256-"
    + base64.b64encode(hashlib.sha256(LOGIN_SCRIPT.encode()).digest()).decode()
    + "'"
)
DOCS_CSP = (
    "default-src 'self'; img-src 'self' data:; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"
)
# Pages that hold or take a token: never cached, and never sent to another site as a Referer.
# same-origin, not no-referrer: under no-referrer a browser posts the login form with
# `Origin: null`, which the Guard rightly refuses.
NOT_KEPT = {"Cache-Control": "no-store", "Referrer-Policy": "same-origin"}
HUB_POOL = 8  # connections the event streams' catch-up reads share, however many watch


def create_app(settings: ApiSettings, client: KilnClient | None = None) -> FastAPI:
    """The gateway's app over settings' Redis (or the given client's)."""
    client = client or settings.client()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = connect_async(settings.redis_url, pool_size=HUB_POOL)
        reader = connect_async(settings.redis_url, pool_size=1, socket_timeout=None)
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
    app.state.sessions = Sessions(client.connection, app.state.tokens)
    app.state.quotas = Quotas(client.connection, settings)
    app.add_middleware(Guard, settings=settings)
    _errors(app)
    _over_quota(app)
    _public(app)
    private = APIRouter(dependencies=[Depends(caller)])
    private.include_router(routes.router)
    app.include_router(openai.router)
    app.include_router(a1111.router)
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


def answer(
    request: Request,
    status: int,
    title: str,
    detail: str,
    problems: list[Problem] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A refusal in the caller's dialect: OpenAI's error object under /openai/v1 (a kiln 422 is
    its 400, the first field broken its param), A1111's under /sdapi/v1, else problem+json."""
    if openai.speaks(request):
        param = openai.param(problems[0].field) if problems else None
        return openai.error(400 if status == 422 else status, detail, param, headers=headers)
    if a1111.speaks(request):
        return a1111.error(status, title, detail, problems, headers=headers)
    return problem(status, title, detail, problems, headers)


def _json_safe(value: Any) -> Any:
    value = short(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _errors(app: FastAPI) -> None:
    def refused(
        request: Request, problems: list[Problem], model: str | None = None
    ) -> JSONResponse:
        """422 listing the first MAX_PROBLEMS problems, each echoed as it can be sent: a 400,000
        key body made a 30 MB refusal, and a lone surrogate or a NaN echoed made a 500."""
        shown = [
            Problem(echo(p.field), echo(p.value), text(p.rule)) for p in problems[:MAX_PROBLEMS]
        ]
        detail = str(RequestRejected(shown, model))
        if len(problems) > len(shown):
            detail += f" (errors lists the first {len(shown)} of {len(problems)} problems)"
        return answer(request, 422, "Request rejected", text(detail), shown)

    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return refused(request, exc.problems, exc.model)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("loc", ("",))[0] == "body" for e in errors) and _takes_render_request(request):
            # The body is a RenderRequest: refuse it in RenderRequest.parse's own words.
            try:
                RenderRequest.parse(exc.body)
            except RequestRejected as rejected:
                return refused(request, rejected.problems, rejected.model)
        problems = [
            Problem(_field(e.get("loc", ())), e.get("input"), e.get("msg", "invalid"))
            for e in errors
        ]
        return refused(request, problems)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405 and request.method == "OPTIONS":
            return options.answer(request)  # no route takes OPTIONS itself: every path is here
        titles = {
            400: "Bad request",
            401: "Unauthorized",
            403: "Forbidden",
            404: "Not found",
            409: "Conflict",
            413: "Body too large",
            415: "Unsupported media type",
            416: "Range not satisfiable",
            405: "Method not allowed",
        }
        headers = dict(exc.headers or {})
        title = titles.get(exc.status_code, "Error")
        return answer(request, exc.status_code, title, text(str(exc.detail)), headers=headers)

    @app.exception_handler(UnknownJob)
    async def unknown(request: Request, exc: UnknownJob) -> JSONResponse:
        return answer(request, 404, "Not found", str(exc))

    @app.exception_handler(RedisConnectionError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        return answer(
            request, 503, "Redis unreachable", "the gateway cannot reach Redis; try again"
        )

    @app.exception_handler(dialect.Refused)
    async def dialect_refused(request: Request, exc: dialect.Refused) -> JSONResponse:
        if a1111.speaks(request):
            return a1111.error(exc.status, exc.code or "Refused", str(exc))
        return openai.error(exc.status, str(exc), exc.field, exc.code)


def _field(loc: Any) -> str:
    """A FastAPI error location as RequestRejected names fields: body.steps -> steps."""
    parts = [str(p) for p in loc]
    return ".".join(parts[1:]) or (parts[0] if parts else "request")


def _takes_render_request(request: Request) -> bool:
    """Whether the route's body is a RenderRequest, as the route itself declares it."""
    body = getattr(request.scope.get("route"), "body_field", None)
    return body is not None and body.field_info.annotation is RenderRequest


def _over_quota(app: FastAPI) -> None:
    @app.exception_handler(OverQuota)
    async def over(request: Request, exc: OverQuota) -> JSONResponse:
        problems = [Problem(exc.limit, None, str(exc))]
        headers = {"Retry-After": str(exc.retry_after_s)}
        return answer(request, 429, "Too many requests", str(exc), problems, headers=headers)


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
        """The page for a session; the login form without one. /?token=... logs in (a new
        session, the token dropped from the address bar), except from a cross-site
        navigation: another site's link must not log a browser into someone else's account
        (login CSRF), so it gets the form and nothing is set."""
        try:
            return _page(request, token)
        except RedisConnectionError:  # the login form, not raw JSON, says what is wrong
            return _login(request, "kiln cannot reach its Redis now: try again in a moment.", 503)

    def _page(request: Request, token: str | None) -> Response:
        sessions: Sessions = request.app.state.sessions
        if token is not None:
            if request.headers.get("sec-fetch-site", "none") not in ("none", "same-origin"):
                return _login(request, "Log in with your own token.")
            found = request.app.state.tokens.caller(token)
            if found is None:
                return _login(request, "That token is unknown, revoked or expired.", status=401)
            return _session(request, found)
        session = request.cookies.get(COOKIE)
        if session and sessions.caller(session) is not None:
            return FileResponse(
                STATIC / "index.html",
                media_type="text/html",
                headers={"Content-Security-Policy": PAGE_CSP, **NOT_KEPT},
            )
        return _login(request)

    @app.post("/login", include_in_schema=False)
    def login(request: Request, token: str = Form(max_length=200)) -> Response:
        try:
            found = request.app.state.tokens.caller(token)
        except RedisConnectionError:
            return _login(request, "kiln cannot reach its Redis now: try again in a moment.", 503)
        if found is None:
            return _login(request, "That token is unknown, revoked or expired.", status=401)
        return _session(request, found)

    @app.post("/logout", include_in_schema=False)
    def logout(request: Request) -> Response:
        request.app.state.sessions.end(request.cookies.get(COOKIE) or "")
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response


def _session(request: Request, caller: Caller) -> Response:
    """A new session for the caller, in an HttpOnly, SameSite=Strict cookie (Secure over https,
    which a proxy named in KILN_API_PROXIES may forward)."""
    session, lifetime = request.app.state.sessions.start(caller)
    response = RedirectResponse("/", status_code=303, headers=NOT_KEPT)
    response.set_cookie(
        COOKIE,
        session,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
        max_age=lifetime,
    )
    return response


def _login(request: Request, message: str = "", status: int = 200) -> HTMLResponse:
    html = (STATIC / "login.html").read_text()
    from html import escape

    html = html.replace("<!--message-->", escape(message))
    return HTMLResponse(
        html,
        status_code=status,
        headers={"Content-Security-Policy": LOGIN_CSP, **NOT_KEPT},
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
