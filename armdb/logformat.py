"""The transaction log's file format: the pure codecs and constants of ``<db>/txlog`` (SPEC T2, S7).

A log file ``NNNNNNNN.log`` starts with a 32-byte header (``b"ARMTXLG1"``, format
version, flags, file number, CRC) and, from format 4 on, the 32-byte mark area that
holds its synced mark (``armdb._syncmark``); records follow from :func:`records_start`,
each 8-byte aligned::

    u32 magic 0x314E5854 ("TXN1") | u32 flags (bit 0: body sealed, bit 1: synced before)
    | u64 txid | u32 body_len | u32 crc32 (over the 20 bytes before it and the body)
    | body | pad

The records may be followed by zeros to the file's end: the runtime allocates a file's
blocks at its first durable commit, and where no valid record starts and only zeros
follow, the records end.

The body is msgpack: a list of absolute rows (``docs/transactions.md``); a sealed body's
AES-256-GCM associated data is :func:`record_aad`.  ``docs/format.md`` describes every
byte.

Here: the header and record codecs, the parse of a file's records, the linear search for
a valid record after a bad one, the verdict on a bad record (a torn or unsynced tail to
cut, or damage to refuse), and the offline check of a log folder (:func:`check_dir`).
The runtime that appends, syncs, replays and checkpoints is ``armdb.txlog``; salvage,
replay and ``armdb.check`` read the format from here.

Lock policy: none.  Every function works on bytes already read, or (``check_dir``) on a
closed database's files.
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import Any, NamedTuple

import msgpack
import numpy as np

from . import _syncmark
from ._core import fixed as _k
from ._crcshift import crc_shift
from .errors import SALVAGE_HINT, CorruptionError, FormatError

DIR = "txlog"
FILE_MAGIC = b"ARMTXLG1"
# Version 2 binds sealed bodies to the database (their AAD holds the database id from
# db.meta); version 1 files (AAD: the txid alone) are still read, and replayed as such.
# Version 3 adds the synced-before record flag and the synced mark (then in a side file
# ``txlog/synced.mark``): open cuts a bad record that neither proves was synced.  Version
# 4 keeps the mark in the file's own mark area, so each sync of the file makes the mark
# of the previous one durable (armdb._syncmark).  Versions 1 and 2 keep the older rule
# (any bad record with a valid one after it is refused).
FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
MARKED_VERSION = 3
AREA_MARK_VERSION = 4
_AAD_PREFIX = b"armdb.txlog\x00"
_FILE_HEAD = struct.Struct("<8sIIQ")  # magic, version, flags, file number; then crc32, pad to 32
FILE_HEADER_SIZE = 32
RECORDS_START = FILE_HEADER_SIZE + _syncmark.AREA_SIZE  # 64, in files of AREA_MARK_VERSION on
REC_MAGIC = 0x314E5854
_REC_HEAD = struct.Struct("<IIQI")  # magic, flags, txid, body_len; then crc32
REC_HEAD_SIZE = _REC_HEAD.size + 4  # 24
FLAG_SEALED = 1
# Set on a record appended when a completed sync already covered everything before it.
FLAG_SYNCED_BEFORE = 2
MAX_BODY = 1 << 30
MAX_TXID = (1 << 62) - 1
_NAME_RE = re.compile(r"^(\d{8})\.log$")


def _file_header(number: int) -> bytes:
    head = _FILE_HEAD.pack(FILE_MAGIC, FORMAT_VERSION, 0, number)
    head += struct.pack("<I", zlib.crc32(head))
    return head + bytes(FILE_HEADER_SIZE - len(head))


def records_start(version: int) -> int:
    """Where the records of a log file of format ``version`` start."""
    return RECORDS_START if version >= AREA_MARK_VERSION else FILE_HEADER_SIZE


def synced_mark(raw: bytes, version: int, directory: str) -> int:
    """The synced mark of the log file whose bytes are ``raw`` (0: none known): from its
    mark area (format 4), from the log's side file (format 3), none before."""
    if version >= AREA_MARK_VERSION:
        return _syncmark.read_area(raw)[0]
    if version >= MARKED_VERSION:
        return _syncmark.read_side(directory, raw[:FILE_HEADER_SIZE])[0]
    return 0


def _check_file_header(raw: bytes, path: str) -> int:
    """The file number of a log file's header; ``FormatError`` unless it is a valid
    header of a version this armdb reads (:data:`READ_VERSIONS`)."""
    return _file_header_fields(raw, path)[0]


def _file_header_fields(raw: bytes, path: str) -> tuple[int, int]:
    """``(file number, format version)`` of a valid log file header."""
    if len(raw) < FILE_HEADER_SIZE or raw[:8] != FILE_MAGIC:
        raise FormatError(f"{path}: not an armdb transaction log; point armdb at its own directory")
    _magic, version, _flags, number = _FILE_HEAD.unpack_from(raw)
    if struct.unpack_from("<I", raw, _FILE_HEAD.size)[0] != zlib.crc32(raw[: _FILE_HEAD.size]):
        raise FormatError(f"{path}: transaction log header fails its CRC; restore it from a backup")
    if version not in READ_VERSIONS:
        raise FormatError(f"{path}: transaction log format {version} is not supported; upgrade armdb")
    return int(number), int(version)


def _torn_header(raw: bytes) -> bool:
    """The header never fully reached the disk: empty, zero, or a cut-off magic.  A
    foreign magic or a complete header of another version is not torn (FormatError)."""
    head = raw[:FILE_HEADER_SIZE]
    if not any(head):
        return True
    magic = head[:8]
    if magic != FILE_MAGIC:
        return FILE_MAGIC.startswith(magic.rstrip(b"\0"))
    # The magic is ours: torn if the CRC fails (a complete header of another version
    # passes its CRC and is refused as a newer format).
    return struct.unpack_from("<I", head, _FILE_HEAD.size)[0] != zlib.crc32(head[: _FILE_HEAD.size]) if len(head) >= _FILE_HEAD.size + 4 else True


def encode_record(txid: int, body: bytes, flags: int) -> bytes:
    """One record: its head (``_REC_HEAD``), the CRC-32 of head and body, the body, zero
    padding to 8 bytes.  Encoded in C (a test in tests/test_tx.py checks it against ``_REC_HEAD``)."""
    return _k.log_record(REC_MAGIC, flags, txid, body)


def parse_records(raw: bytes, start: int) -> tuple[list[tuple[int, int, bytes]], int, int | None]:
    """Parse records from ``start``.

    Returns ``(records, end_of_valid, bad_offset)`` where each record is
    ``(txid, flags, body)``; ``bad_offset`` is where the first bad record starts,
    or None when the file ends cleanly: at its end, or where only zeros follow (a file
    allocated ahead, ``armdb.txlog``; whether a sync covered records that are gone there
    is the synced mark's to say, :func:`records_below_mark`).
    """
    recs, end, bad = _records_at(raw, start)
    return [(txid, flags, body) for _offset, txid, flags, body in recs], end, bad


def _records_at(raw: bytes, start: int) -> tuple[list[tuple[int, int, int, bytes]], int, int | None]:
    """:func:`parse_records` with each record's offset: ``(offset, txid, flags, body)``."""
    out: list[tuple[int, int, int, bytes]] = []
    pos = start
    n = len(raw)
    while pos < n:
        rec = _parse_one(raw, pos)
        if rec is None:
            if not np.frombuffer(raw, dtype=np.uint8, offset=pos).any():
                return out, pos, None  # the zeros allocated after the records: their end
            return out, pos, pos
        txid, flags, body, end = rec
        out.append((pos, txid, flags, body))
        pos = end
    return out, pos, None


class _Logged(NamedTuple):
    """One record read at open, with where it was read (for error messages) and the
    format version of its file (which says how its sealed body is bound)."""

    txid: int
    flags: int
    body: bytes
    path: str
    offset: int
    version: int = FORMAT_VERSION

    @property
    def where(self) -> str:
        return f"{self.path}: transaction log record at offset {self.offset}"


def _check_txid(rec: _Logged) -> None:
    """A txid above MAX_TXID was never handed out (they count up from 1 in each open), and
    would make the next commit's txid overflow its 64-bit field."""
    if rec.txid > MAX_TXID:
        raise CorruptionError(
            f"{rec.where}: txid {rec.txid} is beyond any armdb hands out; the record passes its CRC but "
            f"armdb never wrote it. Restore the database from a backup"
        )


def record_aad(version: int, db_id: bytes, txid: int) -> bytes:
    """The associated data a record's sealed body is bound to: in format 2 the database
    id and the txid (a record moved into another database fails its tag, as a Bitcask
    record moved into another collection does), in format 1 the txid alone."""
    if version == 1:
        return txid.to_bytes(8, "little")
    return _AAD_PREFIX + db_id + txid.to_bytes(8, "little")


def _rows(body: bytes, where: str) -> list[Any]:
    """Decode a record's (plaintext) body into its list of rows; ``CorruptionError`` if
    it is not one msgpack list."""
    try:
        rows = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # msgpack's errors are ValueErrors
        raise CorruptionError(
            f"{where}: the body does not decode ({type(e).__name__}: {e}); the record passes its CRC but "
            f"armdb never wrote it. Restore the database from a backup"
        ) from None
    if not isinstance(rows, list):
        raise CorruptionError(f"{where}: the body is not a list of rows; restore the database from a backup")
    return rows


def _parse_one(raw: bytes, pos: int) -> tuple[int, int, bytes, int] | None:
    if pos + REC_HEAD_SIZE > len(raw):
        return None
    magic, flags, txid, blen = _REC_HEAD.unpack_from(raw, pos)
    if magic != REC_MAGIC or blen > MAX_BODY:
        return None
    end = pos + REC_HEAD_SIZE + blen
    if end > len(raw):
        return None
    (crc,) = struct.unpack_from("<I", raw, pos + _REC_HEAD.size)
    body = raw[pos + REC_HEAD_SIZE : end]
    if zlib.crc32(body, zlib.crc32(raw[pos : pos + _REC_HEAD.size])) != crc:
        return None
    return txid, flags, body, end + (-(end - pos) % 8)


def records_below_mark(path: str, raw: bytes, end: int, bad: int | None, mark: int) -> str | None:
    """The problem when the records of the file ``raw`` (``end`` and ``bad`` as
    :func:`_records_at` gives them) stop below ``mark``, which a completed sync covered:
    synced records are gone (a truncated or zeroed file).  None when they reach it.  With
    a bad record the file's own end counts: a bad record below the mark is damage, which
    :func:`_judge_bad` names."""
    if bad is not None:
        end = len(raw)
    if end >= mark:
        return None
    return (f"{path}: the log file's records end at offset {end}, below offset {mark}, which a completed "
            f"sync covered (the file's synced mark): synced records are missing")


def _judge_bad(raw: bytes, path: str, bad: int, version: int, mark: int) -> int:
    """Whether the bad record at ``bad`` is damage (raises ``CorruptionError``) or a tail
    to cut; returns how many valid records the cut drops (0: a torn tail).

    In a file of :data:`MARKED_VERSION` or later, the record is damage if it lies below
    ``mark`` (a completed sync covered it) or a valid record after it carries
    :data:`FLAG_SYNCED_BEFORE` (it was appended once a sync covered the bad bytes).
    Any other bad record is an unsynced tail whose pages a power cut wrote out of order.
    In older files every bad record with a valid record after it is damage."""
    after = valid_offsets_after(raw, bad)
    if version < MARKED_VERSION:
        if after.size:
            raise CorruptionError(
                f"{path}: transaction log record at offset {bad} is damaged but later records are "
                f"intact; refusing to guess. Restore the database from a backup. {SALVAGE_HINT}"
            )
        return 0
    if bad < mark:
        raise CorruptionError(
            f"{path}: transaction log record at offset {bad} is damaged below offset {mark}, which a "
            f"completed sync covered; this is damage, not a torn write. Restore the database from a "
            f"backup. {SALVAGE_HINT}"
        )
    for off in after.tolist():
        if struct.unpack_from("<I", raw, off + 4)[0] & FLAG_SYNCED_BEFORE:
            raise CorruptionError(
                f"{path}: transaction log record at offset {bad} is damaged, and the intact record at "
                f"offset {off} was appended after a sync had covered it; this is damage, not a torn "
                f"write. Restore the database from a backup. {SALVAGE_HINT}"
            )
    return int(after.size)


def _valid_record_after(raw: bytes, pos: int) -> int | None:
    """The offset of the first valid record after ``pos`` (8-byte aligned), if any
    (:func:`valid_offsets_after`, which gives them all in the same pass)."""
    hits = valid_offsets_after(raw, pos)
    return int(hits[0]) if hits.size else None


def valid_offsets_after(raw: bytes, pos: int) -> np.ndarray:
    """The offsets of every valid record from ``pos + 8`` on (8-byte aligned), ascending.

    One forward pass, with bounded work per candidate, so that a crafted file cannot
    make open quadratic: every aligned offset from ``pos + 8`` whose magic, length and
    end are plausible is a candidate, and all candidates are CRC-checked together.  A
    candidate's CRC covers its 20 head bytes and then its body ``raw[a:e]``; with the
    running CRC ``C(x)`` of ``raw[:x]`` (one pass over the file, taken only at the
    candidates' body starts and ends) it is ``T_L(crc(head) ^ C(a)) ^ C(e)``, where
    ``T_L`` is the CRC register's linear map for ``L = e - a`` zero bytes, applied in
    ``log2(L)`` table steps (``armdb._crcshift.crc_shift``).  The verdict is the one checking each
    candidate with :func:`_parse_one` gives (tests/test_hostile_log.py compares them).
    """
    none = np.zeros(0, dtype=np.int64)
    n = len(raw)
    first = pos + 8
    first += -(first - FILE_HEADER_SIZE) % 8
    if first + REC_HEAD_SIZE > n:
        return none
    words = np.frombuffer(raw, dtype="<u4", count=n // 4)
    # Aligned offsets are multiples of 4 (FILE_HEADER_SIZE is), so each field is a word.
    m = (n - REC_HEAD_SIZE - first) // 8 + 1
    base = first // 4
    magic = words[base : base + 2 * m : 2]
    offsets = first + 8 * np.flatnonzero(magic == REC_MAGIC).astype(np.int64)
    if offsets.size == 0:
        return none
    blen = words[offsets // 4 + 4].astype(np.int64)
    ok = (blen <= MAX_BODY) & (offsets + REC_HEAD_SIZE + blen <= n)
    offsets, blen = offsets[ok], blen[ok]
    if offsets.size == 0:
        return none
    stored = words[offsets // 4 + 5]
    starts = offsets + REC_HEAD_SIZE
    ends = starts + blen
    # Running CRC at every body start and end, in one pass over the file.
    marks, where = np.unique(np.concatenate((starts, ends)), return_inverse=True)
    view = memoryview(raw)
    prefix = np.empty(marks.size, dtype=np.uint32)
    crc, prev = 0, 0
    for i, x in enumerate(marks.tolist()):
        crc = zlib.crc32(view[prev:x], crc)
        prefix[i] = crc
        prev = x
    c_start, c_end = prefix[where[: starts.size]], prefix[where[starts.size :]]
    heads = np.fromiter((zlib.crc32(view[p : p + _REC_HEAD.size]) for p in offsets.tolist()), np.uint32, offsets.size)
    crcs = crc_shift(heads ^ c_start, blen) ^ c_end
    return offsets[crcs == stored]


def _tail_finding(raw: bytes, path: str, bad: int, version: int, mark: int) -> str:
    """What open would do with the bad record at ``bad``, in check's words: cut a torn or
    unsynced tail, or refuse damage (:func:`_judge_bad` decides, as at open)."""
    try:
        dropped = _judge_bad(raw, path, bad, version, mark)
    except CorruptionError as e:
        return str(e)
    if dropped:
        return (f"{path}: unsynced tail of {len(raw) - bad} bytes at offset {bad}, {dropped} intact record(s) "
                f"after a damaged one that no sync covered (cut on next open)")
    return f"{path}: torn tail of {len(raw) - bad} bytes at offset {bad} (cut on next open)"
