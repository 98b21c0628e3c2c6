"""A Redis URL checked where it enters (a config key, a flag): what redis-py's `from_url`
would refuse later, in a task that dies or a traceback, is one error line at start.

>>> check_redis_url("redis://127.0.0.1:6379/0", "serve.redis_url")
'redis://127.0.0.1:6379/0'
>>> check_redis_url("", "serve.redis_url")  # no Redis: allowed where the key says so
''
>>> check_redis_url("localhost:16391", "serve.redis_url")
Traceback (most recent call last):
...
mariana.sparse.errors.ConfigError: serve.redis_url 'localhost:16391' is not a Redis URL: it needs a redis://, \
rediss:// or unix:// scheme (redis://localhost:16391, say)
"""
from __future__ import annotations

from urllib.parse import urlsplit

from mariana.sparse.errors import ConfigError

SCHEMES = ("redis", "rediss", "unix")


def check_redis_url(url: str, what: str) -> str:
    """`url` when redis-py can connect by it (or it is empty); ConfigError naming `what`
    (the key or flag it came from) otherwise. Nothing is connected to."""
    if not url:
        return url
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as e:
        if urlsplit(url).scheme not in SCHEMES or "://" not in url:
            example = f"redis://{url}" if "://" not in url else "redis://127.0.0.1:6379/0"
            raise ConfigError(f"{what} {url!r} is not a Redis URL: it needs a redis://, rediss:// or unix:// "
                              f"scheme ({example}, say)") from None
        raise ConfigError(f"{what} {url!r} is not a Redis URL: {e} (give one like redis://127.0.0.1:6379/0)") from None
    return url
