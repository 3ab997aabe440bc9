"""The synced mark of an appendable file (a Bitcask active data file, a log file).

The mark is the offset up to which a completed ``fdatasync`` covered the file.  It
lives in a small side file next to it (``synced.mark``: one per Bitcask shard, one
for the log) as two 16-byte cells written alternately::

    u64 mark | u32 generation | u32 crc32 (over mark, generation, BLAKE2b-64 of the identity)

The identity is the appendable file's 32-byte header, so a cell left by an earlier
file of the shard (or log) fails its CRC for the current one and is ignored, as a
cell torn by a power cut is.  Open takes the valid cell with the highest generation.
A cell is written only after the sync it names completed, so a mark never claims more
than was synced; it reaches the disk with a later sync of the side file (at close),
or not at all, which only makes open less sure (mark 0: the records' flags decide).
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

from . import _fs

MARK_NAME = "synced.mark"
CELL = struct.Struct("<QII")  # mark, generation, crc32
CELL_SIZE = CELL.size  # 16


def _cell(identity: bytes, mark: int, generation: int) -> bytes:
    body = struct.pack("<QI", mark, generation)
    return body + struct.pack("<I", _crc(body, identity))


def _crc(body: bytes, identity: bytes) -> int:
    # The identity enters through a hash, not the CRC itself: a header ends with its own
    # CRC, and CRC-32 is linear, so mixing a header into a CRC adds the same constant (its
    # residue) whatever the header.
    return zlib.crc32(hashlib.blake2b(identity, digest_size=8).digest(), zlib.crc32(body))


def parse_cells(raw: bytes, identity: bytes) -> tuple[int, int]:
    """``(mark, generation)`` of the valid cell with the highest generation for
    ``identity``; ``(0, 0)`` when neither cell is valid (no mark known)."""
    best = (0, 0)
    for i in (0, 1):
        cell = raw[i * CELL_SIZE : (i + 1) * CELL_SIZE]
        if len(cell) < CELL_SIZE:
            continue
        mark, generation, crc = CELL.unpack(cell)
        if crc == _crc(cell[:12], identity) and generation > best[1]:
            best = (mark, generation)
    return best


def read_mark(directory: str, identity: bytes) -> tuple[int, int]:
    """The mark stored in ``directory`` for the file whose header is ``identity``."""
    fs = _fs.FS
    path = os.path.join(directory, MARK_NAME)
    if not fs.exists(path):
        return (0, 0)
    try:
        raw = fs.read_file(path)
    except OSError:
        return (0, 0)
    return parse_cells(raw, identity)


def highest_generation(directory: str) -> int:
    """The highest generation in either cell, valid or not for any identity (the next
    cell written must be above it, whichever file it names)."""
    fs = _fs.FS
    path = os.path.join(directory, MARK_NAME)
    if not fs.exists(path):
        return 0
    raw = fs.read_file(path)
    gens = [CELL.unpack_from(raw, i * CELL_SIZE)[1] for i in (0, 1) if len(raw) >= (i + 1) * CELL_SIZE]
    return max(gens, default=0)


def drop(directory: str) -> None:
    """Remove the mark of ``directory`` (salvage cut its file below it)."""
    path = os.path.join(directory, MARK_NAME)
    if _fs.FS.exists(path):
        _fs.FS.unlink(path)


class MarkWriter:
    """Writes the mark cells of one directory's appendable file (caller serialises)."""

    def __init__(self, directory: str, identity: bytes, mark: int) -> None:
        self.path = os.path.join(directory, MARK_NAME)
        self.identity = identity
        self.mark = mark  # the highest mark written (or read at open)
        self.generation = highest_generation(directory)
        self._fd = -1

    def rebind(self, identity: bytes, mark: int) -> None:
        """The appendable file changed (rotation, a reset header): later cells name it."""
        self.identity = identity
        self.mark = mark

    def write(self, mark: int, *, force: bool = False) -> None:
        """Record that a completed sync covered the file up to ``mark`` (a page-cache
        write; durable with :meth:`sync`).  Only a mark above the last one is written,
        unless ``force`` (a clean close, which names the file's end whatever it is)."""
        if mark <= self.mark and not force:
            return
        fs = _fs.FS
        if self._fd < 0:
            if fs.exists(self.path):
                self._fd = fs.open(self.path, os.O_RDWR)
            else:
                # Created whole and durably, its folder entry included (SPEC D3): a
                # durable write that synced its file must not leave an entry pending.
                self._fd = fs.create_file(self.path, bytes(2 * CELL_SIZE))
        # u32, wrapping from 2**32 - 1 to 1: for the one write after a wrap the older
        # cell wins, whose mark is smaller, which only makes open less sure.
        self.generation = self.generation % 0xFFFFFFFF + 1
        fs.pwrite(self._fd, _cell(self.identity, mark, self.generation), (self.generation % 2) * CELL_SIZE)
        self.mark = mark

    def sync(self) -> None:
        if self._fd >= 0:
            _fs.FS.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _fs.FS.close(fd)
