"""Bitcask on-disk format: the pure codecs and constants of every file of a collection.

Magics and versions, the file header of data and hint files, the record head and
its CRC rule, the hint entry and trailer, the meta file (``collection.meta``), the
compaction marker (``compaction.pending``) and the file names.  Nothing here opens a
file or holds a lock: each function maps bytes to values or values to bytes, so the
runtime (``armdb.bitcask.store``), open's recovery, the offline check and salvage all
read the format from one place.  ``docs/format.md`` (section "Bitcask data and hint
files") describes every byte.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Protocol

from .. import _syncmark
from .._crypto import OVERHEAD
from ..errors import CorruptionError, FormatError

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

_DATA_RE = re.compile(r"^(\d{8})\.data$")
_HINT_RE = re.compile(r"^(\d{8})\.hint$")


def _pad8(n: int) -> int:
    return n + (-n % 8)


def _data_name(fid: int) -> str:
    return f"{fid:08d}.data"


def _hint_name(fid: int) -> str:
    return f"{fid:08d}.hint"


def _shard_dir(directory: str, i: int) -> str:
    return os.path.join(directory, f"shard-{i:03d}")


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


class _HeaderFields(Protocol):
    """What a data file's header says of it: a parsed :class:`_Header`, or the open file
    (``armdb.bitcask.files._DataFile``) that carries the same fields."""

    @property
    def fid(self) -> int: ...
    @property
    def flags(self) -> int: ...
    @property
    def base_gsn(self) -> int: ...
    @property
    def nonce(self) -> int: ...
    @property
    def version(self) -> int: ...


def _hint_identity(data: _HeaderFields) -> int:
    """What a hint records of its data file, in the header's u64 at offset 16: the data
    file's header CRC (over its file id, flags, base gsn and nonce), with bit 32 set so
    that 0 still means a hint written before hints carried it."""
    return (1 << 32) | _U32.unpack_from(_data_header(data), 28)[0]


def data_start(version: int) -> int:
    """Where the records of a data file of format ``version`` start."""
    return DATA_START if version >= AREA_MARK_DATA_VERSION else FILE_HEADER_SIZE


def _data_header(data: _HeaderFields) -> bytes:
    """The header of a data file (also the identity its synced mark cells are bound to)."""
    return _file_header(data.fid, data.flags, data.base_gsn, data.nonce, data.version)


def _record_crc(buf: bytes | memoryview, n: int) -> int:
    """CRC of a record whose first ``n`` bytes (no padding) are in ``buf``."""
    return zlib.crc32(buf[12:n], zlib.crc32(buf[0:8]))


def _plausible(gsn_word: int, magic: int, klen: int, vlen: int, encrypted: bool) -> bool:
    if magic != RECORD_MAGIC or gsn_word & _RESERVED_GSN_BITS or not gsn_word & SEQ_MASK:
        return False
    tomb = gsn_word & TOMBSTONE
    if encrypted:
        return klen >= OVERHEAD and (vlen == 0 if tomb else vlen >= OVERHEAD)
    return not (tomb and vlen)


def record_aad(salt: bytes, tag: bytes, gsn_word: int) -> bytes:
    """The associated data a sealed field of an encrypted collection is bound to: the
    collection's salt, the field's tag (``b"K"`` key, ``b"V"`` value) and the record's
    gsn word, so a field moved to another record or collection fails its tag."""
    return salt + tag + _U64.pack(gsn_word)


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
