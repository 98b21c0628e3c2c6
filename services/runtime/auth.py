"""Bearer tokens of the admin endpoints (the coordinator's API, the model server's retrain)."""
from __future__ import annotations

import hmac


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
