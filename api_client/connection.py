"""Redis connections from a URL, Sentinel included, for client and worker alike.

    redis://[user:password@]host:port/db       rediss://... (TLS)       unix:///path.sock?db=N
    redis+sentinel://[user:password@]s1:26379,s2:26379/SERVICE[/db][?sentinel_password=P]

With a Sentinel URL every connection asks the sentinels which server is the master of SERVICE,
so after a failover the next command (after redis-py's retries) goes to the new master. The
user and password are the data servers'; sentinel_password is the sentinels' own, if they have one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

if TYPE_CHECKING:
    from redis import Redis

SENTINEL_SCHEMES = ("redis+sentinel://",)
FAILOVER_RETRIES = 30  # about 25 s of retries at the 1 s cap


def connect(url: str, **options: Any) -> Redis:
    """A Redis client for url; options go to every connection (timeouts, retry...). redis-py
    is imported here, on first use: it loads redis.asyncio with itself (0.15-0.25 s)."""
    from redis import Redis

    if not url.startswith(SENTINEL_SCHEMES):
        return Redis.from_url(url, **options)
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry
    from redis.sentinel import Sentinel

    service, db, hosts, auth, sentinel_auth = parse_sentinel_url(url)
    if "retry" not in options:
        # Ride out a failover (sentinels notice in down-after-milliseconds, then elect): each
        # retry reconnects, and a reconnect asks the sentinels for the master again.
        options["retry"] = Retry(ExponentialBackoff(cap=1.0, base=0.1), retries=FAILOVER_RETRIES)
        options["retry_on_error"] = [RedisConnectionError, RedisTimeoutError]
    sentinel = Sentinel(
        hosts, sentinel_kwargs=sentinel_auth, socket_timeout=options.get("socket_timeout", 5.0)
    )
    client: Redis = sentinel.master_for(service, db=db, **{**auth, **options})
    return client


def parse_sentinel_url(
    url: str,
) -> tuple[str, int, list[tuple[str, int]], dict[str, str], dict[str, str]]:
    """(service, db, sentinel hosts, data-server auth, sentinel auth); ValueError names the part."""
    parsed = urlparse(url)
    netloc = parsed.netloc.rsplit("@", 1)[-1]
    hosts: list[tuple[str, int]] = []
    for part in netloc.split(","):
        host, _, port = part.partition(":")
        if not host:
            raise ValueError(f"sentinel URL has an empty host in {netloc!r}")
        hosts.append((host, int(port or 26379)))
    path = [p for p in parsed.path.split("/") if p]
    if not path:
        raise ValueError("sentinel URL needs the service name: redis+sentinel://HOSTS/SERVICE[/db]")
    db = int(path[1]) if len(path) > 1 else 0
    auth: dict[str, str] = {}
    if "@" in parsed.netloc:
        user, _, password = parsed.netloc.rsplit("@", 1)[0].partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    query = parse_qs(parsed.query)
    sentinel_auth = (
        {"password": query["sentinel_password"][0]} if "sentinel_password" in query else {}
    )
    return path[0], db, hosts, auth, sentinel_auth
