"""Request and response bodies: JSON, or msgpack when the Content-Type says so.
An answer goes back in the encoding its request came in.

    >>> fmt = format_of("application/msgpack")
    >>> decode(encode({"instances": [{"I1": 3}]}, fmt), fmt, max_instances=10)
    ([{'I1': 3}], 0)
"""
from __future__ import annotations

import json

import msgpack

from mariana.serving.errors import bad_request, too_large

JSON, MSGPACK = "application/json", "application/msgpack"
_MSGPACK_TYPES = {"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"}


def format_of(content_type: str | None) -> str:
    """msgpack for msgpack media types; JSON for the rest (curl's form default included)."""
    return MSGPACK if (content_type or "").lower() in _MSGPACK_TYPES else JSON


def decode(body: bytes, fmt: str, max_instances: int) -> tuple[list, int]:
    """A predict body -> (its instances, top-level keys other than 'instances').

    ServeError 400 says what is wrong with the body; 413 when it holds more than
    `max_instances` instances.
    """
    obj = _msgpack(body) if fmt == MSGPACK else _json(body)
    if not isinstance(obj, dict):
        raise bad_request(f"the body must be an object with an 'instances' array, got {_kind(obj)}")
    if fmt == MSGPACK and "instances" not in obj and b"instances" in obj:  # a client that packs every string as bin
        obj["instances"] = obj.pop(b"instances")
    if "instances" not in obj:
        raise bad_request("the body has no 'instances' (an array of objects, one per row to score)")
    instances = obj["instances"]
    if not isinstance(instances, list):
        raise bad_request(f"'instances' must be an array of objects, got {_kind(instances)}")
    if not instances:
        raise bad_request("'instances' is empty: send at least one row to score")
    if len(instances) > max_instances:
        raise too_large(f"{len(instances)} instances in one request; at most {max_instances} "
                        "(serve.max_instances): split the request")
    if fmt == MSGPACK:
        _text_keys(instances)
    return instances, len(obj) - 1


def _text_keys(instances: list) -> None:
    """Field names packed as msgpack bin (some clients pack every string so) read as the
    UTF-8 text they hold, as bin values already are: never taken for unknown fields.

    >>> rows = [{b"C1": "a", "I1": 3}, {"C1": "b"}]; _text_keys(rows); rows
    [{'C1': 'a', 'I1': 3}, {'C1': 'b'}]
    """
    for i, inst in enumerate(instances):
        if type(inst) is dict and not all(type(k) is str for k in inst):
            try:
                instances[i] = {(k.decode() if type(k) is bytes else k): v for k, v in inst.items()}
            except UnicodeDecodeError:
                raise bad_request(f"instances[{i}]: a field name is not UTF-8 text") from None


def encode(obj: dict, fmt: str) -> bytes:
    if fmt == MSGPACK:
        return msgpack.packb(obj, use_bin_type=True)
    return _ENCODER.encode(obj).encode()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


# Made once: json.loads and json.dumps with options build a new decoder or encoder per call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _json(body: bytes):
    try:
        return _DECODER.decode(body.decode("utf-8").removeprefix("\ufeff"))  # a BOM, which RFC 8259 lets a reader skip
    except UnicodeDecodeError as e:
        raise bad_request(f"the body is not UTF-8 text (byte {e.start}); send JSON, or msgpack with "
                          "Content-Type: application/msgpack") from None
    except RecursionError:
        raise bad_request("the body is not valid JSON: it nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of too many digits
        raise bad_request(f"the body is not valid JSON: {e}") from None


def _msgpack(body: bytes):
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # truncated, extra data, nesting, ...:
        raise bad_request(f"the body is not valid msgpack: {_msgpack_reason(e)}") from None


def _msgpack_reason(e: Exception) -> str:
    """msgpack's own message, or (FormatError and StackError carry none) what it means."""
    if "exceeds max_" in str(e):  # "4294967295 exceeds max_array_len(16)": the limit is the body's length
        return "a count in it is larger than its bytes could hold (a truncated body, or not msgpack)"
    if str(e):
        return str(e)
    if isinstance(e, msgpack.FormatError):
        return "it holds a byte that starts no msgpack value (e.g. 0xc1, which msgpack never uses)"
    if isinstance(e, msgpack.StackError):
        return "it nests too deeply"
    return type(e).__name__


def _kind(v) -> str:
    return {dict: "an object", list: "an array", str: "text", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)
