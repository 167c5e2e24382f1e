"""The gateway's settings, from KILN_* environment variables, read once by `kiln api`.

KILN_API_HOST, KILN_API_PORT (default 127.0.0.1:8700), KILN_API_HOSTS (Host headers accepted,
comma separated; default the bound host, localhost, 127.0.0.1 and [::1], each with or without
the port), KILN_API_ORIGINS (origins besides the page's own allowed to change state, comma
separated, e.g. https://studio.example), KILN_API_MAX_BODY_MB (default 20), the tenants' default
limits KILN_API_MAX_QUEUED (jobs queued or running per token, 100) and KILN_API_UPLOAD_MB (upload
bytes a token holds in Redis, 256), KILN_API_PROXIES (addresses of the reverse proxies whose
X-Forwarded-Proto and -For are believed, comma separated; default 127.0.0.1), and the client's own:
KILN_REDIS_URL, KILN_MANIFESTS, KILN_EVENTS_RETENTION_S, KILN_INPUT_MAX_MB, KILN_INPUT_TTL_S."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api_client.client import KilnClient

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8700
DEFAULT_MAX_BODY_MB = 20.0
DEFAULT_MAX_QUEUED = 100
DEFAULT_UPLOAD_MB = 256.0
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")


class ApiSettingsInvalid(ValueError):
    """A KILN_API_* value that cannot be used; the message names the variable and the value."""


@dataclass(frozen=True)
class ApiSettings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    hosts: tuple[str, ...] = ()  # extra Host values; the bound host and loopback always pass
    origins: tuple[str, ...] = ()  # extra origins allowed to change state
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    max_queued: int = DEFAULT_MAX_QUEUED  # a jobs token's jobs queued or running at once
    upload_mb: float = DEFAULT_UPLOAD_MB  # a jobs token's upload bytes held in Redis at once
    proxies: tuple[str, ...] = ("127.0.0.1",)  # uvicorn's forwarded_allow_ips
    redis_url: str = "redis://localhost:6379/0"
    manifests_dir: str = ""  # KILN_MANIFESTS: read after the shipped manifests
    events_retention_s: float | None = None
    input_max_mb: float | None = None
    input_ttl_s: int | None = None

    def client(self) -> KilnClient:
        """The Python client the gateway works through, set as the workers are."""
        from api_client.client import KilnClient

        options: dict[str, Any] = {
            name: value
            for name, value in (
                ("events_retention_s", self.events_retention_s),
                ("input_max_mb", self.input_max_mb),
                ("input_ttl_s", self.input_ttl_s),
            )
            if value is not None
        }
        return KilnClient(
            connection=bounded_connection(self.redis_url),
            manifests_dir=self.manifests_dir,
            **options,
        )

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def allowed_hosts(self) -> set[str]:
        """Host header values accepted, each bare and with the port: the bound host (unless it
        is a wildcard), loopback, and KILN_API_HOSTS."""
        names = {*LOOPBACK, *self.hosts}
        if self.host not in ("0.0.0.0", "::", ""):
            names.add(f"[{self.host}]" if ":" in self.host else self.host)
        allowed = {name.lower() for name in names}
        return allowed | {f"{name}:{self.port}" for name in allowed}

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        host: str | None = None,
        port: int | None = None,
    ) -> ApiSettings:
        """Settings from env (os.environ), with --host and --port over them."""
        env = os.environ if env is None else env

        def optional(name: str, kind: type) -> Any:
            return _number(env, name, kind) if env.get(name) else None

        bound_port = int(
            port if port is not None else _number(env, "KILN_API_PORT", int, DEFAULT_PORT)
        )
        if not 0 < bound_port < 65536:
            raise ApiSettingsInvalid(f"KILN_API_PORT={bound_port}: must be 1-65535")
        max_body = _number(env, "KILN_API_MAX_BODY_MB", float, DEFAULT_MAX_BODY_MB)
        if not max_body > 0:
            raise ApiSettingsInvalid(f"KILN_API_MAX_BODY_MB={max_body}: must be above 0")
        max_queued = int(_number(env, "KILN_API_MAX_QUEUED", int, DEFAULT_MAX_QUEUED))
        if not max_queued >= 1:
            raise ApiSettingsInvalid(f"KILN_API_MAX_QUEUED={max_queued}: must be at least 1")
        upload_mb = _number(env, "KILN_API_UPLOAD_MB", float, DEFAULT_UPLOAD_MB)
        if not upload_mb > 0:
            raise ApiSettingsInvalid(f"KILN_API_UPLOAD_MB={upload_mb}: must be above 0")
        origins = _list(env, "KILN_API_ORIGINS")
        for origin in origins:
            if origin == "null" or "://" not in origin or origin.endswith("/"):
                raise ApiSettingsInvalid(
                    f"KILN_API_ORIGINS has {origin!r}: each origin is scheme://host[:port],"
                    " with no path and never 'null'"
                )
        return cls(
            host=host or env.get("KILN_API_HOST") or DEFAULT_HOST,
            port=bound_port,
            hosts=tuple(h.lower() for h in _list(env, "KILN_API_HOSTS")),
            origins=tuple(o.lower() for o in origins),
            max_body_mb=max_body,
            max_queued=max_queued,
            upload_mb=upload_mb,
            proxies=tuple(_list(env, "KILN_API_PROXIES")) or ("127.0.0.1",),
            redis_url=env.get("KILN_REDIS_URL") or "redis://localhost:6379/0",
            manifests_dir=env.get("KILN_MANIFESTS") or "",
            events_retention_s=optional("KILN_EVENTS_RETENTION_S", float),
            input_max_mb=optional("KILN_INPUT_MAX_MB", float),
            input_ttl_s=optional("KILN_INPUT_TTL_S", int),
        )


SYNC_POOL = 16  # Redis connections the gateway's thread pool shares, however many requests wait


def bounded_connection(url: str) -> Any:
    """The gateway's synchronous Redis client: a pool of at most SYNC_POOL connections that a
    burst of requests waits on rather than opening one connection per thread (Sentinel URLs
    included, as api_client.connection reads them)."""
    from api_client.connection import connect

    return connect(url, pool_size=SYNC_POOL)


def _list(env: Mapping[str, str], name: str) -> list[str]:
    return [part.strip() for part in env.get(name, "").split(",") if part.strip()]


def _number(env: Mapping[str, str], name: str, kind: type, default: float | None = None) -> float:
    raw = env.get(name)
    if not raw:
        if default is None:
            raise ApiSettingsInvalid(f"{name} is not set")
        return kind(default)  # type: ignore[no-any-return]
    try:
        return kind(raw)  # type: ignore[no-any-return]
    except ValueError:
        raise ApiSettingsInvalid(f"{name}={raw!r}: must be a number") from None
