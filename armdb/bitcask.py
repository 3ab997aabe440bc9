"""The Bitcask engine: append-only, CRC-checked records with an in-RAM index (SPEC S6-S12).

A collection is a directory holding ``collection.meta`` and one subfolder per
shard (``shard-000/`` ...).  Each shard appends records to data files
``NNNNNNNN.data`` and keeps a dict from key to the location of the key's latest
record.  ``docs/format.md (section "Bitcask data and hint files")`` describes every file byte by byte; the short
version:

* data file: a 32-byte file header (magic ``ARMDBBCD``, format version, flags,
  file id, base gsn, file nonce, CRC), then records, each 8-byte aligned:
  ``gsn:u64 | crc32:u32 | value_len:u32 | magic:u16 | key_len:u16 | key | value | pad``.
  ``gsn`` bit 63 marks a tombstone; bits 0-59 are the sequence number.  The CRC
  covers the gsn, ``value_len``, the record magic, ``key_len``, key and value, so
  a zero-filled region never validates (S11): its magic is 0 and its stored CRC
  0 while the CRC of 16 zero bytes is not.
* hint file ``NNNNNNNN.hint``: the index entries of one immutable data file
  (written at rotation and by compaction) so that open need not read values.
* ``compaction.pending``: the list of input files a compaction has replaced,
  written before they are unlinked so that a crash cannot leave half of them.

Encrypted collections seal the key and the value of each record separately with
AES-256-GCM (``armdb._crypto``); the AAD is the collection salt, a field tag and
the record's gsn word.  Hint files copy the sealed key bytes.  No plaintext key
or value reaches any file.

Lock policy
-----------
Each shard has two locks:

``_Shard.lock`` (a ``threading.Lock``)
    Guards everything mutable in the shard: the index, the tombstone table, the
    file table and its counters, the active file's end offset and the hint
    builder.  Every append, index update, rotation and index lookup holds it.
    Readers hold it while they look a key up *and* ``pread`` the record, so a
    location can never be used after compaction closed its file: lookup and read
    are one atomic step, and compaction swaps locations and closes input files
    only under this lock.  Tag and CRC checks of the bytes read run outside it.
    It is held across ``fdatasync`` of the active file in the write path,
    ``sync()`` and rotation, on purpose: a write that returns after its sync must
    be durable, and the descriptor being synced must not be closed or replaced
    underneath; the cost is bounded by ``sync_interval``.

``_Shard.compact_lock``
    Serialises compaction of one shard (automatic after rotation, or
    ``compact()``) and ``close()``.  Compaction copies records from immutable
    input files without holding ``lock`` (nobody writes those files, and only the
    holder of ``compact_lock`` closes them); it takes ``lock`` in short sections to
    classify a batch of records and to commit the new locations.

Locks are never nested across shards; ``compact_lock`` is always taken before
``lock``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from . import _fail, _fs, _syncmark
from ._core.fixed import bitcask_record, hint_append
from ._crcshift import crc_shift
from ._crypto import OVERHEAD, Sealer
from .config import Config
from .errors import (
    SALVAGE_HINT,
    ArmdbError,
    ConfigError,
    CorruptionError,
    DbClosed,
    EncryptionKeyRequired,
    FormatError,
    PayloadTypeError,
    StorageError,
)
from .seqmap import MAX_RESERVED

__all__ = ["FORMAT_VERSION", "MAX_KEY_LEN", "MAX_VALUE_LEN", "BitcaskStore", "check_dir"]

log = logging.getLogger("armdb")

# -- on-disk constants ----------------------------------------------------------------

FORMAT_VERSION = 1  # meta, compaction marker and hint files
# Data files: version 2 adds the synced-before flag (gsn word bit 62) and the shard's
# synced mark (then in a side file ``synced.mark``); version 3 keeps the mark in the
# file's own mark area after its header, so each sync of the file makes the mark of the
# previous one durable (armdb._syncmark), and its records start at DATA_START.  Version
# 1 files are still read, under the older rule.
DATA_VERSION = 3
DATA_READ_VERSIONS = (1, 2, 3)
MARKED_DATA_VERSION = 2
AREA_MARK_DATA_VERSION = 3
META_NAME = "collection.meta"
PENDING_NAME = "compaction.pending"

META_MAGIC = b"ARMDBBCM"
DATA_MAGIC = b"ARMDBBCD"
HINT_MAGIC = b"ARMDBBCH"
HINT_END_MAGIC = b"ARMDBBCE"
PENDING_MAGIC = b"ARMDBBCP"

# magic, version, flags, shard_count, salt, check_len   (then check, then crc32)
META_HEAD = struct.Struct("<8sHHI16sH")
# magic, version, flags, file_id, base_gsn, nonce, crc32(first 28 bytes)
FILE_HEAD = struct.Struct("<8sHHIQII")
FILE_HEADER_SIZE = FILE_HEAD.size  # 32
DATA_START = FILE_HEADER_SIZE + _syncmark.AREA_SIZE  # 64: records of a data file of version 3 on
# gsn_word, crc32, value_len, record magic, key_len
REC_HEAD = struct.Struct("<QIIHH")
REC_HEAD_SIZE = REC_HEAD.size  # 20
RECORD_MAGIC = 0xB17C
_RECORD_MAGIC_BYTES = struct.pack("<H", RECORD_MAGIC)
_U64 = struct.Struct("<Q")
# gsn_word, offset, value_len, key_len   (then the key field)
HINT_ENTRY = struct.Struct("<QQIH")
# magic, data_size, count, crc32(entries), crc32(first 28 bytes)
HINT_TRAILER = struct.Struct("<8sQQII")
# magic, version, reserved, count   (then count u32 file ids, then crc32)
PENDING_HEAD = struct.Struct("<8sHHI")
_U32 = struct.Struct("<I")

FLAG_ENCRYPTED = 1
FLAG_COMPACTED = 2

TOMBSTONE = 1 << 63
SEQ_MASK = (1 << 60) - 1
# Set on a record appended when a completed sync already covered everything before it in
# its file (data format 2): a bad record before it is then damage, not a reordered tail.
# The record's CRC covers it; sequence readers mask it out with SEQ_MASK.
SYNCED_BEFORE = 1 << 62
_RESERVED_GSN_BITS = 0x3 << 60

MAX_KEY_LEN = 0xFFFF - OVERHEAD  # the key field is u16; a sealed key is 28 bytes longer
MAX_VALUE_LEN = 0xFFFFFFFF - OVERHEAD
_MIN_FILE_SIZE = 4096
_READ_CHUNK = 4 << 20
_HINT_SPILL = 4 << 20
_COMPACT_BATCH = 4096
_COPY_FLUSH = 4 << 20

_DATA_RE = re.compile(r"^(\d{8})\.data$")
_HINT_RE = re.compile(r"^(\d{8})\.hint$")

GsnSource = Callable[[], int]


def _take(it: Iterator[Any], n: int) -> list[Any]:
    """Up to ``n`` items from an iterator."""
    out = []
    for item in it:
        out.append(item)
        if len(out) >= n:
            break
    return out


def _pad8(n: int) -> int:
    return n + (-n % 8)


def _data_name(fid: int) -> str:
    return f"{fid:08d}.data"


def _hint_name(fid: int) -> str:
    return f"{fid:08d}.hint"


def _shard_dir(directory: str, i: int) -> str:
    return os.path.join(directory, f"shard-{i:03d}")


def _read_file_header(path: str) -> bytes:
    """The first ``FILE_HEADER_SIZE`` bytes of a data or hint file (fewer if it is shorter)."""
    fs = _fs.FS
    fd = fs.open(path, os.O_RDONLY)
    try:
        return fs.pread(fd, FILE_HEADER_SIZE, 0)
    finally:
        fs.close(fd)


def _records_start_of(path: str) -> int:
    """Where the records of the data file at ``path`` start, by its header's version (a
    header that does not parse: right after the header, the earliest any version has)."""
    try:
        head = _parse_header(_read_file_header(path), path, DATA_MAGIC, "Bitcask data")
    except (FormatError, CorruptionError):
        head = None
    return FILE_HEADER_SIZE if head is None else data_start(head.version)


def _appenders(headers: dict[int, _Header | None], pending: set[int]) -> list[int]:
    """The data files a shard appended to, oldest first: the last is the active one.

    Files pending deletion (an interrupted compaction's inputs) and compaction outputs
    are not; a file whose header is zero (``None``: created just before a crash) is.
    """
    return [
        fid
        for fid in sorted(headers)
        if fid not in pending and ((h := headers[fid]) is None or not h.flags & FLAG_COMPACTED)
    ]


def _file_header(fid: int, flags: int, base_gsn: int, nonce: int, version: int = DATA_VERSION) -> bytes:
    head = FILE_HEAD.pack(DATA_MAGIC, version, flags, fid, base_gsn, nonce, 0)[:-4]
    return head + _U32.pack(zlib.crc32(head))


def _new_file_head(fid: int, flags: int, base_gsn: int, nonce: int) -> bytes:
    """What a new data file starts with: its header, then an empty mark area (a compaction
    output is never appended to, so its area stays empty: its records are all synced
    before it is published)."""
    return _file_header(fid, flags, base_gsn, nonce) + bytes(_syncmark.AREA_SIZE)


def _hint_header(fid: int, flags: int, nonce: int, identity: int) -> bytes:
    head = FILE_HEAD.pack(HINT_MAGIC, FORMAT_VERSION, flags, fid, identity, nonce, 0)[:-4]
    return head + _U32.pack(zlib.crc32(head))


def _hint_identity(data: _DataFile) -> int:
    """What a hint records of its data file, in the header's u64 at offset 16: the data
    file's header CRC (over its file id, flags, base gsn and nonce), with bit 32 set so
    that 0 still means a hint written before hints carried it."""
    return (1 << 32) | _U32.unpack_from(_data_header(data), 28)[0]


def data_start(version: int) -> int:
    """Where the records of a data file of format ``version`` start."""
    return DATA_START if version >= AREA_MARK_DATA_VERSION else FILE_HEADER_SIZE


def _synced_mark(f: _DataFile, sdir: str) -> tuple[int, int]:
    """``(mark, generation)``: the synced mark of data file ``f`` (0: none known) from
    its mark area (version 3), from the shard's side file (version 2), none before."""
    if f.version >= AREA_MARK_DATA_VERSION:
        return _syncmark.read_area(_fs.FS.pread(f.fd, DATA_START, 0))
    if f.version >= MARKED_DATA_VERSION:
        return _syncmark.read_side(sdir, _data_header(f))
    return (0, 0)


def _data_header(data: _DataFile) -> bytes:
    """The header of a data file (also the identity its synced mark cells are bound to)."""
    return _file_header(data.fid, data.flags, data.base_gsn, data.nonce, data.version)


def _record_crc(buf: bytes | memoryview, n: int) -> int:
    """CRC of a record whose first ``n`` bytes (no padding) are in ``buf``."""
    return zlib.crc32(buf[12:n], zlib.crc32(buf[0:8]))


def _new_nonce() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _storage_error(e: OSError, what: str) -> StorageError:
    return StorageError(e.errno or errno.EIO, f"{what}: {e.strerror or e}; check the disk and retry")


# -- meta file ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Meta:
    shard_count: int
    encrypted: bool
    salt: bytes
    check: bytes


def _encode_meta(meta: _Meta) -> bytes:
    flags = FLAG_ENCRYPTED if meta.encrypted else 0
    body = META_HEAD.pack(META_MAGIC, FORMAT_VERSION, flags, meta.shard_count, meta.salt, len(meta.check))
    body += meta.check
    return body + _U32.pack(zlib.crc32(body))


def _decode_meta(raw: bytes, path: str) -> _Meta:
    if len(raw) < 8 or raw[:8] != META_MAGIC:
        raise FormatError(
            f"{path} is not an armdb Bitcask collection meta file (unknown magic); "
            f"point armdb at the right directory"
        )
    if len(raw) < META_HEAD.size + 4:
        raise CorruptionError(f"{path}: meta file is truncated ({len(raw)} bytes); restore it from a backup")
    _, version, flags, shard_count, salt, check_len = META_HEAD.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{path}: collection format version {version} is not supported by this armdb "
            f"(it reads version {FORMAT_VERSION}); upgrade armdb"
        )
    end = META_HEAD.size + check_len
    if len(raw) != end + 4 or zlib.crc32(raw[:end]) != _U32.unpack_from(raw, end)[0]:
        raise CorruptionError(f"{path}: meta file fails its CRC check; restore it from a backup")
    if shard_count < 1:
        raise CorruptionError(f"{path}: meta file holds shard_count {shard_count}; restore it from a backup")
    return _Meta(shard_count, bool(flags & FLAG_ENCRYPTED), salt, raw[META_HEAD.size : end])


def _encode_pending(fids: list[int]) -> bytes:
    body = PENDING_HEAD.pack(PENDING_MAGIC, FORMAT_VERSION, 0, len(fids))
    body += b"".join(_U32.pack(f) for f in fids)
    return body + _U32.pack(zlib.crc32(body))


def _decode_pending(raw: bytes, path: str) -> list[int]:
    if len(raw) < 8 or raw[:8] != PENDING_MAGIC:
        raise FormatError(
            f"{path} is not an armdb compaction marker (unknown magic); remove the foreign file"
        )
    if len(raw) < PENDING_HEAD.size + 4:
        raise CorruptionError(f"{path}: compaction marker is truncated; restore the shard from a backup")
    _, version, _, count = PENDING_HEAD.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise FormatError(f"{path}: compaction marker version {version} is not supported; upgrade armdb")
    end = PENDING_HEAD.size + 4 * count
    if len(raw) != end + 4 or zlib.crc32(raw[:end]) != _U32.unpack_from(raw, end)[0]:
        raise CorruptionError(
            f"{path}: compaction marker fails its CRC check; restore the shard from a backup"
        )
    return [_U32.unpack_from(raw, PENDING_HEAD.size + 4 * i)[0] for i in range(count)]


def _check_pending(fids: list[int], headers: dict[int, _Header | None], path: str) -> None:
    """Refuse a compaction marker that a real compaction could not have written.

    A round's marker lists the ids of its input files in increasing order, once each.
    The inputs were immutable data files when the round started: never the active file,
    and rotation only ever creates files with newer ids, so the newest data file the
    shard appends to (``headers``: every data file present) is never named, and a file
    created just before a crash (a zero header) cannot be an input either.  Named files
    may already be gone: the crash can come after some of the unlinks.  Open deletes
    every named file, so a marker that breaks these rules is damage, and nothing is
    deleted.
    """
    what = f"{path}: compaction marker"
    fix = "nothing was deleted; remove the marker if the shard's files are intact, else restore it from a backup"
    if any(f < 1 for f in fids) or any(a >= b for a, b in zip(fids, fids[1:])):
        raise CorruptionError(f"{what} lists file ids {fids}, not increasing ids of data files; {fix}")
    named = set(fids)
    appenders = _appenders(headers, set())
    if appenders and appenders[-1] in named:
        raise CorruptionError(
            f"{what} names {_data_name(appenders[-1])}, the active data file, which compaction never "
            f"touches; {fix}"
        )
    torn = sorted(f for f in named if f in headers and headers[f] is None)
    if torn:
        raise CorruptionError(
            f"{what} names {_data_name(torn[0])}, whose header is zero (a file being created, never a "
            f"compaction input); {fix}"
        )


# -- file headers -------------------------------------------------------------------------


@dataclass
class _Header:
    fid: int
    flags: int
    base_gsn: int
    nonce: int
    version: int = DATA_VERSION


def _parse_header(raw: bytes, path: str, magic: bytes, kind: str) -> _Header | None:
    """Parse a data or hint file header; ``None`` for a short or all-zero header.

    Raises FormatError for another kind of file or an unknown version, and
    CorruptionError for a header of the right kind that fails its CRC.
    """
    if len(raw) < FILE_HEADER_SIZE or raw[:FILE_HEADER_SIZE] == bytes(FILE_HEADER_SIZE):
        prefix = raw[:8]
        if any(prefix) and not magic.startswith(prefix):
            raise FormatError(f"{path} is not an armdb {kind} file (unknown magic); remove the foreign file")
        return None  # a header torn while the file was being created
    got, version, flags, fid, base_gsn, nonce, crc = FILE_HEAD.unpack_from(raw)
    if got != magic:
        raise FormatError(f"{path} is not an armdb {kind} file (unknown magic); remove the foreign file")
    # The CRC first: a header torn by power loss (a hint file is never synced) can keep
    # its magic and lose its version bytes; only a complete header names a version.
    if zlib.crc32(raw[:28]) != crc:
        raise CorruptionError(
            f"{path}: {kind} file header fails its CRC check (offset 0); restore from a backup"
        )
    known = DATA_READ_VERSIONS if magic == DATA_MAGIC else (FORMAT_VERSION,)
    if version not in known:
        raise FormatError(
            f"{path}: {kind} format version {version} is not supported by this armdb "
            f"(it reads version {', '.join(map(str, known))}); upgrade armdb"
        )
    return _Header(fid, flags, base_gsn, nonce, version)


# -- in-RAM structures --------------------------------------------------------------------

# An index entry (and a tombstone entry) is a tuple
#   (file_id, offset, record_size, gsn_word, holders)
# ``holders`` is None or a frozenset of ids of *other* files that may still hold
# an older put of the key.  A tombstone is kept (on disk and in ``tombs``) while
# one of its holders exists, so that the older put cannot come back; once none
# does, the tombstone is garbage: its bytes count as dead and compaction drops it.
Entry = tuple[int, int, int, int, "frozenset[int] | None"]


@dataclass(eq=False)
class _DataFile:
    fid: int
    path: str
    fd: int
    size: int  # end offset: the next append goes here
    flags: int
    nonce: int
    base_gsn: int
    total: int = 0  # bytes of records (file header excluded)
    dead: int = 0  # bytes of records that are superseded or garbage tombstones
    version: int = DATA_VERSION

    @property
    def compacted(self) -> bool:
        return bool(self.flags & FLAG_COMPACTED)

    @property
    def start(self) -> int:
        """Where its records start."""
        return data_start(self.version)


class _HintBuilder:
    """Accumulates the hint entries of one data file and writes ``NNNNNNNN.hint``.

    Entries are kept in a buffer and spilled to ``NNNNNNNN.hint.tmp`` every few
    MiB (no sync), so memory stays bounded for large active files; ``finish``
    appends the trailer and renames the file into place.  A hint is only a cache
    of its data file, so an I/O error while building it never fails a write: the
    builder gives up (``broken``), and the next open scans the data file instead.
    Hint files are never synced: one lost or torn by a power failure fails its CRC
    and is rebuilt from the data file.
    """

    def __init__(self, sdir: str, data: _DataFile) -> None:
        self.final = os.path.join(sdir, _hint_name(data.fid))
        self.tmp = self.final + ".tmp"
        self.buf = bytearray(_hint_header(data.fid, data.flags, data.nonce, _hint_identity(data)))
        self.fd: int | None = None
        self.written = 0
        self.crc = 0
        self.count = 0
        self.broken = False

    def add(self, gsn_word: int, offset: int, vlen: int, key_field: bytes) -> None:
        if self.broken:
            return
        self.crc = hint_append(self.buf, self.crc, gsn_word, offset, vlen, key_field)
        self.count += 1
        if len(self.buf) >= _HINT_SPILL:
            self._spill_or_give_up()

    def add_raw(self, entries: bytes | bytearray, count: int) -> None:
        if self.broken:
            return
        self.buf += entries
        self.crc = zlib.crc32(entries, self.crc)
        self.count += count
        if len(self.buf) >= _HINT_SPILL:
            self._spill_or_give_up()

    def _spill(self) -> None:
        fs = _fs.FS
        if self.fd is None:
            self.fd = fs.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        fs.pwrite(self.fd, bytes(self.buf), self.written)
        self.written += len(self.buf)
        self.buf.clear()

    def _spill_or_give_up(self) -> None:
        try:
            self._spill()
        except OSError as e:
            log.warning("giving up hint file %s: %s (its data file will be scanned on open)", self.final, e)
            self.abort()

    def finish(self, data_size: int, *, rename: bool = True) -> bool:
        """Write the trailer and (unless ``rename`` is False) rename the file into place.

        Returns False (and writes nothing) when the builder gave up earlier.
        Raises ``OSError`` when the final writes fail; call :meth:`abort` then.
        """
        if self.broken:
            return False
        head = HINT_TRAILER.pack(HINT_END_MAGIC, data_size, self.count, self.crc, 0)[:-4]
        self.buf += head + _U32.pack(zlib.crc32(head))
        self._spill()
        fs = _fs.FS
        fd, self.fd = self.fd, None
        assert fd is not None
        fs.close(fd)
        if rename:
            fs.rename(self.tmp, self.final)
        return True

    def abort(self) -> None:
        """Give up: drop the buffer and the temporary file, if any (best effort)."""
        self.broken = True
        self.buf = bytearray()
        fs = _fs.FS
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                fs.close(fd)
            except OSError:
                pass
        try:
            if fs.exists(self.tmp):
                fs.unlink(self.tmp)
        except OSError:
            pass


@dataclass(eq=False)
class _Shard:
    idx: int
    sdir: str
    files: dict[int, _DataFile]
    active: _DataFile
    index: dict[bytes, Entry]
    tombs: dict[bytes, Entry]
    highest: int
    next_fid: int
    hint: _HintBuilder
    lock: threading.Lock = field(default_factory=threading.Lock)
    compact_lock: threading.Lock = field(default_factory=threading.Lock)
    dirty: bool = False
    last_sync: float = 0.0
    compact_due: bool = False  # rotated under a caller's lock: compact at the next chance
    closed: bool = False  # close closed this shard's descriptors (set under ``lock``)
    synced: int = 0  # the active file's offset that a completed sync covered
    marks: _syncmark.MarkWriter | None = None  # writes that offset into the active file's mark area


# -- reading records ------------------------------------------------------------------------


class _Window:
    """Chunked reader over one file, so scans do not load a whole file at once."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.start = 0
        self.buf = b""

    def view(self, pos: int, n: int) -> memoryview | None:
        """The ``n`` bytes at ``pos``, or None when the file ends before them."""
        if pos + n > self.size:
            return None
        rel = pos - self.start
        if rel < 0 or rel + n > len(self.buf):
            self.buf = _fs.FS.pread(self.fd, min(max(n, _READ_CHUNK), self.size - pos), pos)
            self.start = pos
            rel = 0
            if len(self.buf) < n:
                return None
        return memoryview(self.buf)[rel : rel + n]


def _plausible(gsn_word: int, magic: int, klen: int, vlen: int, encrypted: bool) -> bool:
    if magic != RECORD_MAGIC or gsn_word & _RESERVED_GSN_BITS or not gsn_word & SEQ_MASK:
        return False
    tomb = gsn_word & TOMBSTONE
    if encrypted:
        return klen >= OVERHEAD and (vlen == 0 if tomb else vlen >= OVERHEAD)
    return not (tomb and vlen)


# A scanned record: (offset, gsn_word, key_len, value_len, record_size, key_field)
Scanned = tuple[int, int, int, int, int, bytes]


class _Scan:
    """Iterate the valid records of a data file from ``start``; stop at the first bad one.

    After iteration, ``bad`` is the offset of the first record that is cut short
    or fails its checks (None when the file ended cleanly) and ``end`` is the end
    offset of the last good record.  The file is read in chunks of a few MiB;
    this loop runs once per record at every open, so it avoids helper calls.
    """

    def __init__(self, fd: int, size: int, encrypted: bool, start: int) -> None:
        self.fd = fd
        self.size = size
        self.encrypted = encrypted
        self.start = start
        self.bad: int | None = None
        self.end = start

    def __iter__(self) -> Iterator[Scanned]:
        pread = _fs.FS.pread
        unpack = REC_HEAD.unpack_from
        crc32 = zlib.crc32
        fd, size, encrypted = self.fd, self.size, self.encrypted
        pos = self.start
        base = pos
        buf = b""
        mv = memoryview(buf)
        while pos < size:
            rel = pos - base
            if rel + REC_HEAD_SIZE > len(buf):
                if pos + REC_HEAD_SIZE > size:
                    break
                buf = pread(fd, min(_READ_CHUNK, size - pos), pos)
                mv = memoryview(buf)
                base, rel = pos, 0
                if len(buf) < REC_HEAD_SIZE:
                    break
            gsn_word, crc, vlen, magic, klen = unpack(buf, rel)
            if magic != RECORD_MAGIC or gsn_word & _RESERVED_GSN_BITS or not gsn_word & SEQ_MASK:
                break
            if encrypted:
                if klen < OVERHEAD or (vlen != 0 if gsn_word & TOMBSTONE else vlen < OVERHEAD):
                    break
            elif gsn_word & TOMBSTONE and vlen:
                break
            n = REC_HEAD_SIZE + klen + vlen
            rsize = n + (-n % 8)
            if pos + rsize > size:
                break
            if rel + rsize > len(buf):
                buf = pread(fd, min(max(_READ_CHUNK, rsize), size - pos), pos)
                mv = memoryview(buf)
                base, rel = pos, 0
                if len(buf) < rsize:
                    break
            if crc32(mv[rel + 12 : rel + n], crc32(mv[rel : rel + 8])) != crc:
                break
            yield (pos, gsn_word, klen, vlen, rsize, buf[rel + REC_HEAD_SIZE : rel + REC_HEAD_SIZE + klen])
            pos += rsize
            self.end = pos
        if pos < size:
            self.bad = pos


# -- the search for a valid record after a bad one (S7) ------------------------------------
#
# Open tells a torn tail (nothing valid after the first bad record) from damage (a valid
# record follows) by looking for a valid record at every 8-aligned offset after the bad
# one.  A candidate may claim a length up to the end of the file, so checking each CRC
# directly costs up to the file size per candidate: quadratic on a crafted file.  Instead
# one forward pass keeps the running CRC-32 of the region and checks every candidate in
# constant time, from the linearity of CRC-32: with Z(p) the running zlib CRC from the
# region's start to offset p and h the CRC of a candidate's gsn word,
#     crc32(M[c+12 : e], h) == Z(e) ^ shift(h ^ Z(c+12), e - c - 12)
# where shift(v, L) is what L zero bytes do to the CRC register (v times x**(8L) modulo
# the polynomial).  shift is computed with numpy for a chunk's candidates at once, from
# one table per power of two of L (armdb._crcshift, shared with the log's search).

_SEARCH_CHUNK = 1 << 20


def _next_valid(fd: int, size: int, after: int, encrypted: bool) -> int | None:
    """Offset of the first valid record at an 8-aligned offset > ``after``, if any (S7).

    A valid record has a plausible header, fits in the file and matches its CRC.  One
    forward pass over the rest of the file, in chunks (see the comment above): the work
    is linear in the bytes after ``after`` whatever lengths the candidates claim.
    """
    found = _valid_after(fd, size, after, encrypted, first=True)
    return int(found[0]) if found.size else None


class _ValidIndex:
    """Every valid record at an 8-aligned offset after ``after``, found in one pass, for
    callers that ask "the next valid record after this bad one" again and again
    (``check_dir``, salvage): each question is then a lookup, not another pass."""

    def __init__(self, fd: int, size: int, after: int, encrypted: bool) -> None:
        self.after = after
        self.offsets = _valid_after(fd, size, after, encrypted, first=False)

    def next_after(self, pos: int) -> int | None:
        assert pos >= self.after
        i = int(np.searchsorted(self.offsets, pos, side="right"))
        return int(self.offsets[i]) if i < self.offsets.size else None


def _valid_after(fd: int, size: int, after: int, encrypted: bool, *, first: bool) -> np.ndarray:
    """The offsets (sorted int64) of the valid records at 8-aligned offsets > ``after``;
    with ``first``, only the first one, and the pass stops as soon as it is known."""
    fs = _fs.FS
    base = after + 8 - after % 8
    none = np.zeros(0, dtype=np.int64)
    if base + REC_HEAD_SIZE > size:
        return none
    found: list[np.ndarray] = []
    unpack = REC_HEAD.unpack_from
    crc32 = zlib.crc32
    magic_bytes = _RECORD_MAGIC_BYTES
    # Candidates whose end the pass has not reached, by the chunk their end falls in
    # (chunk k holds the ends in (start of k, end of k]): arrays of starts, ends, targets.
    waiting: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    lowest: dict[int, int] = {}  # chunk -> the smallest start waiting for it
    best: int | None = None
    z = 0  # zlib CRC of the file from base to s
    k = 0
    s = base
    while s < size:
        end = min(s + _SEARCH_CHUNK, size)
        buf = fs.pread(fd, min(end - s + 32, size - s), s)
        if len(buf) < min(end - s + 32, size - s):
            break  # the file shrank underneath: nothing more to find
        mv = memoryview(buf)
        if best is None or not first:  # with first, no later candidate can come before best
            starts: list[int] = []
            ends: list[int] = []
            regs: list[int] = []
            crcs: list[int] = []
            zz, at = z, 0
            i = buf.find(magic_bytes, 16)
            while i != -1 and i - 16 < end - s:
                rel = i - 16
                if rel % 8 == 0 and s + rel + REC_HEAD_SIZE <= size:
                    gsn_word, crc, vlen, magic, klen = unpack(buf, rel)
                    n = REC_HEAD_SIZE + klen + vlen
                    if _plausible(gsn_word, magic, klen, vlen, encrypted) and s + rel + n + (-n % 8) <= size:
                        zz = crc32(mv[at : rel + 12], zz)
                        at = rel + 12
                        starts.append(s + rel)
                        ends.append(s + rel + n)
                        regs.append(crc32(mv[rel : rel + 8]) ^ zz)
                        crcs.append(crc)
                i = buf.find(magic_bytes, i + 1)
            if starts:
                st = np.array(starts, dtype=np.int64)
                en = np.array(ends, dtype=np.int64)
                want = crc_shift(np.array(regs, dtype=np.uint32), en - st - 12) ^ np.array(crcs, dtype=np.uint32)
                chunk_of = (en - base - 1) // _SEARCH_CHUNK
                for kb in np.unique(chunk_of).tolist():
                    sel = chunk_of == kb
                    waiting.setdefault(kb, []).append((st[sel], en[sel], want[sel]))
                    low = int(st[sel][0])
                    lowest[kb] = min(lowest.get(kb, low), low)
        # The candidates that end in this chunk: Z at each end decides.
        zz, at = z, 0
        parts = waiting.pop(k, None)
        lowest.pop(k, None)
        if parts:
            st = np.concatenate([p[0] for p in parts])
            en = np.concatenate([p[1] for p in parts])
            want = np.concatenate([p[2] for p in parts])
            order = np.argsort(en, kind="stable")
            got = np.empty(len(order), dtype=np.uint32)
            for j, e in enumerate((en[order] - s).tolist()):
                zz = crc32(mv[at:e], zz)
                at = e
                got[j] = zz
            ok = st[order][got == want[order]]
            if ok.size:
                found.append(ok)
                low = int(ok.min())
                best = low if best is None else min(best, low)
        z = crc32(mv[at : end - s], zz)
        if first and best is not None and all(low > best for low in lowest.values()):
            return np.array([best], dtype=np.int64)
        s = end
        k += 1
    if first:
        return none if best is None else np.array([best], dtype=np.int64)
    return np.unique(np.concatenate(found)) if found else none


def _judge_bad(f: _DataFile, bad: int, encrypted: bool, mark: int) -> int:
    """Whether the bad record at ``bad`` of an active data file is damage (raises
    ``CorruptionError``) or a tail to cut; returns how many valid records the cut drops
    (0: a torn tail).

    In a file of data format 2 the record is damage if it lies below ``mark`` (a
    completed sync covered it) or a valid record after it carries
    :data:`SYNCED_BEFORE` (it was appended once a sync had covered the bad bytes); any
    other bad record is an unsynced tail whose pages a power cut wrote out of order.
    In a format 1 file any bad record with a valid record after it is damage."""
    if f.version < MARKED_DATA_VERSION:
        found = _next_valid(f.fd, f.size, bad, encrypted)
        if found is not None:
            raise CorruptionError(
                f"{f.path}: corrupt record at offset {bad}, followed by a valid record at offset "
                f"{found}: this is damage, not a torn write; restore the file from a backup "
                f"(armdb.check lists every bad record). {SALVAGE_HINT}"
            )
        return 0
    if bad < mark:
        raise CorruptionError(
            f"{f.path}: corrupt record at offset {bad}, below offset {mark}, which a completed sync "
            f"covered: this is damage, not a torn write; restore the file from a backup "
            f"(armdb.check lists every bad record). {SALVAGE_HINT}"
        )
    after = _valid_after(f.fd, f.size, bad, encrypted, first=False)
    base, window = 0, b""  # read in chunks: a crafted file can hold millions of records
    for off in after.tolist():
        if not base <= off <= base + len(window) - 8:
            base, window = off, _fs.FS.pread(f.fd, min(_READ_CHUNK, f.size - off), off)
        if _U64.unpack_from(window, off - base)[0] & SYNCED_BEFORE:
            raise CorruptionError(
                f"{f.path}: corrupt record at offset {bad}, followed by a valid record at offset {off} "
                f"that was appended after a sync had covered it: this is damage, not a torn write; "
                f"restore the file from a backup (armdb.check lists every bad record). {SALVAGE_HINT}"
            )
    return int(after.size)


def _iter_hint(
    raw: bytes, path: str, data: _DataFile, encrypted: bool = False, *, legacy: bool = False
) -> Iterator[Scanned] | None:
    """Validate a hint file against its data file; return an entry iterator or None if unusable.

    A hint is only a cache, so every check happens here, before the first entry is used,
    and a hint that fails one is not used (the caller scans the data file instead): the
    headers, the data file's identity (the CRC of its header: see :func:`_hint_identity`),
    the trailer, the CRC of all entries, the data size, and that the entries are plausible
    records that tile the data file exactly.  ``legacy`` accepts a hint written before
    hints carried the identity (``armdb.check`` compares every entry with the data file
    anyway; open rebuilds such a hint instead).
    """
    if len(raw) < 2 * FILE_HEADER_SIZE:
        return None
    try:
        head = _parse_header(raw, path, HINT_MAGIC, "hint")
    except CorruptionError:  # a hint is only a cache: scan the data file
        return None
    except FormatError:
        if raw[:8] == HINT_MAGIC:
            raise  # a hint of a newer format: this armdb is too old for the directory (D5)
        return None  # garbage where a hint should be: ignore the cache
    if head is None or head.fid != data.fid or head.nonce != data.nonce:
        return None
    if head.base_gsn != _hint_identity(data) and not (legacy and head.base_gsn == 0):
        return None  # written for another incarnation of the file, or by an older armdb
    tail = raw[-HINT_TRAILER.size :]
    magic, data_size, count, crc, tcrc = HINT_TRAILER.unpack(tail)
    if magic != HINT_END_MAGIC or zlib.crc32(tail[:28]) != tcrc or data_size != data.size:
        return None
    body = memoryview(raw)[FILE_HEADER_SIZE : len(raw) - HINT_TRAILER.size]
    if zlib.crc32(body) != crc:
        return None
    # One pass over the entries first: they must be records that tile the data file.
    pos = 0
    off = data.start
    n = 0
    unpack = HINT_ENTRY.unpack_from
    esize = HINT_ENTRY.size
    blen = len(body)
    while pos + esize <= blen:
        gsn_word, roff, vlen, klen = unpack(body, pos)
        pos += esize + klen
        if roff != off or pos > blen or not _plausible(gsn_word, RECORD_MAGIC, klen, vlen, encrypted):
            return None
        off += _pad8(REC_HEAD_SIZE + klen + vlen)
        n += 1
    if pos != blen or off != data_size or n != count:
        return None

    def entries() -> Iterator[Scanned]:
        pos = 0
        while pos < blen:
            gsn_word, roff, vlen, klen = unpack(body, pos)
            pos += esize
            yield (roff, gsn_word, klen, vlen, _pad8(REC_HEAD_SIZE + klen + vlen), bytes(body[pos : pos + klen]))
            pos += klen

    return entries()


# -- the store --------------------------------------------------------------------------------


class _Ingest:
    """Builds a shard's index from records seen in any order (highest gsn wins).

    ``latest`` maps a key to ``(fid, offset, size, gsn_word, seen)`` where
    ``seen`` is None or ``{fid: (max seq, is_put)}`` for the other records of the
    key.  For the common key with one record and no tombstone the tuple is
    already the final index entry, so ``finish`` only revisits the keys listed in
    ``special`` (several records, or a tombstone).
    """

    def __init__(self, unseal: Callable[[bytes, int, int, str], bytes] | None, gsn_limit: int = MAX_RESERVED) -> None:
        self.gsn_limit = gsn_limit  # every gsn on disk is below it (see _gsn_beyond)
        self.latest: dict[bytes, tuple[int, int, int, int, Any]] = {}
        self.special: set[bytes] = set()
        self.dead: dict[int, int] = {}
        self.unseal = unseal
        self.highest = 0

    def add_all(self, f: _DataFile, records: Iterable[Scanned], hint: bytearray | None) -> int:
        """Ingest every record of file ``f``; also encode hint entries into ``hint``.  Returns the count."""
        latest = self.latest
        get = latest.get
        unseal = self.unseal
        fid = f.fid
        hi = self.highest
        pack = HINT_ENTRY.pack
        count = 0
        for off, gsn_word, klen, vlen, rsize, kf in records:
            key = kf if unseal is None else unseal(kf, gsn_word, off, f.path)
            seq = gsn_word & SEQ_MASK
            if seq > hi:
                if seq >= self.gsn_limit:
                    raise _gsn_beyond(f.path, off, seq, self.gsn_limit)
                hi = seq
            cur = get(key)
            if cur is None:
                latest[key] = (fid, off, rsize, gsn_word, None)
                if gsn_word & TOMBSTONE:
                    self.special.add(key)
            else:
                self._update(key, cur, fid, off, rsize, gsn_word)
            if hint is not None:
                hint += pack(gsn_word, off, vlen, klen)
                hint += kf
            count += 1
        self.highest = hi
        return count

    def _update(
        self, key: bytes, cur: tuple[int, int, int, int, Any], fid: int, off: int, size: int, gw: int
    ) -> None:
        self.special.add(key)
        seq = gw & SEQ_MASK
        cseq = cur[3] & SEQ_MASK
        seen = dict(cur[4]) if cur[4] else {}
        if seq > cseq or (seq == cseq and fid > cur[0]):
            _note(seen, cur[0], cseq, not cur[3] & TOMBSTONE)
            self.dead[cur[0]] = self.dead.get(cur[0], 0) + cur[2]
            self.latest[key] = (fid, off, size, gw, seen)
        else:
            _note(seen, fid, seq, not gw & TOMBSTONE)
            self.dead[fid] = self.dead.get(fid, 0) + size
            self.latest[key] = (cur[0], cur[1], cur[2], cur[3], seen)

    def finish(self) -> tuple[dict[bytes, Entry], dict[bytes, Entry], dict[int, int]]:
        """Return (index, needed tombstones, dead bytes per file)."""
        latest = self.latest
        tombs: dict[bytes, Entry] = {}
        dead = self.dead
        for key in self.special:
            fid, off, size, gsn_word, seen = latest[key]
            # A file holds an older put of the key when its newest record of the key is a put.
            holders = frozenset(h for h, (_, is_put) in seen.items() if is_put and h != fid) if seen else None
            t = (fid, off, size, gsn_word, holders or None)
            if gsn_word & TOMBSTONE:
                del latest[key]
                if t[4] is None:
                    dead[fid] = dead.get(fid, 0) + size  # garbage tombstone
                else:
                    tombs[key] = t
            else:
                latest[key] = t
        index: dict[bytes, Entry] = latest  # every entry now has its final shape
        self.latest = {}
        self.special = set()
        return index, tombs, dead


def _gsn_beyond(path: str, off: int, seq: int, limit: int) -> CorruptionError:
    """A gsn at or above ``limit``: the end of the gsn block the database has reserved on disk
    (every gsn is reserved there before it is handed out), or :data:`MAX_RESERVED` without
    one.  No write produces it; accepting it would push the database's counter to the top
    of the gsn space and stop every later write."""
    return CorruptionError(
        f"{path}: record at offset {off} has gsn {seq}, not below {limit}, the end of the gsns the "
        f"database has reserved: no write made it, the file is damaged or forged. Restore the "
        f"collection from a backup (armdb.check lists every such record)"
    )


def _note(seen: dict[int, tuple[int, bool]], fid: int, seq: int, is_put: bool) -> None:
    prev = seen.get(fid)
    if prev is None or seq >= prev[0]:
        seen[fid] = (seq, is_put)


@dataclass
class _ShardPlan:
    """What open found in one shard, before it changes anything on disk."""

    idx: int
    sdir: str
    files: dict[int, _DataFile] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    has_marker: bool = False
    to_delete: list[str] = field(default_factory=list)
    active: int | None = None
    reset_active: bool = False  # active file's header was torn at creation: rewrite it
    truncate_to: int | None = None
    torn: int = 0
    mark: int = 0  # the active file's synced mark
    mark_generation: int = 0  # the generation of the cell it was read from
    unsynced: int = 0  # intact records in the cut tail (reordered, unsynced write-back)
    hints_to_write: dict[int, tuple[bytearray, int]] = field(default_factory=dict)
    active_hint: tuple[bytearray, int] = (bytearray(), 0)
    index: dict[bytes, Entry] = field(default_factory=dict)
    tombs: dict[bytes, Entry] = field(default_factory=dict)
    highest: int = 0
    max_fid: int = 0

    def close_all(self) -> None:
        for f in self.files.values():
            try:
                _fs.FS.close(f.fd)
            except OSError:
                pass
        self.files.clear()


class BitcaskStore:
    """One Bitcask collection: sharded, append-only, crash-safe key/value storage of raw bytes.

    Open it with :meth:`open`.  Keys and values are ``bytes``.  See the module
    docstring for the on-disk layout and the lock policy.
    """

    def __init__(self) -> None:  # use BitcaskStore.open
        self.directory = ""
        self.config = Config()
        self._gsn: GsnSource = lambda: 0
        self._shards: list[_Shard] = []
        self._sealer: Sealer | None = None
        self._salt = b""
        self._encrypted = False
        self._poisoned: str | None = None
        self._closed = False
        self._compact_deferred = False  # write_locked rotated a shard: maybe_compact has work
        self._torn_dropped = 0
        self._unsynced_dropped = 0
        self._gsn_limit = MAX_RESERVED
        self._compaction_bytes = 0
        self._compactions = 0

    # -- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str, config: Config, gsn: GsnSource, *, gsn_limit: int | None = None) -> BitcaskStore:
        """Open or create the collection in ``directory``.

        Parameters
        ----------
        directory : str
            The collection folder (``<db>/<collection name>``); created if missing.
        config : Config
            Bitcask settings.  ``shard_count=None`` means the stored count (1 when
            creating).
        gsn : callable
            Returns the next global sequence number; called under a shard lock for
            every record appended by :meth:`put` and :meth:`delete`.  It must
            return numbers above :attr:`max_gsn`.
        gsn_limit : int, optional
            Every gsn on disk is below it: the end of the gsn block the database has
            reserved in its sequence map.  A record or file header at or above it is
            refused with CorruptionError.  Default: ``armdb.seqmap.MAX_RESERVED``.

        Returns
        -------
        BitcaskStore

        Raises
        ------
        ConfigError
            The shard count differs from the stored one, or a key was given for an
            unencrypted collection.
        EncryptionKeyRequired
            The collection is encrypted and no key was given.
        WrongKey
            The key does not match the collection's key check value.
        FormatError
            A file of another kind or an unknown version was found; nothing on
            disk was changed.
        CorruptionError
            A record that is not a torn tail fails its checks (the message names
            the file and offset); nothing on disk was changed.
        StorageError
            An I/O error.
        """
        _validate_config(config)
        self = cls()
        self.directory = directory
        self.config = config
        self._gsn = gsn
        self._gsn_limit = MAX_RESERVED if gsn_limit is None else min(gsn_limit, MAX_RESERVED)
        fs = _fs.FS
        meta_path = os.path.join(directory, META_NAME)
        try:
            if fs.exists(meta_path):
                meta = _decode_meta(fs.read_file(meta_path), meta_path)
            else:
                meta = self._create(directory, config)
        except OSError as e:
            if isinstance(e, ArmdbError):
                raise
            raise _storage_error(e, f"cannot open collection {directory!r}") from e
        self._check_meta(meta, config, meta_path)
        self._encrypted = meta.encrypted
        self._salt = meta.salt
        plans: list[_ShardPlan] = []
        try:
            for i in range(meta.shard_count):
                plans.append(self._scan_shard_files(i))
            for plan in plans:
                self._load_shard(plan)
            for plan in plans:
                self._shards.append(self._apply_plan(plan))
        except BaseException as exc:
            for plan in plans:
                plan.close_all()
            for sh in self._shards:
                sh.hint.abort()
            if isinstance(exc, OSError) and not isinstance(exc, ArmdbError):
                raise _storage_error(exc, f"cannot open collection {directory!r}") from exc
            raise
        return self

    @property
    def max_gsn(self) -> int:
        """The largest gsn in the collection (records and file headers); seeds the Db's counter."""
        return max((sh.highest for sh in self._shards), default=0)

    def _check_meta(self, meta: _Meta, config: Config, path: str) -> None:
        if config.shard_count is not None and config.shard_count != meta.shard_count:
            raise ConfigError(
                f"collection {self.directory!r} was created with shard_count={meta.shard_count}, "
                f"but the config asks for shard_count={config.shard_count}; the shard count is fixed "
                f"at creation: leave it unset or pass {meta.shard_count}"
            )
        key = config.encryption_key
        if meta.encrypted:
            if key is None:
                raise EncryptionKeyRequired(
                    f"collection {self.directory!r} is encrypted; open it with "
                    f"Config.balanced().encryption_key(<the 32-byte key>)"
                )
            self._sealer = Sealer(key)
            self._sealer.verify(meta.check)
        elif key is not None:
            raise ConfigError(
                f"collection {self.directory!r} is not encrypted, but an encryption key was given; "
                f"open it without encryption_key (a collection's encryption is fixed at creation)"
            )

    def _create(self, directory: str, config: Config) -> _Meta:
        """Create a new collection: shard folders and first data files, then the meta file."""
        fs = _fs.FS
        count = config.shard_count or 1
        key = config.encryption_key
        salt = os.urandom(16)
        check = Sealer(key).key_check() if key is not None else b""
        meta = _Meta(count, key is not None, salt, check)
        flags = FLAG_ENCRYPTED if key is not None else 0
        fs.makedirs(directory)
        for i in range(count):
            sdir = _shard_dir(directory, i)
            if fs.isdir(sdir):
                # Leftovers of an interrupted creation (the meta file is written last).
                for name in fs.listdir(sdir):
                    path = os.path.join(sdir, name)
                    if _DATA_RE.match(name) and fs.file_size(path) > _records_start_of(path):
                        raise CorruptionError(
                            f"{os.path.join(directory, META_NAME)} is missing but {path} holds records; "
                            f"restore the meta file from a backup"
                        )
                for name in fs.listdir(sdir):
                    fs.unlink(os.path.join(sdir, name))
            fs.makedirs(sdir)
            path = os.path.join(sdir, _data_name(1))
            fs.close(fs.create_file(path, _new_file_head(1, flags, 0, _new_nonce())))
        # Synced even without enable_fsync: creation is rare, and a meta file whose
        # rename reached the disk before its bytes would make the collection unopenable.
        fs.fsync_dir(directory)
        fs.write_file_atomic(os.path.join(directory, META_NAME), _encode_meta(meta))
        return meta

    def _scan_shard_files(self, i: int) -> _ShardPlan:
        """Phase 1 (read-only): list a shard's files and check every header (D5)."""
        fs = _fs.FS
        sdir = _shard_dir(self.directory, i)
        plan = _ShardPlan(i, sdir)
        if not fs.isdir(sdir):
            raise CorruptionError(f"shard folder {sdir} is missing; restore the collection from a backup")
        names = fs.listdir(sdir)
        if PENDING_NAME in names:
            path = os.path.join(sdir, PENDING_NAME)
            plan.pending = _decode_pending(fs.read_file(path), path)
            plan.has_marker = True
        pending = set(plan.pending)
        data_fids: list[int] = []
        hint_fids: list[int] = []
        for name in names:
            if m := _DATA_RE.match(name):
                data_fids.append(int(m.group(1)))
            elif m := _HINT_RE.match(name):
                hint_fids.append(int(m.group(1)))
            elif name.endswith(".tmp"):
                plan.to_delete.append(os.path.join(sdir, name))
            elif name != PENDING_NAME:
                log.debug("ignoring unknown file %s", os.path.join(sdir, name))
        plan.max_fid = max(data_fids + hint_fids + plan.pending, default=0)
        want = FLAG_ENCRYPTED if self._encrypted else 0
        headers: dict[int, _Header | None] = {}
        for fid in data_fids:
            path = os.path.join(sdir, _data_name(fid))
            raw = _read_file_header(path)
            head = _parse_header(raw, path, DATA_MAGIC, "Bitcask data")
            if head is not None:
                if head.flags & FLAG_ENCRYPTED != want:
                    raise FormatError(
                        f"{path}: data file is {'' if head.flags & FLAG_ENCRYPTED else 'not '}encrypted but "
                        f"the collection is {'' if want else 'not '}; it belongs to another collection"
                    )
                if head.fid != fid:
                    raise CorruptionError(
                        f"{path}: header names file id {head.fid} (offset 12); restore from a backup"
                    )
            headers[fid] = head
        if plan.has_marker:
            _check_pending(plan.pending, headers, os.path.join(sdir, PENDING_NAME))
        for fid in hint_fids:
            path = os.path.join(sdir, _hint_name(fid))
            raw = _read_file_header(path)
            try:
                _parse_header(raw, path, HINT_MAGIC, "Bitcask hint")
            except CorruptionError:
                pass
            except FormatError:
                if raw[:8] == HINT_MAGIC:
                    raise  # written by a newer armdb (D5)  # a damaged hint is only a cache: the data file is scanned instead
            if fid in pending or fid not in headers:
                plan.to_delete.append(path)
        live = [fid for fid in sorted(headers) if fid not in pending]
        torn = [fid for fid in live if headers[fid] is None]
        if torn and torn != [live[-1]]:
            path = os.path.join(sdir, _data_name(torn[0]))
            raise CorruptionError(
                f"{path}: data file header is missing or zero (offset 0); restore from a backup"
            )
        appenders = _appenders(headers, pending)
        plan.active = appenders[-1] if appenders else None
        self._check_active_present(plan, live, appenders, hint_fids)
        try:
            for fid in live:
                path = os.path.join(sdir, _data_name(fid))
                head = headers[fid]
                is_active = fid == plan.active
                fd = fs.open(path, os.O_RDWR if is_active else os.O_RDONLY)
                try:
                    size = fs.size(fd)
                except BaseException:
                    fs.close(fd)
                    raise
                if head is None:
                    head = _Header(fid, want, 0, 0)
                    plan.reset_active = True
                plan.files[fid] = _DataFile(
                    fid, path, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version
                )
        except BaseException:
            plan.close_all()
            raise
        return plan

    @staticmethod
    def _check_active_present(plan: _ShardPlan, live: list[int], appenders: list[int], hint_fids: list[int]) -> None:
        """Refuse a shard whose active data file was lost (D6, S7).

        The active file is created (durably, whole) before anything is written to it
        and is never compacted, so a shard with data files always has an appendable
        one; and a hint file is written for a data file only once it is sealed, after
        its successor was created.  So only compaction outputs, or a newest appendable
        file that has a hint, mean the newest data file is gone: serving the rest would
        pass older values off as current.
        """
        if live and not appenders:
            raise CorruptionError(
                f"{plan.sdir}: holds only compaction outputs; its active data file is missing, and older "
                f"values would be served as current. Restore the shard folder from a backup"
            )
        if appenders and appenders[-1] in hint_fids:
            path = os.path.join(plan.sdir, _data_name(appenders[-1]))
            raise CorruptionError(
                f"{path} was sealed (it has a hint file) but no newer data file exists; the active data "
                f"file is missing. Restore the shard folder from a backup"
            )

    def _load_shard(self, plan: _ShardPlan) -> None:
        """Phase 2 (read-only): read hints or scan data files and build the index (S7)."""
        ing = _Ingest(self._unseal_key if self._sealer is not None else None, self._gsn_limit)
        highest = 0
        for fid in sorted(plan.files):
            f = plan.files[fid]
            if f.base_gsn >= self._gsn_limit:
                raise CorruptionError(
                    f"{f.path}: file header holds base gsn {f.base_gsn} (offset 16), not below {self._gsn_limit}, "
                    f"the end of the gsns the database has reserved; the header is damaged or forged: "
                    f"restore the collection from a backup"
                )
            highest = max(highest, f.base_gsn)
            if fid == plan.active:
                self._load_active(plan, f, ing)
                continue
            entries: Iterable[Scanned] | None = None
            hint_path = os.path.join(plan.sdir, _hint_name(fid))
            if _fs.FS.exists(hint_path) and hint_path not in plan.to_delete:
                raw = _fs.FS.read_file(hint_path)
                entries = _iter_hint(raw, hint_path, f, self._encrypted)
                if entries is None:
                    if _iter_hint(raw, hint_path, f, self._encrypted, legacy=True) is not None:
                        log.info("hint file %s was written by an older armdb; rebuilding it from %s", hint_path, f.path)
                    else:
                        log.warning(
                            "hint file %s is damaged or does not belong to %s; scanning the data file instead",
                            hint_path,
                            f.path,
                        )
            if entries is None:
                scan = _Scan(f.fd, f.size, self._encrypted, f.start)
                buf = bytearray()
                count = ing.add_all(f, scan, buf)
                if scan.bad is not None:
                    raise CorruptionError(
                        f"{f.path}: corrupt or truncated record at offset {scan.bad} in an immutable data "
                        f"file; restore the file from a backup"
                    )
                plan.hints_to_write[fid] = (buf, count)
            else:
                ing.add_all(f, entries, None)
            # Records tile a data file, so its record bytes are its size less the header.
            f.total = f.size - f.start
        plan.index, plan.tombs, dead = ing.finish()
        for fid, f in plan.files.items():
            f.dead = dead.get(fid, 0)
        plan.highest = max(highest, ing.highest)

    def _load_active(self, plan: _ShardPlan, f: _DataFile, ing: _Ingest) -> None:
        if plan.reset_active:
            found = _next_valid(f.fd, f.size, 0, self._encrypted) if f.size > REC_HEAD_SIZE else None
            if found is not None:
                raise CorruptionError(
                    f"{f.path}: data file header is missing or zero (offset 0) but a valid record "
                    f"follows at offset {found}; restore the file from a backup"
                )
            plan.torn = f.size
            plan.truncate_to = 0
            f.total = 0
            return
        scan = _Scan(f.fd, f.size, self._encrypted, f.start)
        buf = bytearray()
        count = ing.add_all(f, scan, buf)
        plan.active_hint = (buf, count)
        f.total = scan.end - f.start
        plan.mark, plan.mark_generation = _synced_mark(f, plan.sdir)
        if plan.mark > f.size:
            raise CorruptionError(
                f"{f.path}: the data file ends at offset {f.size}, below offset {plan.mark}, which a "
                f"completed sync covered: synced records are missing. Restore the file from a backup. "
                f"{SALVAGE_HINT}"
            )
        if scan.bad is not None:
            plan.unsynced = _judge_bad(f, scan.bad, self._encrypted, plan.mark)
            plan.truncate_to = scan.end
            plan.torn = f.size - scan.end

    def _unseal_key(self, key_field: bytes, gsn_word: int, off: int, path: str) -> bytes:
        assert self._sealer is not None
        return self._sealer.open(key_field, self._aad(b"K", gsn_word), what=f"{path}: key at offset {off}")

    def _apply_plan(self, plan: _ShardPlan) -> _Shard:
        """Phase 3: finish an interrupted compaction, drop temporaries, cut a torn tail."""
        fs = _fs.FS
        sync = self.config.enable_fsync
        sdir = plan.sdir
        if plan.has_marker:
            for fid in plan.pending:
                for name in (_data_name(fid), _hint_name(fid)):
                    path = os.path.join(sdir, name)
                    if fs.exists(path):
                        fs.unlink(path)
            if sync:
                fs.fsync_dir(sdir)
            fs.unlink(os.path.join(sdir, PENDING_NAME))
            log.info(
                "finished an interrupted compaction in %s (%d old files removed)", sdir, len(plan.pending)
            )
        for path in plan.to_delete:
            if fs.exists(path):
                fs.unlink(path)
        if plan.has_marker and sync:
            fs.fsync_dir(sdir)
        flags = FLAG_ENCRYPTED if self._encrypted else 0
        created = plan.active is None  # a new active file is created durably
        if plan.active is None:
            fid = plan.max_fid + 1
            active = self._new_data_file(sdir, fid, flags, plan.highest, tmp=False)
            plan.files[fid] = active
            plan.active = fid
        active = plan.files[plan.active]
        if plan.truncate_to is not None:
            fs.ftruncate(active.fd, plan.truncate_to)
            if plan.reset_active:
                active.nonce = _new_nonce()
                active.base_gsn = plan.highest
                active.flags = flags
                active.version = DATA_VERSION
                fs.pwrite(active.fd, _new_file_head(active.fid, flags, plan.highest, active.nonce), 0)
                active.size = DATA_START
            else:
                active.size = plan.truncate_to
            if sync:
                fs.fsync(active.fd)
            self._torn_dropped += plan.torn
            self._unsynced_dropped += plan.unsynced
            if plan.unsynced:
                log.warning(
                    "cut an unsynced tail of %d bytes at offset %d of %s: %d intact record(s) after a "
                    "damaged one, which no sync had covered (a power cut wrote their pages out of "
                    "order); those writes were not durable and are dropped",
                    plan.torn,
                    plan.truncate_to,
                    active.path,
                    plan.unsynced,
                )
            elif plan.torn:
                log.warning(
                    "dropped a torn tail of %d bytes at offset %d of %s (a write cut short by a crash)",
                    plan.torn,
                    plan.truncate_to,
                    active.path,
                )
        for fid, (buf, count) in plan.hints_to_write.items():
            hb = _HintBuilder(sdir, plan.files[fid])
            try:
                hb.add_raw(buf, count)
                hb.finish(plan.files[fid].size)
            except OSError as e:
                hb.abort()
                log.warning("could not write hint file %s: %s (it will be rebuilt)", hb.final, e)
        hint = _HintBuilder(sdir, active)
        buf, count = plan.active_hint
        hint.add_raw(buf, count)
        sh = _Shard(
            idx=plan.idx,
            sdir=sdir,
            files=plan.files,
            active=active,
            index=plan.index,
            tombs=plan.tombs,
            highest=plan.highest,
            next_fid=max(plan.max_fid, max(plan.files)) + 1,
            hint=hint,
        )
        sh.last_sync = time.monotonic()
        # What a completed sync covered: the mark (at most), or the whole file if open
        # just synced it (an empty mark and an unsynced size claim nothing).
        # A data file's header is synced when the file is created (a reset header only if
        # open synced it).
        synced_now = created or (sync and plan.truncate_to is not None)
        header = active.start if sync or not plan.reset_active else 0
        sh.synced = active.size if synced_now else min(max(plan.mark, header), active.size)
        if active.version >= AREA_MARK_DATA_VERSION:
            generation = 0 if plan.reset_active else plan.mark_generation
            sh.marks = _syncmark.MarkWriter(active.fd, _data_header(active), sh.synced, generation)
        else:
            # An active file of an older format has no mark area: it is synced and
            # sealed, and appends go to a new file of the current format.
            sh.dirty = True
            self._rotate(sh)
        return sh

    def _new_data_file(self, sdir: str, fid: int, flags: int, base_gsn: int, *, tmp: bool) -> _DataFile:
        """Create a data file with its header.

        With ``tmp`` (a compaction output) it is ``<name>.tmp``, unsynced, renamed later.
        Otherwise it is created whole and durably by :meth:`armdb._fs.RealFS.create_file`
        (even without ``enable_fsync``: creation is rare, and a header torn by power loss
        could not be told from a foreign file).
        """
        fs = _fs.FS
        path = os.path.join(sdir, _data_name(fid))
        nonce = _new_nonce()
        header = _new_file_head(fid, flags, base_gsn, nonce)
        if not tmp:
            try:
                fd = fs.create_file(path, header)
            except _fs.SyncFailed as e:
                raise self._sync_failed(e, path) from e
            return _DataFile(fid, path, fd, DATA_START, flags, nonce, base_gsn)
        open_path = path + ".tmp"
        fd = fs.open(open_path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            fs.pwrite(fd, header, 0)
        except BaseException:
            fs.close(fd)
            try:
                fs.unlink(open_path)
            except OSError:
                pass
            raise
        return _DataFile(fid, path, fd, DATA_START, flags, nonce, base_gsn)

    # -- helpers ---------------------------------------------------------------------------

    def _aad(self, tag: bytes, gsn_word: int) -> bytes:
        return self._salt + tag + _U64.pack(gsn_word)

    def _fsync(self, fn: Callable[[Any], None], arg: Any, what: str) -> None:
        """Run one fsync-like call; a failure poisons the store (S12) and raises StorageError."""
        try:
            fn(arg)
        except OSError as e:
            raise self._sync_failed(e, what) from e

    def _sync_failed(self, e: OSError, what: str) -> StorageError:
        """Poison the store after a failed sync (S12); returns the error to raise."""
        self._poisoned = f"sync of {what} failed: {e}"
        log.error(
            "fsync of %s failed (%s); collection %s refuses writes until the Db is reopened",
            what,
            e,
            self.directory,
        )
        return StorageError(
            e.errno or errno.EIO,
            f"fsync of {what} failed ({e.strerror or e}); the last writes may not be durable and "
            f"collection {self.directory!r} refuses further writes: reopen the Db",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise DbClosed(f"collection {self.directory!r}")

    def check_writable(self) -> None:
        if self._closed:
            raise DbClosed(f"collection {self.directory!r}")
        if self._poisoned is not None:
            raise StorageError(
                errno.EIO,
                f"collection {self.directory!r} refuses writes after a failed sync "
                f"({self._poisoned}): reopen the Db",
            )

    @staticmethod
    def _key_arg(key: object) -> bytes:
        if type(key) is bytes:
            return key
        if isinstance(key, (bytes, bytearray, memoryview)):
            return bytes(key)
        raise PayloadTypeError(f"Bitcask keys are bytes, not {type(key).__name__}")

    @staticmethod
    def _key_len_ok(key: bytes) -> bytes:
        if len(key) > MAX_KEY_LEN:
            raise ConfigError(f"key of {len(key)} bytes is longer than the limit of {MAX_KEY_LEN} bytes")
        return key

    def _shard(self, key: bytes) -> _Shard:
        shards = self._shards
        return shards[0] if len(shards) == 1 else shards[zlib.crc32(key) % len(shards)]

    def _encode(self, key: bytes, value: bytes | None, gsn_word: int) -> tuple[bytes, bytes, int]:
        """Build a record; returns (record bytes, key field, value field length)."""
        if self._sealer is not None:
            kf = self._sealer.seal(key, self._aad(b"K", gsn_word))
            vf = b"" if value is None else self._sealer.seal(value, self._aad(b"V", gsn_word))
        else:
            kf = key
            vf = b"" if value is None else value
        return bitcask_record(gsn_word, kf, vf, RECORD_MAGIC), kf, len(vf)

    def _next_seq(self, sh: _Shard) -> int:
        seq = self._gsn()
        if not isinstance(seq, int) or not sh.highest < seq <= SEQ_MASK:
            raise ArmdbError(
                f"the gsn source returned {seq!r}, which is not above this shard's highest gsn "
                f"{sh.highest}; seed the Db's counter from BitcaskStore.max_gsn"
            )
        return seq

    # -- writing ---------------------------------------------------------------------------

    def _write(self, sh: _Shard, key: bytes, value: bytes | None, seq: int) -> bool:
        """Append one record and update the index (under ``sh.lock``); True if the shard rotated."""
        fs = _fs.FS
        gsn_word = seq | (TOMBSTONE if value is None else 0)
        act = sh.active
        # Everything before this record was synced: say so (a rotation below keeps it
        # true, as a new data file is created durably).
        if act.version >= MARKED_DATA_VERSION and act.size == sh.synced:
            gsn_word |= SYNCED_BEFORE
        rec, kf, vlen = self._encode(key, value, gsn_word)
        rotated = False
        if act.total and act.size + len(rec) > self.config.max_file_size:
            try:
                self._rotate(sh)
            except OSError as e:
                if isinstance(e, ArmdbError):
                    raise
                raise _storage_error(
                    e, f"starting a new data file after {act.path} failed; nothing was written"
                ) from e
            act = sh.active
            rotated = True
        off = act.size
        try:
            fs.pwrite(act.fd, rec, off)
        except OSError as e:
            try:
                fs.ftruncate(act.fd, off)
            except OSError:
                self._poisoned = f"could not undo a failed append to {act.path}"
            raise _storage_error(e, f"append to {act.path} failed; nothing was written") from e
        size = len(rec)
        act.size = off + size
        act.total += size
        sh.dirty = True
        sh.hint.add(gsn_word, off, vlen, kf)
        _fail.point("bitcask.after_append")
        self._index_update(sh, key, act.fid, off, size, gsn_word)
        sh.highest = seq
        return rotated

    def _index_update(self, sh: _Shard, key: bytes, fid: int, off: int, size: int, gsn_word: int) -> None:
        old = sh.index.pop(key, None)
        old_put = old is not None
        if old is None:
            old = sh.tombs.pop(key, None)
        holders: frozenset[int] | None = None
        if old is not None:
            files = sh.files
            of = files.get(old[0])
            if of is not None:
                of.dead += old[2]
            # An overwrite in the active file of a key no older file holds (the common
            # case) leaves nothing to mask: holders stays None.
            if old[4] is not None or (old_put and old[0] != fid):
                hs = set(old[4] or ())
                if old_put:
                    hs.add(old[0])
                hs.discard(fid)
                holders = frozenset(h for h in hs if h in files) or None
        if gsn_word & TOMBSTONE:
            if holders is None:
                sh.files[fid].dead += size  # nothing older left to mask: garbage at once
            else:
                sh.tombs[key] = (fid, off, size, gsn_word, holders)
        else:
            sh.index[key] = (fid, off, size, gsn_word, holders)

    def _maybe_sync(self, sh: _Shard) -> None:
        cfg = self.config
        if not cfg.enable_fsync or not sh.dirty:
            return
        now = time.monotonic()
        if cfg.sync_interval and now - sh.last_sync < cfg.sync_interval:
            return
        self._fsync(_fs.FS.fdatasync, sh.active.fd, sh.active.path)
        self._synced_active(sh)
        sh.dirty = False
        sh.last_sync = now
        _fail.point("bitcask.after_sync")

    def _synced_active(self, sh: _Shard) -> None:
        """A completed sync just covered the whole active file (under ``sh.lock``): later
        appends may carry the synced-before flag, and the synced mark moves.  The mark only
        sharpens open's verdict, so a failure to write it is logged, not raised."""
        act = sh.active
        sh.synced = act.size
        if sh.marks is not None:
            try:
                sh.marks.write(act.size)
            except OSError as e:
                log.warning("%s: could not write the synced mark (%s); open will rely on record flags", act.path, e)
                sh.marks = None

    def _seal_mark(self, sh: _Shard) -> None:
        """At a clean close: sync the active file, mark its end, sync it again, so that any
        bad byte found later in it is below the mark and refused as damage."""
        act = sh.active
        if sh.marks is None:
            return
        try:
            if sh.dirty or sh.synced != act.size:
                _fs.FS.fdatasync(act.fd)
                sh.dirty = False
            sh.synced = act.size
            sh.marks.write(act.size, force=True)
            _fs.FS.fdatasync(act.fd)
        except OSError as e:
            log.warning("%s: could not seal the synced mark at close (%s)", act.path, e)

    def _rotate(self, sh: _Shard) -> None:
        """Seal the active file and start a new one (under ``sh.lock``)."""
        old = sh.active
        # The sealed file is synced even without enable_fsync: rotation is rare, and
        # it lets a log checkpoint (sync_now) sync only the active file.
        if sh.dirty:
            self._fsync(_fs.FS.fdatasync, old.fd, old.path)
        sh.dirty = False
        sh.last_sync = time.monotonic()
        fid = sh.next_fid
        new = self._new_data_file(sh.sdir, fid, old.flags & FLAG_ENCRYPTED, sh.highest, tmp=False)
        sh.next_fid = fid + 1
        sh.files[fid] = new
        sh.active = new
        sh.synced = new.size  # created durably, header and all
        if sh.marks is not None:
            sh.marks.rebind(new.fd, _data_header(new), new.size)
        else:  # a failed mark write stopped marks in the old file; the new one starts afresh
            sh.marks = _syncmark.MarkWriter(new.fd, _data_header(new), new.size)
        _fail.point("bitcask.after_rotate")
        hint, sh.hint = sh.hint, _HintBuilder(sh.sdir, new)
        try:
            hint.finish(old.size)
        except OSError as e:
            hint.abort()
            log.warning("could not write hint file %s: %s (the data file will be scanned)", hint.final, e)
        _fail.point("bitcask.after_hint")

    def put(self, key: bytes, value: bytes) -> int:
        """Store ``value`` under ``key``.

        Parameters
        ----------
        key : bytes
            At most :data:`MAX_KEY_LEN` bytes.
        value : bytes
            At most :data:`MAX_VALUE_LEN` bytes (may be empty).

        Returns
        -------
        int
            The gsn of the record written.

        Raises
        ------
        PayloadTypeError
            ``key`` or ``value`` is not bytes.
        ConfigError
            ``key`` or ``value`` is too long.
        StorageError
            The append or its sync failed; after a failed sync every later write
            fails too, until the Db is reopened (S12).
        DbClosed
            The store is closed.
        """
        key = self._key_len_ok(self._key_arg(key))
        value = self._value_arg(value)
        sh = self._shard(key)
        with sh.lock:
            self.check_writable()
            seq = self._next_seq(sh)
            rotated = self._write(sh, key, value, seq)
            self._maybe_sync(sh)
        if rotated or sh.compact_due:
            self._auto_compact(sh)
        return seq

    def delete(self, key: bytes) -> bool:
        """Delete ``key`` by appending a tombstone.

        Parameters
        ----------
        key : bytes

        Returns
        -------
        bool
            True if the key was present (a tombstone was written), False otherwise.

        Raises
        ------
        StorageError, DbClosed
            As for :meth:`put`.
        """
        key = self._key_arg(key)
        sh = self._shard(key)
        with sh.lock:
            self.check_writable()
            if key not in sh.index:
                return False
            seq = self._next_seq(sh)
            rotated = self._write(sh, key, None, seq)
            self._maybe_sync(sh)
        if rotated or sh.compact_due:
            self._auto_compact(sh)
        return True

    def apply(self, key: bytes, value: bytes | None, gsn: int) -> bool:
        """Replay one logged write idempotently (SPEC T2).

        The record is written with exactly ``gsn`` only if ``gsn`` is above the
        highest gsn of the key's shard; otherwise it was applied before.

        Parameters
        ----------
        key : bytes
        value : bytes or None
            The value, or None for a delete.
        gsn : int
            The gsn the transaction log assigned.

        Returns
        -------
        bool
            True if the step took effect now (a record was written, or a delete
            found no key), False if it was skipped as already applied.

        Raises
        ------
        StorageError, DbClosed, ConfigError, PayloadTypeError
            As for :meth:`put`.
        """
        key = self._key_len_ok(self._key_arg(key))
        if value is not None:
            value = self._value_arg(value)
        if not isinstance(gsn, int) or not 0 < gsn < MAX_RESERVED:
            raise ConfigError(f"gsn must be an int in [1, 2**56), got {gsn!r}")
        sh = self._shard(key)
        with sh.lock:
            self.check_writable()
            if gsn <= sh.highest:
                return False
            if value is None and key not in sh.index:
                return True
            rotated = self._write(sh, key, value, gsn)
            self._maybe_sync(sh)
        if rotated or sh.compact_due:
            self._auto_compact(sh)
        return True

    def _value_arg(self, value: object) -> bytes:
        if type(value) is not bytes:
            if not isinstance(value, (bytearray, memoryview)):
                raise PayloadTypeError(f"Bitcask values are bytes, not {type(value).__name__}")
            value = bytes(value)
        if len(value) > MAX_VALUE_LEN:
            raise ConfigError(
                f"value of {len(value)} bytes is larger than the limit of {MAX_VALUE_LEN} bytes"
            )
        return value  # type: ignore[return-value]

    def sync(self) -> None:
        """``fdatasync`` every shard's active file that has unsynced appends.

        Does nothing when ``enable_fsync`` is off.

        Raises
        ------
        StorageError
            A sync failed; the store is poisoned until reopened (S12).
        """
        if not self.config.enable_fsync or self._closed or self._poisoned is not None:
            return
        for sh in self._shards:
            with sh.lock:
                if sh.dirty and not self._closed and self._poisoned is None:
                    self._fsync(_fs.FS.fdatasync, sh.active.fd, sh.active.path)
                    self._synced_active(sh)
                    sh.dirty = False
                    sh.last_sync = time.monotonic()

    def sync_now(self) -> None:
        """``fdatasync`` every dirty active file even when ``enable_fsync`` is off.

        The transaction log calls this before it trims applied records: from then
        on the store's own files must hold what the log held.  (Rotation always
        syncs the file it seals, so older files need nothing here.)

        Raises
        ------
        StorageError
            The store is poisoned, or the sync failed (S12).
        """
        self.check_writable()
        for sh in self._shards:
            with sh.lock:
                self._check_open()  # a close may have closed the descriptors meanwhile
                if sh.dirty:
                    self._fsync(_fs.FS.fdatasync, sh.active.fd, sh.active.path)
                    self._synced_active(sh)
                    sh.dirty = False
                    sh.last_sync = time.monotonic()

    # -- reading ---------------------------------------------------------------------------

    def _read(self, key: bytes) -> tuple[bytes, int] | None:
        sh = self._shard(key)
        with sh.lock:
            got = self._read_locked(sh, key)
        if got is None:
            return None
        path, e, data = got
        return self._decode_value(path, e, data, key), e[3] & SEQ_MASK

    def _read_locked(self, sh: _Shard, key: bytes) -> tuple[str, Entry, bytes] | None:
        """Look ``key`` up and read its record (the caller holds ``sh.lock``)."""
        self._check_open()
        e = sh.index.get(key)
        if e is None:
            return None
        f = sh.files[e[0]]
        try:
            return f.path, e, _fs.FS.pread(f.fd, e[2], e[1])
        except OSError as err:
            raise _storage_error(err, f"read of {f.path} at offset {e[1]} failed") from err

    def _decode_value(self, path: str, e: Entry, data: bytes, key: bytes) -> bytes:
        off = e[1]
        if len(data) >= REC_HEAD_SIZE:
            gsn_word, crc, vlen, magic, klen = REC_HEAD.unpack_from(data)
            n = REC_HEAD_SIZE + klen + vlen
            if (
                gsn_word == e[3]
                and magic == RECORD_MAGIC
                and _pad8(n) == len(data)
                and _record_crc(data, n) == crc
            ):
                if self._sealer is None:
                    if data[REC_HEAD_SIZE : REC_HEAD_SIZE + klen] == key:
                        return data[REC_HEAD_SIZE + klen : n]
                else:
                    return self._sealer.open(
                        memoryview(data)[REC_HEAD_SIZE + klen : n],
                        self._aad(b"V", gsn_word),
                        what=f"{path}: value at offset {off}",
                    )
        raise CorruptionError(
            f"{path}: record at offset {off} fails its checks (CRC, length or key); "
            f"the file is damaged: restore it from a backup (armdb.check lists every bad record)"
        )

    def get(self, key: bytes) -> bytes | None:
        """Return the value stored under ``key``, or None.

        Raises
        ------
        CorruptionError
            The record fails its CRC or (encrypted) its authentication tag.
        StorageError, DbClosed
        """
        r = self._read(self._key_arg(key))
        return None if r is None else r[0]

    def get_with_gsn(self, key: bytes) -> tuple[bytes, int] | None:
        """Return ``(value, gsn)`` for ``key``, or None; the gsn identifies this version."""
        return self._read(self._key_arg(key))

    def gsn_of(self, key: bytes) -> int | None:
        """Return the gsn of the key's current record without reading it (None if absent)."""
        key = self._key_arg(key)
        sh = self._shard(key)
        with sh.lock:
            self._check_open()
            e = sh.index.get(key)
        return None if e is None else e[3] & SEQ_MASK

    def __contains__(self, key: object) -> bool:
        k = self._key_arg(key)
        sh = self._shard(k)
        with sh.lock:
            self._check_open()
            return k in sh.index

    def __len__(self) -> int:
        self._check_open()
        return sum(len(sh.index) for sh in self._shards)

    def keys(self) -> Iterator[bytes]:
        """Iterate the keys (a snapshot per shard; order unspecified)."""
        self._check_open()
        for sh in self._shards:
            with sh.lock:
                ks = list(sh.index)
            yield from ks

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Iterate ``(key, value)`` pairs; keys deleted during iteration are skipped."""
        for key in self.keys():
            r = self._read(key)
            if r is not None:
                yield key, r[0]

    def shard_of(self, key: bytes) -> int:
        """The shard a key lives in: ``zlib.crc32(key) % shard_count`` (stable)."""
        return zlib.crc32(self._key_arg(key)) % len(self._shards)

    @property
    def shard_count(self) -> int:
        """Number of shards of the collection."""
        return len(self._shards)

    @property
    def encrypted(self) -> bool:
        """Whether the collection seals its records."""
        return self._encrypted

    @property
    def poisoned(self) -> bool:
        """Whether a failed sync made the store refuse writes (S12)."""
        return self._poisoned is not None

    def stats(self) -> dict[str, Any]:
        """Counters of the collection.

        Returns
        -------
        dict
            ``keys``, ``tombstones`` (kept on disk to mask older puts), ``files``,
            ``shards``, ``data_bytes`` (sum of data file sizes), ``live_bytes``,
            ``dead_bytes``, ``compaction_bytes`` (input bytes compacted since
            open), ``compactions``, ``torn_bytes_dropped``, ``poisoned``,
            ``encrypted``.
        """
        keys = tombs = files = data = live = dead = 0
        for sh in self._shards:
            with sh.lock:
                keys += len(sh.index)
                tombs += len(sh.tombs)
                files += len(sh.files)
                for f in sh.files.values():
                    data += f.size
                    live += f.total - f.dead
                    dead += f.dead
        return {
            "keys": keys,
            "tombstones": tombs,
            "files": files,
            "shards": len(self._shards),
            "data_bytes": data,
            "live_bytes": live,
            "dead_bytes": dead,
            "compaction_bytes": self._compaction_bytes,
            "compactions": self._compactions,
            "torn_bytes_dropped": self._torn_dropped,
            "unsynced_records_dropped": self._unsynced_dropped,
            "poisoned": self._poisoned is not None,
            "encrypted": self._encrypted,
        }

    # -- hooks for the Db's transactions ---------------------------------------------------
    #
    # A commit takes the shard locks of every key it writes, in the global order
    # given by ``lock_key``, then reads and writes through the ``*_locked``
    # methods below, which do not take the lock themselves (it is not
    # reentrant).  A rotation under the caller's lock does not compact inline
    # (compaction takes ``compact_lock`` before ``lock``); it flags the shard,
    # and the next direct write or :meth:`maybe_compact` compacts it.

    def lock_key(self, key: bytes) -> tuple[str, int]:
        """Sort key of the lock guarding ``key``: ``(shard folder, 0)``, like FixedStore shards."""
        return (self._shard(self._key_arg(key)).sdir, 0)

    def lock_for(self, key: bytes) -> threading.Lock:
        """The shard lock guarding ``key``."""
        return self._shard(self._key_arg(key)).lock

    def shard_lock(self, key: bytes) -> tuple[str, threading.Lock]:
        """``(lock_key(key)[0], lock_for(key))`` in one shard lookup (the commit hot path)."""
        sh = self._shard(self._key_arg(key))
        return sh.sdir, sh.lock

    def all_locks(self) -> list[tuple[tuple[str, int], threading.Lock]]:
        """Every shard lock with its sort key (for commits that lock a whole collection)."""
        return [((sh.sdir, 0), sh.lock) for sh in self._shards]

    def get_locked(self, key: bytes) -> bytes | None:
        """:meth:`get` for a caller that already holds ``lock_for(key)``."""
        key = self._key_arg(key)
        got = self._read_locked(self._shard(key), key)
        if got is None:
            return None
        path, e, data = got
        return self._decode_value(path, e, data, key)

    def contains_locked(self, key: bytes) -> bool:
        """Whether ``key`` holds a value, for a caller that holds ``lock_for(key)`` (no read)."""
        self._check_open()
        key = self._key_arg(key)
        return key in self._shard(key).index

    def write_locked(self, key: bytes, value: bytes | None, gsn: int) -> bool:
        """Write one committed transaction row with exactly ``gsn`` (caller holds ``lock_for(key)``).

        Parameters
        ----------
        key : bytes
        value : bytes or None
            The value, or None for a delete.
        gsn : int
            The gsn the commit drew (under this lock, so above the shard's highest).

        Returns
        -------
        bool
            False for a delete of a missing key (nothing written), else True.

        Raises
        ------
        ArmdbError
            ``gsn`` is not above the shard's highest gsn (it was drawn outside the lock).
        StorageError, DbClosed, ConfigError, PayloadTypeError
            As for :meth:`put`.
        """
        key = self._key_len_ok(self._key_arg(key))
        if value is not None:
            value = self._value_arg(value)
        sh = self._shard(key)
        if sh.closed or self._poisoned is not None:
            # Only this shard's own state: a commit that holds this lock while close
            # begins (the store flagged closed, this shard not yet) applies in full.
            self.check_writable()
        if value is None and key not in sh.index:
            return False
        if not isinstance(gsn, int) or not sh.highest < gsn <= SEQ_MASK:
            raise ArmdbError(
                f"gsn {gsn!r} is not above this shard's highest gsn {sh.highest}; draw gsns for a "
                f"commit while holding the shard lock"
            )
        if self._write(sh, key, value, gsn):
            sh.compact_due = True
            self._compact_deferred = True
        self._maybe_sync(sh)
        return True

    def maybe_compact(self) -> None:
        """Run the compactions that rotations under a caller's lock deferred (never raises)."""
        if not self._compact_deferred:
            return  # the common case: no rotation under a caller's lock since the last call
        self._compact_deferred = False
        for sh in self._shards:
            if sh.compact_due and not self._closed:
                self._auto_compact(sh)

    def poison(self, reason: str) -> None:
        """Refuse every later write until reopen (e.g. after a commit failed after its log append).

        Writes after a failed apply could carry gsns above the logged rows, and the
        replay on the next open would then skip them; refusing writes keeps replay
        exact.
        """
        if self._poisoned is None:
            self._poisoned = reason
            log.error("collection %s refuses writes until reopen: %s", self.directory, reason)

    # -- compaction ------------------------------------------------------------------------

    def compact(self) -> int:
        """Compact every immutable file whose dead/total ratio exceeds ``compaction_threshold`` (S8).

        Returns
        -------
        int
            Bytes of input data files compacted.

        Raises
        ------
        CorruptionError
            An input record fails its checks (nothing is changed).
        StorageError, DbClosed
        """
        self.check_writable()
        done = 0
        for sh in self._shards:
            with sh.compact_lock:
                try:
                    done += self._compact_shard(sh)
                except OSError as e:
                    if isinstance(e, ArmdbError):
                        raise
                    raise _storage_error(e, f"compaction of {sh.sdir} failed; no data was lost") from e
        return done

    def _auto_compact(self, sh: _Shard) -> None:
        """Compact after a rotation, unless a compaction of this shard is already running."""
        sh.compact_due = False
        if not sh.compact_lock.acquire(blocking=False):
            return
        try:
            self._compact_shard(sh)
        except (ArmdbError, OSError) as e:
            log.warning("automatic compaction of %s failed: %s", sh.sdir, e)
        finally:
            sh.compact_lock.release()

    def _candidates(self, sh: _Shard) -> list[int]:
        thr = self.config.compaction_threshold
        return sorted(
            fid
            for fid, f in sh.files.items()
            if f is not sh.active and (f.total == 0 or f.dead / f.total > thr)
        )

    def _compact_shard(self, sh: _Shard) -> int:
        """Compact one shard in rounds of at most ``max_file_size`` live bytes (holds compact_lock)."""
        with sh.lock:
            if self._closed or self._poisoned is not None:
                return 0
            cands = self._candidates(sh)
        done = 0
        limit = self.config.max_file_size
        while cands:
            inputs: list[_DataFile] = []
            live_sum = 0
            with sh.lock:
                cands = [fid for fid in cands if fid in sh.files]
                for fid in cands:
                    f = sh.files[fid]
                    live = f.total - f.dead
                    if inputs and live_sum + live > limit:
                        break
                    inputs.append(f)
                    live_sum += live
            if not inputs:
                break
            cands = cands[len(inputs) :]
            done += self._compact_round(sh, inputs)
        return done

    def _plain_key(self, f: _DataFile, rec: Scanned) -> bytes:
        if self._sealer is None:
            return rec[5]
        return self._sealer.open(rec[5], self._aad(b"K", rec[1]), what=f"{f.path}: key at offset {rec[0]}")

    def _file_records(self, sdir: str, f: _DataFile) -> Iterator[Scanned]:
        """Records of an immutable file: from its hint when usable, else by a strict scan."""
        fs = _fs.FS
        hint_path = os.path.join(sdir, _hint_name(f.fid))
        entries = None
        if fs.exists(hint_path):
            try:
                entries = _iter_hint(fs.read_file(hint_path), hint_path, f, self._encrypted)
            except (FormatError, CorruptionError):
                entries = None
        if entries is not None:
            yield from entries
            return
        scan = _Scan(f.fd, f.size, self._encrypted, f.start)
        yield from scan
        if scan.bad is not None:
            raise CorruptionError(
                f"{f.path}: corrupt or truncated record at offset {scan.bad} in an immutable data file; "
                f"restore the file from a backup"
            )

    def _compact_round(self, sh: _Shard, inputs: list[_DataFile]) -> int:
        """Rewrite the live records of ``inputs`` into one new file, then remove them (S8).

        Order on disk: new file written as ``.tmp`` and synced; its hint written as
        ``.tmp``; both renamed into place and the folder synced; the index switched
        to the new copies; ``compaction.pending`` (naming every input) written
        atomically; inputs unlinked; folder synced; marker removed.  A crash
        before the renames leaves only temporaries (deleted on open); a crash
        after them leaves duplicate copies with equal gsns (harmless); a crash
        after the marker is finished by the next open, so inputs never vanish
        one by one (a dropped tombstone could otherwise let an older put return).
        """
        fs = _fs.FS
        sync = self.config.enable_fsync
        in_fids = {f.fid for f in inputs}
        out: _DataFile | None = None
        hint: _HintBuilder | None = None
        # (key, is_tombstone, old fid, old offset, new offset, size)
        copied: list[tuple[bytes, bool, int, int, int, int]] = []
        dropped: list[tuple[bytes, int, int]] = []
        dead_keys: set[bytes] = set()
        pending = bytearray()
        pending_at = new_off = DATA_START  # a new file: of the current format
        try:
            for f in inputs:
                records = self._file_records(sh.sdir, f)
                win = _Window(f.fd, f.size)
                while True:
                    batch = [(self._plain_key(f, rec), rec) for rec in _take(records, _COMPACT_BATCH)]
                    if not batch:
                        break
                    keep = self._classify(sh, f, in_fids, batch, dropped, dead_keys)
                    for key, rec in keep:
                        off, gsn_word, klen, vlen, rsize, kf = rec
                        data = win.view(off, rsize)
                        n = REC_HEAD_SIZE + klen + vlen
                        if data is None or REC_HEAD.unpack_from(data)[:2] != (gsn_word, _record_crc(data, n)):
                            raise CorruptionError(
                                f"{f.path}: record at offset {off} fails its CRC check during compaction; "
                                f"restore the file from a backup"
                            )
                        if out is None:
                            with sh.lock:
                                fid = sh.next_fid
                                sh.next_fid = fid + 1
                                base = sh.highest
                            flags = FLAG_COMPACTED | (FLAG_ENCRYPTED if self._encrypted else 0)
                            out = self._new_data_file(sh.sdir, fid, flags, base, tmp=True)
                            hint = _HintBuilder(sh.sdir, out)
                        assert hint is not None
                        pending += data
                        hint.add(gsn_word, new_off, vlen, kf)
                        copied.append((key, bool(gsn_word & TOMBSTONE), f.fid, off, new_off, rsize))
                        new_off += rsize
                        if len(pending) >= _COPY_FLUSH:
                            fs.pwrite(out.fd, bytes(pending), pending_at)
                            pending_at += len(pending)
                            pending.clear()
            if out is not None:
                assert hint is not None
                if pending:
                    fs.pwrite(out.fd, bytes(pending), pending_at)
                out.size = new_off
                out.total = new_off - out.start
                if sync:
                    self._fsync(fs.fdatasync, out.fd, out.path + ".tmp")
                _fail.point("compaction.after_new_file")
                try:
                    has_hint = hint.finish(out.size, rename=False)
                except OSError as e:
                    log.warning(
                        "could not write hint file %s: %s (the data file will be scanned)", hint.final, e
                    )
                    hint.abort()
                    has_hint = False
                _fail.point("compaction.after_hint")
                fs.rename(out.path + ".tmp", out.path)
                if has_hint:
                    fs.rename(hint.tmp, hint.final)
                if sync:
                    self._fsync(fs.fsync_dir, sh.sdir, sh.sdir)
        except BaseException:
            if out is not None:
                try:
                    fs.close(out.fd)
                    if fs.exists(out.path + ".tmp"):
                        fs.unlink(out.path + ".tmp")
                except OSError:
                    pass
            if hint is not None:
                hint.abort()
            raise
        self._commit_round(sh, inputs, in_fids, out, copied, dropped, dead_keys)
        # Records judged dead may be superseded only by unsynced appends in the active
        # file: sync it before any input is deleted, or a power loss could take both
        # the new record and the only synced old one.
        with sh.lock:
            if sh.dirty and self._poisoned is None:
                self._fsync(fs.fdatasync, sh.active.fd, sh.active.path)
                self._synced_active(sh)
                sh.dirty = False
                sh.last_sync = time.monotonic()
        # Make the removal of all inputs atomic against a crash: record them first.
        marker = os.path.join(sh.sdir, PENDING_NAME)
        fs.write_file_atomic(marker, _encode_pending(sorted(in_fids)))  # always synced, like the meta
        _fail.point("compaction.before_unlink")
        with sh.lock:
            for f in inputs:
                sh.files.pop(f.fid, None)
                try:
                    fs.close(f.fd)
                except OSError:
                    pass
        for f in inputs:
            fs.unlink(f.path)
            hp = os.path.join(sh.sdir, _hint_name(f.fid))
            if fs.exists(hp):
                fs.unlink(hp)
        if sync:
            self._fsync(fs.fsync_dir, sh.sdir, sh.sdir)
        fs.unlink(marker)
        if sync:
            self._fsync(fs.fsync_dir, sh.sdir, sh.sdir)
        compacted = sum(f.size for f in inputs)
        log.info(
            "compacted %d file(s) of %s (%d bytes) into %s",
            len(inputs),
            sh.sdir,
            compacted,
            out.path if out is not None else "nothing",
        )
        return compacted

    @staticmethod
    def _classify(
        sh: _Shard,
        f: _DataFile,
        in_fids: set[int],
        batch: list[tuple[bytes, Scanned]],
        dropped: list[tuple[bytes, int, int]],
        dead_keys: set[bytes],
    ) -> list[tuple[bytes, Scanned]]:
        """Pick the records of ``batch`` to copy: current puts and still-needed tombstones."""
        keep = []
        with sh.lock:
            for key, rec in batch:
                off, gsn_word = rec[0], rec[1]
                if gsn_word & TOMBSTONE:
                    t = sh.tombs.get(key)
                    if t is not None and t[0] == f.fid and t[1] == off:
                        # Needed while a file outside this round may hold an older put.
                        if any(h in sh.files and h not in in_fids for h in (t[4] or ())):
                            keep.append((key, rec))
                        else:
                            dropped.append((key, f.fid, off))
                        continue
                else:
                    e = sh.index.get(key)
                    if e is not None and e[0] == f.fid and e[1] == off:
                        keep.append((key, rec))
                        continue
                if key in sh.tombs:
                    dead_keys.add(key)  # a tombstone elsewhere may stop being needed
        return keep

    def _commit_round(
        self,
        sh: _Shard,
        inputs: list[_DataFile],
        in_fids: set[int],
        out: _DataFile | None,
        copied: list[tuple[bytes, bool, int, int, int, int]],
        dropped: list[tuple[bytes, int, int]],
        dead_keys: set[bytes],
    ) -> None:
        """Point the index at the new copies; records superseded meanwhile stay dead."""
        with sh.lock:
            if out is not None:
                sh.files[out.fid] = out
            for key, is_tomb, ofid, ooff, noff, rsize in copied:
                table = sh.tombs if is_tomb else sh.index
                e = table.get(key)
                if out is not None and e is not None and e[0] == ofid and e[1] == ooff:
                    table[key] = (out.fid, noff, e[2], e[3], e[4])
                elif out is not None:
                    out.dead += rsize
            for key, ofid, ooff in dropped:
                t = sh.tombs.get(key)
                if t is not None and t[0] == ofid and t[1] == ooff:
                    del sh.tombs[key]
            for key in dead_keys:
                t = sh.tombs.get(key)
                if t is None or t[0] in in_fids:
                    continue
                rest = frozenset(h for h in (t[4] or ()) if h in sh.files and h not in in_fids and h != t[0])
                if not rest:
                    del sh.tombs[key]  # nothing older left to mask: garbage now
                    tf = sh.files.get(t[0])
                    if tf is not None:
                        tf.dead += t[2]
                elif rest != t[4]:
                    sh.tombs[key] = (t[0], t[1], t[2], t[3], rest)
            self._compaction_bytes += sum(f.size for f in inputs)
            self._compactions += 1

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Sync (when ``enable_fsync``) and close every file.  A second call does nothing.

        Raises
        ------
        StorageError
            The final sync failed (the files are closed anyway).
        """
        if self._closed:
            return
        # Closed first: an operation racing the close finds the flag under the shard
        # lock (every descriptor use happens under it) and raises DbClosed, instead of
        # using a descriptor closed here, whose number another open file may reuse.
        self._closed = True
        err: BaseException | None = None
        for sh in self._shards:
            with sh.compact_lock, sh.lock:
                sh.closed = True
                if self.config.enable_fsync and sh.dirty and self._poisoned is None:
                    try:
                        self._fsync(_fs.FS.fdatasync, sh.active.fd, sh.active.path)
                        self._synced_active(sh)
                        sh.dirty = False
                    except StorageError as e:
                        err = err or e
                if self._poisoned is None and err is None:
                    self._seal_mark(sh)
                sh.marks = None
                sh.hint.abort()
                for f in sh.files.values():
                    try:
                        _fs.FS.close(f.fd)
                    except OSError:
                        pass
                sh.files = {}
                sh.index = {}
                sh.tombs = {}
        if err is not None:
            raise err

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._shards)} shards"
        return f"<BitcaskStore {self.directory!r} {state}>"


def _validate_config(config: Config) -> None:
    if not isinstance(config, Config):
        raise ConfigError("config must be an armdb.Config (Config.balanced()...build())")
    sc = config.shard_count
    if sc is not None and (not isinstance(sc, int) or isinstance(sc, bool) or sc < 1):
        raise ConfigError(f"shard_count must be an int of at least 1, got {sc!r}")
    if not isinstance(config.max_file_size, int) or config.max_file_size < _MIN_FILE_SIZE:
        raise ConfigError(
            f"max_file_size must be at least {_MIN_FILE_SIZE} bytes, got {config.max_file_size!r}"
        )
    if not 0 < config.compaction_threshold <= 1:
        raise ConfigError(f"compaction_threshold must be in (0, 1], got {config.compaction_threshold!r}")


# -- read-only check ---------------------------------------------------------------------------


def check_dir(
    directory: str, *, gsn_limit: int | None = None, decode: Callable[[bytes, bytes], object] | None = None
) -> list[str]:
    """Check a Bitcask collection that is not open, without changing anything (SPEC D6).

    Verifies the meta file, every data file header, every record's CRC, every gsn
    (below ``gsn_limit``), and every hint file against its data file.  Needs no
    encryption key: CRCs cover the sealed bytes.

    Parameters
    ----------
    directory : str
        The collection folder.
    gsn_limit : int, optional
        The end of the gsns the database reserved in its sequence map; default
        ``armdb.seqmap.MAX_RESERVED``.
    decode : callable, optional
        Called with the key and value of every put record of an unencrypted
        collection (a map's decoders); what it raises is reported as a finding.

    Returns
    -------
    list of str
        Readable findings; empty when the collection is consistent.
    """
    fs = _fs.FS
    findings: list[str] = []
    meta_path = os.path.join(directory, META_NAME)
    try:
        meta = _decode_meta(fs.read_file(meta_path), meta_path)
    except (FormatError, CorruptionError) as e:
        return [str(e)]
    except OSError as e:
        return [f"{meta_path}: cannot read the meta file ({e})"]
    count = meta.shard_count
    present = sum(1 for name in fs.listdir(directory) if name.startswith("shard-"))
    if count > present:  # a huge count in a crafted meta file: one finding, not one per shard
        findings.append(f"{meta_path}: names {count} shards but {present} shard folder(s) exist")
        count = min(count, present + 1)
    for i in range(count):
        sdir = _shard_dir(directory, i)
        try:
            _check_shard(
                sdir,
                meta.encrypted,
                findings,
                MAX_RESERVED if gsn_limit is None else gsn_limit,
                None if meta.encrypted else decode,
            )
        except OSError as e:
            findings.append(f"{sdir}: I/O error while checking ({e})")
    return findings


def _check_shard(
    sdir: str,
    encrypted: bool,
    findings: list[str],
    gsn_limit: int = MAX_RESERVED,
    decode: Callable[[bytes, bytes], object] | None = None,
) -> None:
    fs = _fs.FS
    if not fs.isdir(sdir):
        findings.append(f"{sdir}: shard folder is missing")
        return
    names = fs.listdir(sdir)
    data: dict[int, str] = {}
    hints: dict[int, str] = {}
    for name in names:
        path = os.path.join(sdir, name)
        if m := _DATA_RE.match(name):
            data[int(m.group(1))] = path
        elif m := _HINT_RE.match(name):
            hints[int(m.group(1))] = path
        elif name.endswith(".tmp"):
            findings.append(f"{path}: leftover temporary file (removed on next open)")
    want = FLAG_ENCRYPTED if encrypted else 0
    heads: dict[int, _Header] = {}
    all_heads: dict[int, _Header | None] = {}  # with None for a zero header, as open sees them
    for fid, path in sorted(data.items()):
        raw = _read_file_header(path)
        try:
            head = _parse_header(raw, path, DATA_MAGIC, "Bitcask data")
        except (FormatError, CorruptionError) as e:
            findings.append(str(e))
            continue
        all_heads[fid] = head
        if head is None:
            findings.append(f"{path}: data file header is missing or zero (offset 0)")
            continue
        if head.fid != fid:
            findings.append(f"{path}: header names file id {head.fid} (offset 12)")
        if head.flags & FLAG_ENCRYPTED != want:
            findings.append(f"{path}: encryption flag differs from the collection's (offset 10)")
        heads[fid] = head
    pending: list[int] = []
    if PENDING_NAME in names:
        path = os.path.join(sdir, PENDING_NAME)
        try:
            fids = _decode_pending(fs.read_file(path), path)
            _check_pending(fids, all_heads, path)
            pending = fids
            findings.append(
                f"{path}: an interrupted compaction is pending (files {fids}); the next open finishes it"
            )
        except (FormatError, CorruptionError) as e:
            findings.append(str(e))
    live = [fid for fid in sorted(all_heads) if fid not in pending]
    try:  # open's rule: a shard whose active data file is gone is refused
        BitcaskStore._check_active_present(
            _ShardPlan(0, sdir), live, _appenders(all_heads, set(pending)), sorted(hints)
        )
    except CorruptionError as e:
        findings.append(str(e))
    appenders = [fid for fid, h in heads.items() if not h.flags & FLAG_COMPACTED]
    active = max(appenders) if appenders else None
    for fid, head in sorted(heads.items()):
        path = data[fid]
        fd = fs.open(path, os.O_RDONLY)
        try:
            size = fs.size(fd)
            dummy = _DataFile(fid, path, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version)
            mark = _synced_mark(dummy, sdir)[0]
            if mark > size:  # open refuses the shard: synced records are gone
                findings.append(
                    f"{path}: the data file ends at offset {size}, below offset {mark}, which its synced mark "
                    f"says a completed sync covered: synced records are missing, and open refuses the shard"
                )
            records: dict[int, Scanned] = {}
            scan = _Scan(fd, size, encrypted, dummy.start)
            for rec in scan:
                records[rec[0]] = rec
            if scan.bad is not None:
                valid = _ValidIndex(fd, size, scan.bad, encrypted)  # one pass for every bad record
                nxt = valid.next_after(scan.bad)
                cut = _tail_cut(fid, path, fd, size, head, scan.bad, encrypted, mark) if fid == active else None
                if cut is not None:
                    findings.append(cut)
                else:
                    findings.append(f"{path}: corrupt record at offset {scan.bad}")
                    while nxt is not None:
                        # Report every further bad record too, resuming after each good run.
                        more = _Scan(fd, size, encrypted, start=nxt)
                        for rec in more:
                            records[rec[0]] = rec
                        if more.bad is None:
                            break
                        findings.append(f"{path}: corrupt record at offset {more.bad}")
                        nxt = valid.next_after(more.bad)
            dummy.fd = -1
            if decode is not None:
                _check_decode(path, fd, records, decode, findings)
        finally:
            fs.close(fd)
        _check_gsns(path, head, records, gsn_limit, findings)
        hpath = hints.get(fid)
        if hpath is not None:
            _check_hint(hpath, dummy, records, findings, encrypted)
    for fid, hpath in hints.items():
        if fid not in data:
            findings.append(f"{hpath}: hint file without its data file")


def _tail_cut(
    fid: int, path: str, fd: int, size: int, head: _Header, bad: int, encrypted: bool, mark: int
) -> str | None:
    """The finding for a bad record in the active data file that open would cut (a torn
    tail, or an unsynced tail a power cut reordered), or None where open refuses it as
    damage: :func:`_judge_bad` decides, as at open, from the file's synced ``mark``."""
    if mark > size:
        return None
    f = _DataFile(fid, path, fd, size, head.flags, head.nonce, head.base_gsn, version=head.version)
    try:
        dropped = _judge_bad(f, bad, encrypted, mark)
    except CorruptionError:
        return None
    if dropped:
        return (f"{path}: unsynced tail of {size - bad} bytes at offset {bad}, {dropped} intact record(s) after "
                f"a damaged one that no sync covered (cut on next open)")
    return f"{path}: torn tail of {size - bad} bytes at offset {bad} (truncated on next open)"


def _check_decode(
    path: str, fd: int, records: dict[int, Scanned], decode: Callable[[bytes, bytes], object], findings: list[str]
) -> None:
    """Report put records whose key or value the collection's decoders refuse (CRC-valid bytes
    that reads would fail on)."""
    bad: list[str] = []
    count = 0
    for off, gsn_word, klen, vlen, _rsize, kf in sorted(records.values()):
        if gsn_word & TOMBSTONE:
            continue
        value = _fs.FS.pread(fd, vlen, off + REC_HEAD_SIZE + klen)
        try:
            decode(kf, value)
        except Exception as e:  # noqa: BLE001 - a checker reports what a read would raise
            count += 1
            if len(bad) < 3:
                bad.append(f"offset {off}: {type(e).__name__}: {e}")
    if count:
        findings.append(f"{path}: {count} record(s) do not decode ({'; '.join(bad)})")


def _check_gsns(path: str, head: _Header, records: dict[int, Scanned], limit: int, findings: list[str]) -> None:
    """Report gsns no write could have produced (open refuses the collection)."""
    if head.base_gsn >= limit:
        findings.append(f"{path}: file header holds base gsn {head.base_gsn} (offset 16), not below {limit}")
    beyond = sorted(off for off, rec in records.items() if rec[1] & SEQ_MASK >= limit)
    if beyond:
        seq = records[beyond[0]][1] & SEQ_MASK
        findings.append(
            f"{path}: {len(beyond)} record(s) hold a gsn not below {limit}, the end of the gsns the "
            f"database reserved (first: gsn {seq} at offset {beyond[0]})"
        )


def _check_hint(
    hpath: str, f: _DataFile, records: dict[int, Scanned], findings: list[str], encrypted: bool = False
) -> None:
    raw = _fs.FS.read_file(hpath)
    try:
        entries = _iter_hint(raw, hpath, f, encrypted, legacy=True)
    except (FormatError, CorruptionError) as e:
        findings.append(str(e))
        return
    if entries is None:
        findings.append(f"{hpath}: hint file is damaged or does not match {f.path} (rebuilt on next open)")
        return
    n = 0
    try:
        for off, gsn_word, klen, vlen, _, kf in entries:
            n += 1
            rec = records.get(off)
            if rec is None or rec[1] != gsn_word or rec[2] != klen or rec[3] != vlen or rec[5] != kf:
                findings.append(
                    f"{hpath}: entry {n - 1} does not match the record at offset {off} of {f.path}"
                )
                return
    except CorruptionError as e:
        findings.append(str(e))
        return
    if n != len(records):
        findings.append(f"{hpath}: holds {n} entries but {f.path} has {len(records)} valid records")
