"""The protocol between a serving owner and its clients (SPEC P5; docs/format.md, "Wire
protocol").

A frame is a 4-byte big-endian length, then that many bytes of msgpack.  The client
speaks first: ``{"armdb": MAGIC, "versions": [1]}``; the server answers ``{"armdb": MAGIC,
"version": 1, "pid": ..., "server": __version__}``.  After that every request is
``[id, op, args]`` (``id`` a client-chosen int echoed in the reply, ``op`` a name of the
server's operation table, ``args`` a map) and every reply ``[id, 0, result]`` or
``[id, 1, [error class name, message]]``.  Replies to one connection's requests may come
out of order (a wait does not hold back an ack), hence the ids.

This module only encodes: the framing, the handshake values, and how configurations,
tokens and errors travel.  It runs no store and no socket loop (armdb.server and
armdb.client do).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import msgpack
import numpy as np

from . import errors
from .config import Config, FixedConfig, QueueConfig
from .errors import ArmdbError, ConfigError

MAGIC = "armdb-wire"
VERSION = 4
MAX_FRAME = 64 << 20  # bytes of msgpack in one frame (the length prefix excluded)
_LEN = struct.Struct(">I")
SOCKET_NAME = "armdb.sock"

OK = 0
ERR = 1


_unpackb = msgpack.unpackb


class BadFrame(Exception):
    """A frame that breaks the protocol (internal: the server closes that connection)."""


_tls = threading.local()


def _packer() -> msgpack.Packer:
    # msgpack.packb builds a Packer per call, which costs more than packing a short
    # request; a Packer keeps a buffer, so each thread has its own.
    try:
        return _tls.packer  # type: ignore[no-any-return]
    except AttributeError:
        p = _tls.packer = msgpack.Packer(use_bin_type=True)
        return p


def pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)`` with this thread's Packer."""
    return _packer().pack(obj)  # type: ignore[no-any-return]


def frame(obj: Any) -> bytes:
    """``obj`` as one frame: its msgpack bytes behind their length."""
    body = _packer().pack(obj)
    if len(body) > MAX_FRAME:
        raise ConfigError(
            f"a request or reply of {len(body):,} bytes exceeds the {MAX_FRAME:,}-byte frame limit; "
            f"send smaller batches"
        )
    return _LEN.pack(len(body)) + body


def length_of(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; ``BadFrame`` past the limit."""
    (n,) = _LEN.unpack(prefix)
    if n > MAX_FRAME:
        raise BadFrame(f"a frame announces {n:,} bytes, over the {MAX_FRAME:,}-byte limit")
    return n


def unpack(body: bytes | memoryview) -> Any:
    """One frame's msgpack body; ``BadFrame`` for anything malformed or trailing."""
    try:
        return _unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated classes
        raise BadFrame(f"malformed msgpack ({type(e).__name__}: {e})") from None


CHUNK = 1 << 18  # bytes asked of the socket at once


def _decode_frames(view: memoryview, end: int, out: list[Any]) -> int:
    """Decode the whole frames at the start of ``view[:end]`` into ``out``; returns the
    offset after the last whole frame.  ``BadFrame`` for a frame over :data:`MAX_FRAME`
    or malformed msgpack."""
    off = 0
    while end - off >= 4:
        (n,) = _LEN.unpack_from(view, off)
        if n > MAX_FRAME:
            length_of(bytes(view[off:off + 4]))  # raises BadFrame
        if end - off - 4 < n:
            break
        out.append(unpack(view[off + 4:off + 4 + n]))
        off += 4 + n
    return off


class FrameReader:
    """The frames arriving on a stream socket, decoded: one ``recv`` returns every frame
    complete in it (a client's pipelined requests, or a server's replies, cost one system
    call for all).  The buffer grows only as bytes arrive, so a frame that announces more
    than it sends costs only what it sent."""

    __slots__ = ("sock", "buf", "_chunk", "_view")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self._chunk = bytearray(CHUNK)
        self._view = memoryview(self._chunk)

    def read(self) -> list[Any] | None:
        """Receive once (blocking as the socket says) and return the frames now complete,
        decoded, in order (maybe none yet); ``None`` when the peer closed between frames.

        Raises ``BadFrame`` (a frame over :data:`MAX_FRAME`, malformed msgpack, the peer
        closed inside a frame) and what ``recv`` raises (a timeout, a reset)."""
        k = self.sock.recv_into(self._view)
        buf = self.buf
        if not k:
            if buf:
                n = len(buf) - 4
                if n < 0:
                    raise BadFrame(f"the connection closed inside a frame ({len(buf)} of 4 prefix bytes)")
                raise BadFrame(f"the connection closed inside a frame ({n} of {length_of(bytes(buf[:4]))} bytes)")
            return None
        out: list[Any] = []
        if not buf:
            # Nothing was pending (the usual case): the frames are decoded where they were
            # received, and only an incomplete tail is kept.
            off = _decode_frames(self._view, k, out)
            if off < k:
                buf += self._view[off:k]
            return out
        buf += self._view[:k]
        with memoryview(buf) as view:  # released before the buffer shrinks
            off = _decode_frames(view, len(buf), out)
        if off:
            del buf[:off]
        return out

    def pending(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self.buf)


def unpack_value(raw: bytes) -> Any:
    """A msgpack value inside a request (a batch's payloads); ``ValueError`` saying why
    it does not decode."""
    try:
        return _unpackb(raw, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated classes
        raise ValueError(f"{type(e).__name__}: {e}") from None


# -- values ---------------------------------------------------------------------------


def dt_to_ms(dt: datetime) -> int:
    return (dt - _EPOCH) // timedelta(milliseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def config_to_wire(cfg: QueueConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _build(builder: Any, values: Any, what: str) -> Any:
    if not isinstance(values, dict):
        raise BadFrame(f"{what} must be a map")
    for name, value in values.items():
        if not isinstance(name, str) or name.startswith("_") or name in ("build", "balanced"):
            raise BadFrame(f"{what} has an unknown setting {name!r}")
        method = getattr(builder, name, None)
        if method is None or not callable(method):
            raise BadFrame(f"{what} has an unknown setting {name!r}")
        builder = method(value)
    return builder.build()


def config_from_wire(values: Any) -> QueueConfig:
    """A ``QueueConfig`` built (so validated) from :func:`config_to_wire`'s map."""
    if not isinstance(values, dict):
        raise BadFrame("a queue config must be a map")
    values = dict(values)
    header = values.pop("header_config", None)
    payload = values.pop("payload_config", None)
    b = QueueConfig.balanced()
    if header is not None:
        h = dict(header) if isinstance(header, dict) else header
        if isinstance(h, dict) and h.get("shard_count") is None:
            h.pop("shard_count", None)
        b = b.header_config(_build(FixedConfig.balanced(), h, "header_config"))
    if payload is not None:
        p = dict(payload) if isinstance(payload, dict) else payload
        if isinstance(p, dict):
            for opt in ("shard_count", "encryption_key"):
                if p.get(opt) is None:
                    p.pop(opt, None)
        b = b.payload_config(_build(Config.balanced(), p, "payload_config"))
    return _build(b, values, "queue config")  # type: ignore[no-any-return]


def dtype_to_wire(dtype: np.dtype) -> Any:
    return dtype.descr if dtype.names is not None else dtype.str


def _descr(d: Any) -> Any:
    """A descr list as msgpack returns it (every tuple a list) back in NumPy's shape:
    a list of ``(name, type[, shape])`` tuples, a nested record's type a descr list."""
    if not isinstance(d, list):
        return d
    out = []
    for entry in d:
        if not isinstance(entry, list) or len(entry) not in (2, 3):
            raise BadFrame(f"not a NumPy dtype description: {d!r}")
        name = tuple(entry[0]) if isinstance(entry[0], list) else entry[0]
        item = [name, _descr(entry[1])]
        if len(entry) == 3:
            item.append(tuple(entry[2]) if isinstance(entry[2], list) else entry[2])
        out.append(tuple(item))
    return out


def dtype_from_wire(d: Any) -> np.dtype:
    try:
        return np.dtype(_descr(d))
    except Exception as e:  # noqa: BLE001 - NumPy raises several classes for a bad descr
        raise BadFrame(f"not a NumPy dtype description: {d!r} ({e})") from None


def token_to_wire(token: Any) -> list[Any]:
    """A ``LeaseToken`` as ``[handle (16 bytes, big-endian), shard, due, seq, epoch]``: a
    handle id is wider than msgpack's 64-bit ints."""
    return [token[0].to_bytes(16, "big"), token[1], token[2], token[3], token[4]]


def token_fields(raw: Any) -> tuple[int, int, int, int, int]:
    if not (isinstance(raw, list) and len(raw) == 5 and isinstance(raw[0], bytes) and len(raw[0]) == 16
            and all(type(x) is int for x in raw[1:])):
        raise BadFrame("a token must be [16 bytes, shard, due, seq, epoch]")
    return int.from_bytes(raw[0], "big"), raw[1], raw[2], raw[3], raw[4]


# -- errors ---------------------------------------------------------------------------


def error_to_wire(e: BaseException) -> list[str]:
    name = type(e).__name__ if isinstance(e, ArmdbError) else "ArmdbError"
    msg = str(e) if isinstance(e, ArmdbError) else f"the server failed: {type(e).__name__}: {e}"
    return [name, msg]


def error_from_wire(value: Any) -> ArmdbError:
    """The ``armdb.errors`` class a reply names, with the server's message."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        name, msg = value
    else:
        name, msg = "ArmdbError", f"the server sent an unreadable error: {value!r}"
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ArmdbError)):
        cls = ArmdbError
    e = cls.__new__(cls)
    Exception.__init__(e, msg)  # the class's own __init__ would rebuild the message
    return e
