"""Schemathesis hooks for fuzzing our APIs (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks):
the endpoint's `number-text` format (finite number text, or blanks alone: missing) and msgpack answers, so that
generated values are what the document means and msgpack responses are checked too."""
from __future__ import annotations

import math
import re

import msgpack
import schemathesis
from hypothesis import strategies as st

from mariana.sparse.parse import NUMBER_RE

_NUMBER = re.compile(NUMBER_RE.removeprefix("^").removesuffix("$"))
schemathesis.openapi.format("number-text", st.from_regex(_NUMBER, fullmatch=True).filter(
    lambda t: not t.strip(" \t") or math.isfinite(float(t.strip(" \t")))))


@schemathesis.deserializer("application/msgpack")
def _msgpack(ctx, response):
    return msgpack.unpackb(response.content, raw=False)
