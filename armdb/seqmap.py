"""The persisted sequence map: id blocks reserved ahead of use (SPEC T5).

Queue row ids and the global sequence numbers (gsn) of Bitcask records are handed
out from blocks of :data:`ID_BLOCK`.  Before the first id of a block is handed out,
the block's end is written to the ``seqmap`` file (tmp + fsync + rename + fsync of
the directory).  After a crash, counting restarts at the end of every reserved
block, so no id is handed out twice; at most ``ID_BLOCK - 1`` ids per name are
skipped.

File layout: ``b"ARMSEQ01"``, ``u32`` format version, ``u32`` body length, msgpack
``{name: reserved_end}``, ``u32`` CRC32 of everything before it.
"""

from __future__ import annotations

import collections.abc
import os
import struct
import threading
import zlib

import msgpack

from . import _fail, _fs
from .errors import FormatError, StorageError

ID_BLOCK = 1024
_NO_BLOCK: collections.abc.Iterator[int] = iter(())  # the rest of a block not yet reserved: empty
MAGIC = b"ARMSEQ01"
FORMAT_VERSION = 1
FILE_NAME = "seqmap"
_HEAD = struct.Struct("<8sII")


def encode(reserved: dict[str, int]) -> bytes:
    body = msgpack.packb(reserved, use_bin_type=True)
    raw = _HEAD.pack(MAGIC, FORMAT_VERSION, len(body)) + body
    return raw + struct.pack("<I", zlib.crc32(raw))


def decode(raw: bytes, path: str) -> dict[str, int]:
    if len(raw) < _HEAD.size + 4 or raw[:8] != MAGIC:
        raise FormatError(f"{path}: not an armdb sequence map; point armdb at its own directory")
    _, version, n = _HEAD.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise FormatError(f"{path}: sequence map format {version} is not supported; upgrade armdb")
    end = _HEAD.size + n
    if len(raw) < end + 4 or struct.unpack_from("<I", raw, end)[0] != zlib.crc32(raw[:end]):
        raise FormatError(f"{path}: sequence map fails its CRC; restore it from a backup")
    data = msgpack.unpackb(raw[_HEAD.size : end], raw=False)
    if not isinstance(data, dict):
        raise FormatError(f"{path}: sequence map body is not a map")
    return {str(k): int(v) for k, v in data.items()}


class SeqMap:
    """Thread-safe id allocator with block reservation."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, FILE_NAME)
        self._lock = threading.Lock()
        if _fs.FS.exists(self.path):
            self._reserved = decode(_fs.FS.read_file(self.path), self.path)
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
        n = next(self._rest.get(name, _NO_BLOCK), None)
        if n is not None:
            return n
        with self._lock:
            n = next(self._rest.get(name, _NO_BLOCK), None)  # another thread may have refilled it
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
            n = next(self._rest.get(name, _NO_BLOCK), None)
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
            _fs.FS.write_file_atomic(self.path, encode(reserved))
        except OSError as e:
            raise StorageError(
                f"{self.path}: reserving ids failed ({e}); nothing was written. Check the disk, "
                f"then retry or reopen the database"
            ) from e
        _fail.point("seqmap.after_write")
        self._reserved = reserved
        self.flushes += 1
