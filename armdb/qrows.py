"""The queue row format: what one slot of a queue's header collection holds (docs/format.md).

A slot body is the 16-byte row key followed by the 32-byte header and, for a fixed
queue, the inline payload::

    key     due_ms: u64 BE | seq: u64 BE
    header  state: u8 | flags: u8 | attempts: u16 LE | epoch: u32 LE
            | deadline_ms: i64 LE | payload_id: u64 LE | pushed_ms: i64 LE
    payload the fixed queue's record (its dtype's bytes), nothing for a var queue

Dead rows set bit 63 of the first key word (``DEAD_BIT | dead_at_ms``), so their key
class sorts after every live row.  A var queue's body lives in ``<name>.payload`` under
the key :func:`body_key` of its row id.

Also here: ``queue.meta`` (:func:`encode_meta`, :func:`decode_meta`), the rules every
stored row must follow (:func:`row_problems`, shared by open, log replay and check),
and the NumPy views (``ROW_DTYPE``, ``SNAPSHOT_DTYPE``).  A format module: pure codecs,
no file access and no queue rule (armdb.transitions computes those).  The compiled
kernels take the same offsets from ``armdb/_core/qrow.pxd``; tests/test_layering.py
ties the two together.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import numpy as np

from .config import MAX_ATTEMPTS, MAX_SHARD_COUNT
from .errors import FormatError

MAX_FIXED_PAYLOAD = 4096
KEY_SIZE = 16
HEADER_SIZE = 32
ROW_SIZE = KEY_SIZE + HEADER_SIZE  # a row without its inline payload: what every reader decodes
DEAD_BIT = 1 << 63
MAX_DUE_MS = DEAD_BIT  # live due times stay below the dead key class
META_MAGIC = b"ARMQUEU1"
META_VERSION = 1

_KEY = struct.Struct(">QQ")
# state u8, flags u8, attempts u16, epoch u32, deadline_ms i64, payload_id u64, pushed_ms i64
_HEADER = struct.Struct("<BBHIqQq")
HEADER_DTYPE = np.dtype(
    [
        ("state", "u1"),
        ("flags", "u1"),
        ("attempts", "<u2"),
        ("epoch", "<u4"),
        ("deadline", "<i8"),
        ("payload_id", "<u8"),
        ("pushed", "<i8"),
    ]
)
ROW_DTYPE = np.dtype([("due", ">u8"), ("seq", ">u8"), ("header", HEADER_DTYPE)])
FLAG_DEAD_EXPLICIT = 1
FLAG_POISONED = 2  # with FLAG_DEAD_EXPLICIT: dead-lettered by a lease because its body cannot be decoded


class State(enum.IntEnum):
    """A row's state, as stored in its header and in ``snapshot()['state']``."""

    READY = 0
    LEASED = 1
    DEAD = 2


def pack_row(due: int, seq: int, state: int, flags: int, attempts: int, epoch: int,
             deadline: int, payload_id: int, pushed: int, payload: bytes = b"") -> bytes:
    """A slot body: key, header, then the inline payload (empty for a var row)."""
    return _KEY.pack(due, seq) + _HEADER.pack(state, flags, attempts, epoch, deadline, payload_id, pushed) + payload


def key_of(image: bytes) -> tuple[int, int]:
    """``(due, seq)``: the key of a row image (or of any bytes that start with one)."""
    return _KEY.unpack_from(image)  # type: ignore[return-value]


def header_of(image: bytes) -> tuple[int, int, int, int, int, int, int]:
    """``(state, flags, attempts, epoch, deadline, payload_id, pushed)`` of a row image."""
    return _HEADER.unpack_from(image, KEY_SIZE)  # type: ignore[return-value]


def body_key(seq: int) -> bytes:
    """The key of a var row's body in ``<name>.payload``: its row id, 8 bytes big-endian."""
    return seq.to_bytes(8, "big")


def rows_of(table: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The rows (``ROW_DTYPE``, copied) of ``slots`` in a slot table: a ``(n, slot_size)``
    uint8 array of whole slots, each an 8-byte slot header then the slot body."""
    return np.ascontiguousarray(table[slots, 8 : 8 + ROW_SIZE]).view(ROW_DTYPE).reshape(-1)


def to_snapshot(rows: np.ndarray) -> np.ndarray:
    """``Queue.snapshot()``'s view of ``ROW_DTYPE`` rows (Q27)."""
    out = np.zeros(rows.shape[0], dtype=SNAPSHOT_DTYPE)
    hdr = rows["header"]
    out["id"] = rows["seq"]
    out["state"] = hdr["state"]
    out["due"] = (rows["due"].astype(np.uint64) & np.uint64(~DEAD_BIT & 0xFFFFFFFFFFFFFFFF)).astype(
        np.int64
    ).astype("datetime64[ms]")
    out["attempts"] = hdr["attempts"]
    out["epoch"] = hdr["epoch"]
    dl = hdr["deadline"].astype("datetime64[ms]")
    dl[hdr["deadline"] == 0] = np.datetime64("NaT")
    out["deadline"] = dl
    return out


SNAPSHOT_DTYPE = np.dtype(
    [
        ("id", "<u8"),
        ("state", "u1"),
        ("due", "datetime64[ms]"),
        ("attempts", "<u2"),
        ("epoch", "<u4"),
        ("deadline", "datetime64[ms]"),
    ]
)


class RowProblem(NamedTuple):
    """Rows of one shard that armdb never writes (see :func:`row_problems`)."""

    what: str  # completes "N row(s) ..."
    bad: np.ndarray  # bool mask over the rows given
    action: str  # "refuse": open raises CorruptionError; "repair": open serves them after a fix in
    #              memory (WARNING, repaired_on_open); "report": served as they are, armdb.check reports


def row_problems(rows: np.ndarray, shard_no: int, shard_count: int, var: bool, *, duplicates: bool = True,
                 due: np.ndarray | None = None, seq: np.ndarray | None = None) -> list[RowProblem]:
    """The rules a stored queue row must follow, shared by ``Db.open`` and ``armdb.check``.

    ``rows`` are the occupied slots of shard ``shard_no`` viewed as ``ROW_DTYPE``.  Their
    CRCs held, so a row that breaks a rule was not torn by a crash: the file was changed
    outside armdb.  Open refuses a row whose state, key class, id or attempts would make
    it deliver a job twice, resurrect a dead one or count its retries wrongly; it serves
    a leased row without a plausible deadline as an expired lease (after a reopen no
    lease holder can settle it anyway); fields that only inform (the payload id, the
    deadline of a row that is not leased, attempts of a delivered row) are left to check.
    An attempt count above the queue's ``max_attempts`` is not a problem: the setting can
    be lowered between opens, and such a row is dead-lettered when its lease next ends.
    ``duplicates=False`` leaves out the rule that a row id occurs once in the shard (check
    looks for ids stored twice across all shards itself); ``due`` and ``seq`` are the
    key fields as native ``uint64`` when the caller has them already.  Returns the rules
    that some row breaks, each with the mask of those rows.
    """
    if due is None:
        due = rows["due"].astype(np.uint64)
    if seq is None:
        seq = rows["seq"].astype(np.uint64)
    hdr = rows["header"]
    state = hdr["state"]
    deadline = hdr["deadline"]
    attempts = hdr["attempts"]
    out: list[RowProblem] = []
    if seq.size == 0:
        return out

    # Open runs this on every row of a queue: each rule is first judged with a reduction
    # (no array allocated), and its mask is built only when some row breaks it.
    def rule(what: str, action: str, suspect: bool, mask: Callable[[], np.ndarray]) -> None:
        if suspect:
            bad = mask()
            if bad.any():
                out.append(RowProblem(what, bad, action))

    dead_key = due >= np.uint64(DEAD_BIT)
    dead_state = state == State.DEAD
    leased = state == State.LEASED
    rule("hold an unknown state (not READY, LEASED or DEAD)", "refuse", state.max() > State.DEAD,
         lambda: state > State.DEAD)
    if not np.array_equal(dead_key, dead_state):
        rule("are in the dead key class but not DEAD", "refuse", True, lambda: dead_key & ~dead_state)
        rule("are DEAD but keyed as live rows", "refuse", True, lambda: ~dead_key & dead_state)
    rule("have row id 0, which is never handed out", "refuse", seq.min() == 0, lambda: seq == 0)
    if shard_count > 1:
        # A power of two takes a bit mask, about 20 times faster than % on uint64.
        pow2 = shard_count & (shard_count - 1) == 0
        home = seq & np.uint64(shard_count - 1) if pow2 else seq % np.uint64(shard_count)
        rule(f"belong to another shard (their row id modulo {shard_count} is not {shard_no})", "refuse",
             True, lambda: home != np.uint64(shard_no))
    rule(f"are READY with {MAX_ATTEMPTS} attempts, more than any retry can count", "refuse",
         attempts.max() == MAX_ATTEMPTS, lambda: (state == State.READY) & (attempts == MAX_ATTEMPTS))
    low = deadline.min()
    rule("are LEASED without a lease deadline", "repair", low <= 0, lambda: leased & (deadline == 0))
    rule("are LEASED with a negative lease deadline", "repair", low < 0, lambda: leased & (deadline < 0))
    rule("hold a negative lease deadline", "report", low < 0, lambda: ~leased & (deadline < 0))
    rule("were delivered (LEASED or DEAD) but count 0 attempts", "report", attempts.min() == 0,
         lambda: (leased | dead_state) & (attempts == 0))
    flags = hdr["flags"]
    known = FLAG_DEAD_EXPLICIT | FLAG_POISONED
    rule("hold flags armdb never sets (bit 0, dead-lettered explicitly, and bit 1, its body could not be "
         "decoded, on DEAD rows only)",
         "report", bool(flags.any()),
         lambda: ((flags & ~np.uint8(known)) != 0) | ((flags != 0) & ~dead_state)
         | ((flags & FLAG_POISONED) != 0) & ((flags & FLAG_DEAD_EXPLICIT) == 0))
    pid = hdr["payload_id"]
    if var:
        rule("point at a payload id other than their row id", "report", not np.array_equal(pid, seq),
             lambda: pid != seq)
    else:
        rule("hold a payload id, which a fixed queue never sets", "report", bool(pid.any()), lambda: pid != 0)
    if duplicates and seq.size > 1:
        ordered = np.sort(seq)
        again = ordered[1:] == ordered[:-1]
        rule("share their row id with another row of the shard", "refuse", bool(again.any()),
             lambda: np.isin(seq, ordered[1:][again]))
    return out


def encode_meta(var: bool, fingerprint: str, shard_count: int, value_size: int,
                layouts: list[list[list[str]]] | None = None, layout: int = 0) -> bytes:
    """``queue.meta`` (docs/format.md); ``layouts`` and ``layout``: the payload class's
    field lists over its history and the current one's index, once it changed (Q36)."""
    fields: dict[str, Any] = {"var": var, "fingerprint": fingerprint, "shard_count": shard_count,
                              "key_size": KEY_SIZE, "value_size": value_size}
    if layouts:
        fields["layouts"] = layouts
        fields["layout"] = layout
    body = msgpack.packb(fields, use_bin_type=True)
    raw = META_MAGIC + struct.pack("<II", META_VERSION, len(body)) + body
    return raw + struct.pack("<I", zlib.crc32(raw))


def decode_meta(raw: bytes, path: str) -> dict[str, Any]:
    """Decode and check ``queue.meta``.  Everything in it is input: a file whose CRC
    matches but whose fields armdb would never write (a shard count of 0 or 2000, a
    string, a missing key) is a ``FormatError`` before anything is allocated for it."""
    if len(raw) < 20 or raw[:8] != META_MAGIC:
        raise FormatError(f"{path}: not an armdb queue meta file; point armdb at its own directory")
    version, n = struct.unpack_from("<II", raw, 8)
    if version != META_VERSION:
        raise FormatError(f"{path}: queue meta format {version} is not supported; upgrade armdb")
    end = 16 + n
    if len(raw) < end + 4 or struct.unpack_from("<I", raw, end)[0] != zlib.crc32(raw[:end]):
        raise FormatError(f"{path}: queue meta fails its CRC; restore it from a backup")
    damaged = f"{path}: queue meta holds values armdb never writes"
    try:
        meta = msgpack.unpackb(raw[16:end], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # msgpack's errors are ValueErrors
        raise FormatError(f"{damaged} (its body does not decode: {e}); restore it from a backup") from None
    if not isinstance(meta, dict):
        raise FormatError(f"{damaged} (its body is not a map); restore it from a backup")
    expected: dict[str, type] = {"var": bool, "fingerprint": str, "shard_count": int, "key_size": int,
                                 "value_size": int}
    for key, kind in expected.items():
        value = meta.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FormatError(f"{damaged} ({key} = {value!r}); restore it from a backup")
    if not 1 <= meta["shard_count"] <= MAX_SHARD_COUNT:
        raise FormatError(
            f"{damaged} (shard_count = {meta['shard_count']}, not 1 to {MAX_SHARD_COUNT}); restore it from a backup"
        )
    if "layouts" in meta or "layout" in meta:
        layouts, layout = meta.get("layouts"), meta.get("layout")
        if not (
            isinstance(layouts, list)
            and 1 <= len(layouts) <= 1 << 16
            and all(isinstance(lay, list) and all(
                isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f) for f in lay
            ) for lay in layouts)
            and isinstance(layout, int) and not isinstance(layout, bool) and 0 <= layout < len(layouts)
        ):
            raise FormatError(f"{damaged} (its payload layouts); restore it from a backup")
    if meta["key_size"] != KEY_SIZE:
        raise FormatError(f"{damaged} (key_size = {meta['key_size']}, not {KEY_SIZE}); restore it from a backup")
    low, high = (HEADER_SIZE, HEADER_SIZE) if meta["var"] else (HEADER_SIZE + 1, HEADER_SIZE + MAX_FIXED_PAYLOAD)
    if not low <= meta["value_size"] <= high:
        raise FormatError(
            f"{damaged} (value_size = {meta['value_size']}, not {low} to {high}); restore it from a backup"
        )
    return meta
