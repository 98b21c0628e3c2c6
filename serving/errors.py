"""Errors that carry their HTTP status: raised anywhere below the HTTP layer,
mapped to a response once, in the app's middleware."""
from __future__ import annotations

from mariana.sparse.errors import MarianaError


class ServeError(MarianaError):
    """A request that gets no prediction: `status` (4xx for the client's input,
    503 when no model can answer) and a message saying what was wrong."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.message = status, message
        self.close = close  # the connection is closed after the answer: the rest of its stream cannot be read


def bad_request(message: str) -> ServeError:
    return ServeError(400, message)


def too_large(message: str) -> ServeError:
    return ServeError(413, message)
