"""Redis connections from a URL, Sentinel included, for client and worker alike.

    redis://[user:password@]host:port/db       rediss://... (TLS)       unix:///path.sock?db=N
    redis+sentinel://[user:password@]s1:26379,s2:26379/SERVICE[/db][?sentinel_password=P]

Every kiln connection comes from connect(): the worker's, the client's, the CLI's and the
gateway's. With a Sentinel URL every connection asks the sentinels which server is the master
of SERVICE, so after a failover the next command (after the retries) goes to the new master. The
user and password are the data servers'; sentinel_password is the sentinels' own, if they have one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

if TYPE_CHECKING:
    from redis import Redis
    from redis.asyncio import Redis as AsyncRedis

SENTINEL_SCHEMES = ("redis+sentinel://",)
# The one retry policy that rides out a Redis restart or a Sentinel failover: each command
# retries for about a minute (backoff from 0.1 s, capped at 2 s).
RESTART_RETRIES = 35
RESTART_BACKOFF_CAP_S = 2.0
HEALTH_CHECK_S = 10  # a connection idle this long is pinged before its next command
POOL_WAIT_S = 10  # how long a caller waits for a connection of a bounded pool (pool_size)


def connect(
    url: str, *, ride_out_restarts: bool = False, pool_size: int | None = None, **options: Any
) -> Redis:
    """A Redis client for url; options go to every connection (timeouts, retry...). redis-py
    is imported here, on first use: it loads redis.asyncio with itself (0.15-0.25 s).

    ride_out_restarts (the worker, its planner and input reader): every command retries for
    about a minute, so a Redis restart never reaches RQ's work loop, which quits on the first
    error it does not expect. A Sentinel URL always gets it: each retry reconnects, and a
    reconnect asks the sentinels for the master again. Without it (the client, the CLI) an
    unreachable Redis is said at once, with redis-py's own few quick retries. pool_size (the
    gateway): at most this many connections, for which a burst of callers waits (POOL_WAIT_S)
    rather than opening one each."""
    from redis import BlockingConnectionPool, Redis

    sentinel = url.startswith(SENTINEL_SCHEMES)
    if ride_out_restarts or sentinel:
        for name, value in restart_policy().items():
            options.setdefault(name, value)
    if not sentinel and pool_size is not None:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=pool_size, timeout=POOL_WAIT_S, **options
        )
        return Redis(connection_pool=pool)
    if not sentinel:
        return Redis.from_url(url, **options)
    from redis.sentinel import Sentinel

    if pool_size is not None:
        options["max_connections"] = pool_size
    service, db, hosts, auth, sentinel_auth = parse_sentinel_url(url)
    sentinels = Sentinel(
        hosts, sentinel_kwargs=sentinel_auth, socket_timeout=options.get("socket_timeout", 5.0)
    )
    client: Redis = sentinels.master_for(service, db=db, **{**auth, **options})
    return client


def connect_async(url: str, pool_size: int, **options: Any) -> AsyncRedis:
    """An asyncio client for url (the gateway's event hub), Sentinel URLs included, whose pool
    never holds more than pool_size connections: a burst of watchers waits for one."""
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio import Redis as AsyncRedis

    if not url.startswith(SENTINEL_SCHEMES):
        pool = BlockingConnectionPool.from_url(
            url, max_connections=pool_size, timeout=POOL_WAIT_S, **options
        )
        return AsyncRedis(connection_pool=pool)
    from redis.asyncio.sentinel import Sentinel

    service, db, hosts, auth, sentinel_auth = parse_sentinel_url(url)
    sentinels = Sentinel(hosts, sentinel_kwargs=sentinel_auth)  # type: ignore[no-untyped-call]
    extra: dict[str, Any] = {**auth, **options}
    client: AsyncRedis = sentinels.master_for(service, db=db, max_connections=pool_size, **extra)
    return client


def restart_policy() -> dict[str, Any]:
    """connect()'s options that ride out a restart: redis-py's default (10 quick retries)
    gives up within seconds."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry

    return {
        "retry": Retry(ExponentialBackoff(cap=RESTART_BACKOFF_CAP_S, base=0.1), RESTART_RETRIES),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "health_check_interval": HEALTH_CHECK_S,
    }


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
