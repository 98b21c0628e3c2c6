"""The wire envelope: the one module that turns messages into frames and back.

A message is a ZeroMQ multipart. Frame 0 is a msgpack map

    {"v": 1, "type": "PullRows", "msg_id": 7, "arrays": [["ids", "<i8", [5]]], ...fields}

and frames 1..n are the raw buffers of the named arrays, sent without a copy.
`decode` checks the frame count and sizes, the version, the type, the
type's required fields and every array's dtype, shape and byte size before
any array is built; anything wrong raises `BadMessage`, which a service
answers with an `Error` reply and counts. No pickle anywhere.

`pack`/`unpack` put the same frames into one bytes value (a 4-byte header
length, the header, the buffers) for the Redis sample cache.

Message catalog (request -> reply):

    Hello{role, index, ...}            any service -> coordinator     -> Welcome | Error{Refused | NameTaken}
                                       (+ pid, boot, host, shape, redis, replaces, status: `services.runtime.lifecycle`)
    Lease{worker, want, done}          worker -> coordinator          -> Work{..., more} | Wait | Idle
    Done{worker, reports, released}    worker -> coordinator          -> Ok (released: steps handed back)
    Miss{job, step, key}               worker -> coordinator          -> Ok (the key was not in the cache)
    GetJob{job}                        any -> coordinator             -> JobSpec{job, spec}
    ChunkSent{job, chunk, ...}         loader -> coordinator          -> Ok
    SourceDone{job, chunks, error}     loader -> coordinator          -> Ok
    ReadSource{job, files, ...}        coordinator -> loader          (a command, no reply)
    Resend{job, chunk, ...}            coordinator -> loader          (a command, no reply)
    Chunk{job, chunk, ...} + data      loader -> preprocess (PUSH)    (no reply)
    Cached{job, chunk, batches, stats} preprocess -> coordinator      -> Ok (held back while workers lag)
    Batch{job, meta} + arrays          a SparseBatch, packed into the Redis sample cache
    StartJob{job, spec}                coordinator -> ps              -> Ok
    PullRows{job, step} + ids (+ occ)  worker -> ps                   -> Rows + one array per table (+ dense, admitted)
    PushGrads{job, step, rows} + grads worker -> ps                   -> Ack{applied} (+ rows of next_ids)
                                       (occ, admitted, seen: hashing.min_count > 1, see services/ps.py)
    ShardStats{job}                    coordinator -> ps              -> Stats{rows} + applied step ids
    Export{job}                        coordinator -> ps              -> Exported + arrays
    EndJob{job}                        coordinator -> ps              -> Ok
    CheckJob{ticket, body}             coordinator -> loader          (a command; data_via_loader)
    JobChecked{ticket, error, ...}     loader -> coordinator          -> Ok
    FetchInput{ticket, job, kind, ...} coordinator -> loader          (a command; data_via_loader)
    InputPart{ticket, seq, last} + data  loader -> coordinator        -> Ok (services/remote_inputs.py)
    Error{code, error}                 reply to anything that could not be served
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from mariana.sparse.errors import MarianaError

VERSION = 1
MAX_FRAMES = 256
MAX_HEADER_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 1 << 30  # a service may set a lower bound
MAX_LEASE = 64  # steps one Lease may ask for

DTYPES = {np.dtype(t).str: np.dtype(t) for t in
          (np.uint8, np.uint16, np.int32, np.int64, np.uint32, np.float32, np.float64)}

_I, _F, _S, _B, _D, _L = int, (int, float), str, bool, dict, list
# type -> required header fields and their Python types (extra fields are allowed)
SCHEMAS: dict[str, dict[str, Any]] = {
    "Hello": {"role": _S, "index": _I},
    "Welcome": {},
    "Bye": {"role": _S, "index": _I},  # + pid, boot: a service stopping cleanly
    "Lease": {"worker": _S},  # + optional want (batches, default 1) and done (a list of Report)
    "Work": {"job": _S, "epoch": _I, "step": _S, "key": _S, "rows": _I},  # + optional more: [Work fields]
    "Wait": {},
    "Idle": {},
    "Done": {"worker": _S, "reports": _L},  # + optional released: step ids handed back untrained
    "Miss": {"job": _S, "step": _S, "key": _S},
    "GetJob": {"job": _S},
    "JobSpec": {"job": _S, "spec": _D},
    "ChunkSent": {"job": _S, "chunk": _S, "file": _I, "offset": _I, "length": _I,
                  "first_line": _I, "lines": _I, "seconds": _F},
    "SourceDone": {"job": _S, "chunks": _I, "error": _S},
    "ReadSource": {"job": _S, "files": _L, "block_bytes": _I},
    "Resend": {"job": _S, "chunk": _S, "file": _I, "offset": _I, "length": _I,
               "first_line": _I, "lines": _I},
    "Chunk": {"job": _S, "chunk": _S, "path": _S, "first_line": _I, "lines": _I, "first_of_file": _B},
    "Cached": {"job": _S, "chunk": _S, "batches": _L, "stats": _D},
    "Batch": {"job": _S, "meta": _D},
    "StartJob": {"job": _S, "spec": _D},
    "PullRows": {"job": _S, "dense": _B},
    "Rows": {},
    "PushGrads": {"job": _S, "step": _S, "rows": _I},
    "Ack": {"applied": _B},
    "ShardStats": {"job": _S},
    "Stats": {"rows": _D},  # + array "applied": step ids (`names_array`), too many for a header
    "Export": {"job": _S},
    "Exported": {"shard": _I},
    "EndJob": {"job": _S},
    "CheckJob": {"ticket": _S, "body": _D},
    "JobChecked": {"ticket": _S, "error": _S},  # + request, spec, size when error is ""
    "FetchInput": {"ticket": _S, "job": _S, "kind": _S},  # + path (file) or files and rows (holdout)
    "InputPart": {"ticket": _S, "seq": _I, "last": _B, "error": _S},  # + array "data"
    "Ok": {},
    "Error": {"code": _S, "error": _S},
}
# records carried in a message's lists, checked with `check_record`
RECORDS: dict[str, dict[str, Any]] = {
    "Report": {"job": _S, "step": _S, "rows": _I, "loss_sum": _F, "stats": _D},  # a step done
    "Work": SCHEMAS["Work"],
}


class BadMessage(MarianaError):
    """A message that does not follow the protocol; `code` names the check that failed."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


class Refused(MarianaError):
    """The coordinator will not take this service, ever, as it is configured: a role or index
    its config has not, or settings every host must share that differ. Not retried."""


class NotYet(MarianaError):
    """The coordinator does not take this service now, for a cause that may pass (its Redis
    does not answer yet): asked again until the service's start time is over."""


class NameTaken(MarianaError):
    """Another live process holds this role and index: retried while that one may be gone
    (a restart), refused once the wait is over. `holder`: the pid and host of the one that
    holds the name, sent with the `Error` (a restart on that host can see that pid gone)."""

    def __init__(self, text: str, holder: dict):
        super().__init__(text)
        self.fields = {"holder": holder}


@dataclass
class Message:
    type: str
    msg_id: int = 0
    fields: dict = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def encode(type_: str, msg_id: int = 0, arrays: dict[str, np.ndarray] | None = None,
           **fields: Any) -> list:
    """Frames of a message: [header, buffer, ...]; buffers are not copied when contiguous.

    >>> m = decode(encode("PullRows", 3, {"ids": np.arange(4)}, job="j", dense=False))
    >>> m.type, m.msg_id, m["job"], m.arrays["ids"].tolist()
    ('PullRows', 3, 'j', [0, 1, 2, 3])
    """
    if type_ not in SCHEMAS:
        raise ValueError(f"unknown message type {type_!r}")
    specs, buffers = [], []
    for name, arr in (arrays or {}).items():
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:  # (ascontiguousarray would also turn a 0-d array 1-d)
            arr = np.ascontiguousarray(arr)
        if arr.dtype.str not in DTYPES:
            raise ValueError(f"array {name!r}: dtype {arr.dtype} is not sent on the wire")
        specs.append([name, arr.dtype.str, list(arr.shape)])
        buffers.append(memoryview(arr).cast("B") if arr.size else b"")
    header = msgpack.packb({"v": VERSION, "type": type_, "msg_id": msg_id, "arrays": specs, **fields},
                           use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:  # the receiver would refuse it: fail here, loudly
        raise ValueError(f"{type_} header of {len(header)} bytes (at most {MAX_HEADER_BYTES}); "
                         "send bulk data as arrays")
    return [header] + buffers


def decode(frames: list, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Check and unpack frames (bytes, memoryviews or zmq.Frames) into a `Message`."""
    if not frames:
        raise BadMessage("empty", "a message needs at least a header frame")
    if len(frames) > MAX_FRAMES:
        raise BadMessage("too_many_frames", f"{len(frames)} frames (at most {MAX_FRAMES})")
    bufs = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in bufs)
    if total > max_bytes:
        raise BadMessage("too_large", f"{total} bytes (at most {max_bytes})")
    header = _header(bufs[0])
    specs = header.pop("arrays")
    if len(specs) != len(bufs) - 1:
        raise BadMessage("frame_count", f"header lists {len(specs)} arrays but {len(bufs) - 1} frames follow")
    arrays = {}
    for spec, buf in zip(specs, bufs[1:]):
        name, dtype, shape = _array_spec(spec)
        if math.prod(shape) * dtype.itemsize != buf.nbytes:
            raise BadMessage("array_size", f"array {name!r} {dtype.str}{shape} needs "
                             f"{math.prod(shape) * dtype.itemsize} bytes, frame has {buf.nbytes}")
        arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
    type_ = header.pop("type")
    msg_id = header.pop("msg_id")
    header.pop("v")
    return Message(type_, msg_id, header, arrays)


def _buffer(frame) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame -> its buffer, no copy
    try:
        return memoryview(buf).cast("B")
    except TypeError:
        raise BadMessage("frame_type", f"a frame must be bytes, not {type(frame).__name__}") from None


def _header(buf: memoryview) -> dict:
    if buf.nbytes > MAX_HEADER_BYTES:
        raise BadMessage("header_too_large", f"{buf.nbytes} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage
        raise BadMessage("header", f"frame 0 is not msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise BadMessage("header", f"frame 0 must be a map, got {type(header).__name__}")
    if header.get("v") != VERSION:
        raise BadMessage("version", f"protocol version {header.get('v')!r} (this side speaks {VERSION})")
    type_ = header.get("type")
    if not isinstance(type_, str) or type_ not in SCHEMAS:  # (a list or map is not even hashable)
        raise BadMessage("type", f"unknown message type {type_!r:.80}")
    if not isinstance(header.get("msg_id"), int) or isinstance(header.get("msg_id"), bool):
        raise BadMessage("msg_id", "msg_id must be an integer")
    if not isinstance(header.get("arrays", []), list):
        raise BadMessage("arrays", "arrays must be a list")
    header.setdefault("arrays", [])
    _check_fields(type_, SCHEMAS[type_], header)
    return header


def check_record(kind: str, record: Any, where: str) -> dict:
    """A record of a message's list (`RECORDS[kind]`), checked like a header; BadMessage
    naming `where` (e.g. "Lease.done[3]") when it is not a map with the fields."""
    if not isinstance(record, dict):
        raise BadMessage("field", f"{where} must be a map, got {type(record).__name__}")
    _check_fields(where, RECORDS[kind], record)
    return record


def _check_fields(where: str, schema: dict[str, Any], d: dict) -> None:
    for key, tp in schema.items():
        value = d.get(key)
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise BadMessage("field", f"{where}.{key} is missing or not {_type_name(tp)}")


def _array_spec(spec) -> tuple[str, np.dtype, tuple[int, ...]]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
            and isinstance(spec[2], list)):
        raise BadMessage("arrays", f"an array spec must be [name, dtype, shape], got {spec!r:.80}")
    name, dtype, shape = spec
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadMessage("dtype", f"array {name!r}: dtype {dtype!r:.80} is not allowed")
    if len(shape) > 4 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadMessage("shape", f"array {name!r}: bad shape {shape!r:.80}")
    return name, DTYPES[dtype], tuple(shape)


def _type_name(tp) -> str:
    names = {int: "an integer", str: "a string", bool: "a boolean", dict: "a map", list: "a list"}
    return "a number" if isinstance(tp, tuple) else names[tp]


# ---- one bytes value, for the sample cache ----------------------------------------

_LEN = struct.Struct("<I")


def pack(frames: list) -> bytes:
    """Frames as one value: header length, header, buffers.

    >>> unpack(pack(encode("Ok", 1))).type
    'Ok'
    """
    head = bytes(frames[0])
    return b"".join([_LEN.pack(len(head)), head, *frames[1:]])


def unpack(blob: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Inverse of `pack`, with the same checks as `decode`."""
    view = memoryview(blob).cast("B")
    if view.nbytes < _LEN.size:
        raise BadMessage("truncated", f"{view.nbytes} bytes is too short for a packed message")
    (n,) = _LEN.unpack_from(view)
    if n > MAX_HEADER_BYTES or _LEN.size + n > view.nbytes:
        raise BadMessage("truncated", f"header length {n} does not fit in {view.nbytes} bytes")
    head = view[_LEN.size:_LEN.size + n]
    specs = _header(head)["arrays"]
    frames, pos = [head], _LEN.size + n
    for spec in specs:
        name, dtype, shape = _array_spec(spec)
        size = math.prod(shape) * dtype.itemsize
        frames.append(view[pos:pos + size])
        pos += size
    if pos != view.nbytes:
        raise BadMessage("array_size", f"packed arrays need {pos} bytes, the value has {view.nbytes}")
    return decode(frames, max_bytes)


def names_array(names: list[str]) -> np.ndarray:
    """Strings as one uint8 array (newline-separated UTF-8), for lists too long for a header.

    >>> array_names(names_array(["e1/f0o0:0", "e1/f0o0:1"]))
    ['e1/f0o0:0', 'e1/f0o0:1']
    >>> array_names(names_array([]))
    []
    """
    return np.frombuffer("\n".join(names).encode(), np.uint8)


def array_names(arr: np.ndarray) -> list[str]:
    """Inverse of `names_array`; BadMessage for bytes that are not UTF-8."""
    try:
        text = arr.tobytes().decode()
    except UnicodeDecodeError:
        raise BadMessage("names", "a names array is not UTF-8") from None
    return text.split("\n") if text else []


def error_reply(msg_id: int, code: str, error: str) -> list:
    return encode("Error", msg_id, code=code, error=error)
