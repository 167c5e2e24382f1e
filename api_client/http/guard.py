"""The ASGI layer every request passes before any route: a Host header not on the list is
refused (DNS rebinding: a hostile page's name resolved to 127.0.0.1 still sends its own Host); a
state-changing request from another origin is refused unless KILN_API_ORIGINS names it (a page
on any website can POST to localhost: ComfyUI#4850), `Origin: null` never passes; a body past
KILN_API_MAX_BODY_MB is refused, by its Content-Length or by what arrived; a JSON body is then
bounded before it is parsed (body.py). Every answer, its own refusals included, says nosniff.

It is plain ASGI, not a BaseHTTPMiddleware, so the event streams pass through it unbuffered."""

from __future__ import annotations

from urllib.parse import urlsplit

from api_client.http.asgi import App, Message, Receive, Scope, Send, refuse
from api_client.http.body import JsonBodies
from api_client.http.settings import ApiSettings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A browser that sniffs a type would run an echoed body or an uploaded image as a script.
NOSNIFF = (b"x-content-type-options", b"nosniff")


class BodyTooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: App, settings: ApiSettings) -> None:
        self.app = JsonBodies(app)
        self.hosts = settings.allowed_hosts()
        self.origins = set(settings.origins)
        self.max_body = settings.max_body_bytes
        self.max_body_mb = settings.max_body_mb

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _nosniff(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "").lower()
        if host not in self.hosts:
            shown = host[:100] or "(none)"
            await refuse(send, 421, "Host not allowed", f"Host {shown!r} is not in KILN_API_HOSTS")
            return
        if scope["method"] not in SAFE_METHODS:
            refused = self._cross_origin(headers, host)
            if refused:
                await refuse(send, 403, "Cross-origin request refused", refused)
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            await refuse(send, 413, "Body too large", self._too_large(int(length)))
            return
        await self._within_cap(scope, receive, send)

    def _cross_origin(self, headers: dict[str, str], host: str) -> str | None:
        """Why a state-changing request is refused for where it comes from, or None. A program
        (curl, a backend) sends no Origin and no Sec-Fetch-Site; it still needs a token."""
        origin = headers.get("origin")
        if origin is not None:
            origin = origin.strip().lower()
            if origin == "null":
                return "Origin 'null' (a sandboxed page, a file, a redirect) is never trusted"
            if origin in self.origins or urlsplit(origin).netloc == host:
                return None
            return f"Origin {origin[:100]!r} is not this page's and not in KILN_API_ORIGINS"
        site = headers.get("sec-fetch-site")
        if site in ("cross-site", "same-site"):
            return f"a {site} browser request with no Origin"
        return None

    def _too_large(self, size: int) -> str:
        return f"the body is {size} bytes, over KILN_API_MAX_BODY_MB ({self.max_body_mb:g} MB)"

    async def _within_cap(self, scope: Scope, receive: Receive, send: Send) -> None:
        received, started = 0, False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if not started:
                await refuse(send, 413, "Body too large", self._too_large(received))


def _nosniff(send: Send) -> Send:
    async def sent(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if all(key.lower() != NOSNIFF[0] for key, _ in headers):
                message["headers"] = [*headers, NOSNIFF]
        await send(message)

    return sent
