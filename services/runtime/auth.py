"""Bearer tokens of the admin endpoints (the coordinator's API, the model server's retrain)."""
from __future__ import annotations

import hmac
import ipaddress

from mariana.sparse.errors import ConfigError


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` as a bearer token. The scheme's name
    is case-insensitive (RFC 7235); the credentials are compared as the bytes sent (aiohttp
    keeps bytes that are no UTF-8 as surrogates), in constant time.

    >>> bearer_ok("Bearer s3cret", "s3cret"), bearer_ok("bearer  s3cret ", "s3cret")
    (True, True)
    >>> bearer_ok("Bearer s3cr\\udce9t", "s3cret")  # the byte 0xe9, as aiohttp hands it on
    False
    >>> bearer_ok(None, "s3cret"), bearer_ok("Basic s3cret", "s3cret"), bearer_ok("Bearer x", "")
    (False, False, False)
    """
    if not header or not token:
        return False
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                              token.encode())


def check_token(token: str, key: str) -> None:
    """ConfigError for a token no client can send as configured: space or a line break
    around it (a header's value is stripped: " s3cret " locked everyone out, `mariana train`
    with the same config included, and "   " passed for a token on a public address), or
    a control character in it.

    >>> check_token(" s3cret ", "coordinator.token")
    Traceback (most recent call last):
    mariana.sparse.errors.ConfigError: coordinator.token has white space around it ...
    """
    if token != token.strip():
        raise ConfigError(f"{key} has white space around it (' s3cret ' or only spaces): a header's value is "
                          "stripped, so no client could send it; remove it")
    if any(ord(c) < 32 or ord(c) == 127 for c in token):
        raise ConfigError(f"{key} holds a control character (a line break, a tab): no client could send it "
                          "in a header")


def is_loopback(host: str) -> bool:
    """
    >>> [is_loopback(h) for h in ("127.0.0.1", "127.0.0.9", "::1", "localhost", "0.0.0.0", "", "10.0.0.5")]
    [True, True, True, True, False, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or "": it may well resolve to an outside address


def check_exposed(host: str, token: str, key: str) -> None:
    """ConfigError when endpoints that change things would listen beyond loopback with no
    token: anyone who reaches the port could submit jobs that write where this process may.

    >>> check_exposed("0.0.0.0", "", "coordinator")
    Traceback (most recent call last):
    mariana.sparse.errors.ConfigError: coordinator.http_host = '0.0.0.0' is not a loopback address, and ...
    """
    if not token and not is_loopback(host):
        raise ConfigError(f"{key}.http_host = {host!r} is not a loopback address, and {key}.token is empty: "
                          "set a token (submit and cancel would be open to the network), or listen on "
                          "127.0.0.1 and tunnel")
