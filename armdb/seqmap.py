"""The persisted sequence map: id blocks reserved ahead of use (SPEC T5).

Queue row ids and the global sequence numbers (gsn) of Bitcask records are handed
out from blocks of :data:`ID_BLOCK`.  Before the first id of a block is handed out,
the block's end is written to the ``seqmap`` file and synced.  After a crash,
counting restarts at the end of every reserved block, so no id is handed out twice;
at most ``ID_BLOCK - 1`` ids per name are skipped.

File layout (format 2): two copies of :data:`COPY_SIZE` bytes (more if the map
outgrows them), each ``b"ARMSEQ02"``, ``u32`` format version, ``u32`` copy size,
``u64`` generation, ``u32`` body length, msgpack ``{name: reserved_end}``, ``u32``
CRC32 of everything before it, zero padding.  A reservation overwrites the older
copy in place and ``fdatasync``s it: one sync, where a new file (tmp, fsync, rename,
directory fsync) took two, and the other copy stays intact if the write tears.
Open uses the valid copy with the higher generation.  The file is created whole
(tmp + rename), and recreated the same way when the map outgrows its copies, after
a failed sync, and over a format 1 file (one copy, ``b"ARMSEQ01"``), which is still
read.
"""

from __future__ import annotations

import collections.abc
import os
import struct
import threading
import zlib
from typing import NamedTuple

import msgpack

from . import _fail, _fs
from .errors import FormatError, StorageError

ID_BLOCK = 1024
MAGIC = b"ARMSEQ02"
MAGIC_V1 = b"ARMSEQ01"
FORMAT_VERSION = 2
COPY_SIZE = 4096
FILE_NAME = "seqmap"
_COPY = struct.Struct("<8sIIQI")  # magic, version, copy size, generation, body length
_HEAD_V1 = struct.Struct("<8sII")


def _encode_copy(reserved: dict[str, int], generation: int, copy_size: int) -> bytes | None:
    """One copy, padded to ``copy_size``; None if the map does not fit."""
    body = msgpack.packb(reserved, use_bin_type=True)
    raw = _COPY.pack(MAGIC, FORMAT_VERSION, copy_size, generation, len(body)) + body
    if len(raw) + 4 > copy_size:
        return None
    raw += struct.pack("<I", zlib.crc32(raw))
    return raw + bytes(copy_size - len(raw))


def encode(reserved: dict[str, int], generation: int = 1) -> bytes:
    """A whole format-2 file holding ``reserved`` in both copies."""
    size = COPY_SIZE
    while (copy := _encode_copy(reserved, generation, size)) is None:
        size *= 2
    return copy + copy


def _body(raw: bytes, path: str) -> dict[str, int]:
    data = msgpack.unpackb(raw, raw=False)
    if not isinstance(data, dict):
        raise FormatError(f"{path}: sequence map body is not a map")
    return {str(k): int(v) for k, v in data.items()}


def _decode_v1(raw: bytes, path: str) -> dict[str, int]:
    _, version, n = _HEAD_V1.unpack_from(raw)
    if version != 1:
        raise FormatError(f"{path}: sequence map format {version} is not supported; upgrade armdb")
    end = _HEAD_V1.size + n
    if len(raw) < end + 4 or struct.unpack_from("<I", raw, end)[0] != zlib.crc32(raw[:end]):
        raise FormatError(f"{path}: sequence map fails its CRC; restore it from a backup")
    return _body(raw[_HEAD_V1.size : end], path)


def _copy_at(raw: bytes, off: int, copy_size: int, path: str) -> tuple[int, dict[str, int]] | None:
    """``(generation, map)`` of the copy at ``off``, or None if it is torn or damaged."""
    if len(raw) < off + _COPY.size + 4 or raw[off : off + 8] != MAGIC:
        return None
    _, version, size, generation, n = _COPY.unpack_from(raw, off)
    end = off + _COPY.size + n
    if size != copy_size or end + 4 > off + size or struct.unpack_from("<I", raw, end)[0] != zlib.crc32(raw[off:end]):
        return None  # the CRC first: a torn copy's version field means nothing
    if version != FORMAT_VERSION:
        raise FormatError(f"{path}: sequence map format {version} is not supported; upgrade armdb")
    return generation, _body(raw[off + _COPY.size : end], path)


class SeqFile(NamedTuple):
    reserved: dict[str, int]
    copy_size: int  # 0 for a format-1 file
    generation: int
    newest: int  # the copy holding ``reserved`` (-1 for a format-1 file)
    damaged: bool  # the other copy fails its CRC (a crash tore it, or the disk did)


def decode_file(raw: bytes, path: str) -> SeqFile:
    """The newest valid copy of a sequence map file (either format)."""
    if len(raw) >= _HEAD_V1.size + 4 and raw[:8] == MAGIC_V1:
        return SeqFile(_decode_v1(raw, path), 0, 0, -1, False)
    size = len(raw) // 2
    copies = [_copy_at(raw, i * size, size, path) for i in (0, 1)] if size else [None, None]
    valid = [(c[0], i, c[1]) for i, c in enumerate(copies) if c is not None]
    if not valid:
        if MAGIC not in (raw[:8], raw[size : size + 8]):
            raise FormatError(f"{path}: not an armdb sequence map; point armdb at its own directory")
        raise FormatError(f"{path}: both copies of the sequence map fail their CRC; restore it from a backup")
    generation, newest, reserved = max(valid)
    return SeqFile(reserved, size, generation, newest, len(valid) < 2)


def decode(raw: bytes, path: str) -> dict[str, int]:
    """The reserved ends stored in a sequence map file (either format)."""
    return decode_file(raw, path).reserved


class SeqMap:
    """Thread-safe id allocator with block reservation."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, FILE_NAME)
        self._lock = threading.Lock()
        self._fd = -1
        # The copy written last (-1: none to overwrite, the next write makes a new file).
        self._newest = -1
        self._copy_size = self._generation = 0
        if _fs.FS.exists(self.path):
            f = decode_file(_fs.FS.read_file(self.path), self.path)
            self._reserved, self._copy_size, self._generation, self._newest = f[:4]
            if f.damaged:
                # A crash tore the copy being written: rewrite the file whole now, so a
                # later tear cannot take the one good copy (and check is clean again).
                try:
                    self._newest = -1
                    self._write(self._reserved)
                except OSError as e:
                    raise StorageError(f"{self.path}: repairing a torn copy failed ({e}); check the disk") from e
            elif self._newest >= 0:
                self._fd = _fs.FS.open(self.path, os.O_RDWR)
        else:
            self._reserved = {}
        # Restart every counter at the end of its reserved block (T5).
        self._next = dict(self._reserved)
        # The rest of the reserved block of each name, handed out by next() without the
        # lock: next() on a range iterator is one atomic step under the GIL.  Ids in it
        # are below ``_next`` (which is the block's end), and a new iterator is installed,
        # under the lock, only once the old one is empty, so ids still come out increasing.
        self._rest: dict[str, collections.abc.Iterator[int]] = {}
        self.flushes = 0

    def next(self, name: str) -> int:
        """The next id for ``name`` (ids start at 1), reserved on disk before it is returned."""
        rest = self._rest.get(name)
        if rest is not None:
            n = next(rest, None)
            if n is not None:
                return n
        with self._lock:
            rest = self._rest.get(name)
            n = None if rest is None else next(rest, None)  # another thread may have refilled it
            if n is None:
                n = self._next.get(name, 1)
                end = self._reserved.get(name, 1)
                if n >= end:
                    end = n + ID_BLOCK
                    self._reserve(name, end)
                self._rest[name] = iter(range(n + 1, end))
                self._next[name] = end
            return n

    def draw(self, name: str) -> int:
        """An id for a transaction: from the reserved block while it lasts, else one that
        is not yet reserved on disk, and the caller must call :meth:`reserve_through`
        before it can reach a file (so a refused commit writes nothing)."""
        with self._lock:
            rest = self._rest.get(name)
            n = None if rest is None else next(rest, None)
            if n is None:
                n = self._next.get(name, 1)
                self._next[name] = n + 1
            return n

    def reserve_through(self, name: str, n: int) -> None:
        """Make sure ids up to ``n`` are covered by a persisted reservation."""
        if n < self._reserved.get(name, 1):
            return  # covered: _reserved is replaced, never changed in place, so this read is safe
        with self._lock:
            if n >= self._reserved.get(name, 1):
                self._reserve(name, max(n, self._next.get(name, 1)) + ID_BLOCK)

    def advance(self, name: str, at_least: int) -> None:
        """Make sure later ids for ``name`` are above ``at_least`` (ids found on disk)."""
        with self._lock:
            if self._next.get(name, 1) <= at_least:
                self._next[name] = at_least + 1
                self._rest.pop(name, None)  # its ids are all below the new start

    def _reserve(self, name: str, end: int) -> None:
        reserved = dict(self._reserved)
        reserved[name] = end
        try:
            self._write(reserved)
        except OSError as e:
            raise StorageError(
                f"{self.path}: reserving ids failed ({e}); nothing was written. Check the disk, "
                f"then retry or reopen the database"
            ) from e
        _fail.point("seqmap.after_write")
        self._reserved = reserved
        self.flushes += 1

    def _write(self, reserved: dict[str, int]) -> None:
        """Persist ``reserved``: over the older copy, or as a new file (module docstring)."""
        fs = _fs.FS
        generation = self._generation + 1
        if self._newest >= 0:
            target = 1 - self._newest
            copy = _encode_copy(reserved, generation, self._copy_size)
            if copy is not None:
                try:
                    fs.pwrite(self._fd, copy, target * self._copy_size)
                    fs.fdatasync(self._fd)
                except OSError:
                    self._newest = -1  # a failed sync is not retried on this file (S12)
                    raise
                self._generation, self._newest = generation, target
                return
        data = encode(reserved, generation)
        fs.write_file_atomic(self.path, data)
        if self._fd >= 0:
            fs.close(self._fd)
            self._fd = -1
        self._fd = fs.open(self.path, os.O_RDWR)
        self._generation, self._newest, self._copy_size = generation, 0, len(data) // 2

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                _fs.FS.close(self._fd)
                self._fd = -1
            self._newest = -1
