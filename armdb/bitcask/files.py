"""Reading and writing the files of one Bitcask shard (SPEC S7, S11).

The open data file (:class:`_DataFile`), the hint builder that caches a data file's
index entries, the record scan, the linear search for a valid record after a bad one
(which tells a torn tail from damage), the verdict on a bad record of the active file
(:func:`_judge_bad`), the hint reader and the synced mark of a data file.  Every byte
layout comes from ``armdb.bitcask.format``; every file access goes through
``armdb._fs``.

Lock policy: none here.  These helpers work on one file and take no lock; the store
(``armdb.bitcask.store``) and compaction call them under the shard locks that
``armdb.bitcask.shard`` describes, and open's recovery and the offline check before
any store exists.
"""

from __future__ import annotations

import errno
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .. import _fs, _syncmark
from .._core.fixed import crc32 as _crc32
from .._core.fixed import hint_append
from .._crcshift import crc_shift
from .._crypto import OVERHEAD
from ..errors import SALVAGE_HINT, CorruptionError, FormatError, StorageError
from .format import (
    _RECORD_MAGIC_BYTES,
    _RESERVED_GSN_BITS,
    _U32,
    _U64,
    AREA_MARK_DATA_VERSION,
    DATA_MAGIC,
    DATA_START,
    DATA_VERSION,
    FILE_HEADER_SIZE,
    FLAG_COMPACTED,
    HINT_END_MAGIC,
    HINT_ENTRY,
    HINT_MAGIC,
    HINT_TRAILER,
    MARKED_DATA_VERSION,
    REC_HEAD,
    REC_HEAD_SIZE,
    RECORD_MAGIC,
    SEQ_MASK,
    SYNCED_BEFORE,
    TOMBSTONE,
    _data_header,
    _hint_header,
    _hint_identity,
    _hint_name,
    _pad8,
    _parse_header,
    _plausible,
    data_start,
)

log = logging.getLogger("armdb")

_READ_CHUNK = 4 << 20
_HINT_SPILL = 4 << 20


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


def _new_nonce() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _storage_error(e: OSError, what: str) -> StorageError:
    return StorageError(e.errno or errno.EIO, f"{what}: {e.strerror or e}; check the disk and retry")


# -- in-RAM structures --------------------------------------------------------------------


@dataclass(eq=False, slots=True)
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

    __slots__ = ("final", "tmp", "buf", "parts", "parked", "fd", "written", "crc", "count", "broken")

    def __init__(self, sdir: str, data: _DataFile) -> None:
        self.final = os.path.join(sdir, _hint_name(data.fid))
        self.tmp = self.final + ".tmp"
        self.buf = bytearray(_hint_header(data.fid, data.flags, data.nonce, _hint_identity(data)))
        # Group writes' entries (add_raw), after ``buf``, kept as they came and joined once
        # at the spill: appending each to ``buf`` copied the whole buffer at every regrowth
        # (a few hundred instructions a batched job).  ``parked``: their bytes.
        self.parts: list[bytes] = []
        self.parked = 0
        self.fd: int | None = None
        self.written = 0
        self.crc = 0
        self.count = 0
        self.broken = False

    def add(self, gsn_word: int, offset: int, vlen: int, key_field: bytes) -> None:
        if self.broken:
            return
        if self.parts:  # (in order: the parked entries come first)
            self._unpark()
        self.crc = hint_append(self.buf, self.crc, gsn_word, offset, vlen, key_field)
        self.count += 1
        if len(self.buf) >= _HINT_SPILL:
            self._spill_or_give_up()

    def add_raw(self, entries: bytes | bytearray, count: int) -> None:
        if self.broken:
            return
        self.parts.append(entries if type(entries) is bytes else bytes(entries))  # (a caller may reuse its buffer)
        self.parked += len(entries)
        self.crc = _crc32(entries, self.crc)  # (zlib's CRC-32, by the kernels' carry-less multiply)
        self.count += count
        if len(self.buf) + self.parked >= _HINT_SPILL:
            self._spill_or_give_up()

    def _unpark(self) -> None:
        self.buf += b"".join(self.parts)
        self.parts.clear()
        self.parked = 0

    def _spill(self) -> None:
        fs = _fs.FS
        if self.fd is None:
            self.fd = fs.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        data = b"".join([self.buf, *self.parts]) if self.parts else bytes(self.buf)
        fs.pwrite(self.fd, data, self.written)
        self.written += len(data)
        self.buf.clear()
        self.parts.clear()
        self.parked = 0

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
        if self.parts:
            self._unpark()
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
        self.parts = []
        self.parked = 0
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


def _synced_mark(f: _DataFile, sdir: str) -> tuple[int, int]:
    """``(mark, generation)``: the synced mark of data file ``f`` (0: none known) from
    its mark area (version 3), from the shard's side file (version 2), none before."""
    if f.version >= AREA_MARK_DATA_VERSION:
        return _syncmark.read_area(_fs.FS.pread(f.fd, DATA_START, 0))
    if f.version >= MARKED_DATA_VERSION:
        return _syncmark.read_side(sdir, _data_header(f))
    return (0, 0)


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
