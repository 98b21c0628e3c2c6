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

import re

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
        shown = redact(url)
        if "://" not in url or url.partition("://")[0] not in SCHEMES:
            example = f"redis://{shown}" if "://" not in url else "redis://127.0.0.1:6379/0"
            raise ConfigError(f"{what} {shown!r} is not a Redis URL: it needs a redis://, rediss:// or unix:// "
                              f"scheme ({example}, say)") from None
        raise ConfigError(f"{what} {shown!r} is not a Redis URL: {e} (give one like redis://127.0.0.1:6379/0)") \
            from None
    return url


def redact(url: str) -> str:
    """`url` with its password (in the user part, or a `password=` query value) as `***`:
    what a log line or an error message may show of a Redis URL.

    >>> redact("redis://:sekret@127.0.0.1:6379/0")
    'redis://:***@127.0.0.1:6379/0'
    >>> redact("rediss://alice:p%40ss@cache.internal:6380/1")
    'rediss://alice:***@cache.internal:6380/1'
    >>> redact("unix:///run/redis.sock?db=0&password=sekret")
    'unix:///run/redis.sock?db=0&password=***'
    >>> redact("redis://127.0.0.1:6379/0")  # nothing to hide
    'redis://127.0.0.1:6379/0'
    >>> redact(":sekret@[::1:6379")  # not even a URL
    ':***@[::1:6379'
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    cut = min([len(rest)] + [i for i in (rest.find(c) for c in "/?#") if i >= 0])
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{host}"
    return scheme + sep + netloc + re.sub(r"([?&]password=)[^&#]*", r"\1***", tail)
