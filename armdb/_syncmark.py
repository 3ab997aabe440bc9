"""The synced mark of an appendable file (a Bitcask active data file, a log file).

The mark is the offset up to which a completed ``fdatasync`` covered the file (SPEC S7).
It is kept as two 16-byte cells, written alternately::

    u64 mark | u32 generation | u32 crc32 (over mark, generation, BLAKE2b-64 of the identity)

The identity is the file's 32-byte header, so a cell left by another file (an earlier
file of the shard or log, a copy) fails its CRC for this one and is ignored, as a cell
torn by a power cut is.  Open takes the valid cell with the highest generation.

Where the cells live:

- In the current formats (log format 4, Bitcask data format 3) they are the file's own
  *mark area*, the 32 bytes right after its header (:data:`AREA_OFFSET`); records start
  after it.  A cell is written (a page-cache write) only after the sync it names
  completed, so a mark never claims more than was synced, and the file's next
  ``fdatasync`` carries the cell to the disk with the records, at no extra sync.  A
  clean close syncs once more after writing the file's end into a cell.
- Log format 3 and data format 2 kept them in a side file ``synced.mark`` next to the
  file, synced only at a clean close.  Those files are still read (:func:`read_side`);
  nothing appends to them any more (open starts a new file of the current format).

A mark lost or stale only makes open less sure (mark 0: the records' synced-before
flags decide); it never makes open cut what a completed sync covered.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

from . import _fs

MARK_NAME = "synced.mark"  # the side file of the older formats
CELL = struct.Struct("<QII")  # mark, generation, crc32
CELL_SIZE = CELL.size  # 16
IDENTITY_SIZE = 32  # the file header a cell is bound to
AREA_OFFSET = IDENTITY_SIZE  # the mark area follows the header
AREA_SIZE = 2 * CELL_SIZE  # 32: records of a marked file start at AREA_OFFSET + AREA_SIZE
_GEN_WRAP = 0xFFFFFFFF


def cell(identity: bytes, mark: int, generation: int) -> bytes:
    """One cell naming ``mark`` for the file whose header is ``identity``."""
    return _cell(_digest(identity), mark, generation)


_CELL_HEAD = struct.Struct("<QI")  # mark, generation
_CELL_CRC = struct.Struct("<I")


def _cell(digest: bytes, mark: int, generation: int) -> bytes:
    body = _CELL_HEAD.pack(mark, generation)
    return body + _CELL_CRC.pack(zlib.crc32(digest, zlib.crc32(body)))


def _digest(identity: bytes) -> bytes:
    # The identity enters through a hash, not the CRC itself: a header ends with its own
    # CRC, and CRC-32 is linear, so mixing a header into a CRC adds the same constant (its
    # residue) whatever the header.
    return hashlib.blake2b(identity, digest_size=8).digest()


def _crc(body: bytes, identity: bytes) -> int:
    return zlib.crc32(_digest(identity), zlib.crc32(body))


def parse_cells(raw: bytes, identity: bytes) -> tuple[int, int]:
    """``(mark, generation)`` of the valid cell with the highest generation for
    ``identity``; ``(0, 0)`` when neither cell is valid (no mark known)."""
    best = (0, 0)
    for i in (0, 1):
        c = raw[i * CELL_SIZE : (i + 1) * CELL_SIZE]
        if len(c) < CELL_SIZE:
            continue
        mark, generation, crc = CELL.unpack(c)
        if crc == _crc(c[:12], identity) and generation > best[1]:
            best = (mark, generation)
    return best


def read_area(raw: bytes) -> tuple[int, int]:
    """``(mark, generation)`` from the mark area of a file whose first bytes are ``raw``
    (the current formats); ``(0, 0)`` if the file is too short to hold one."""
    return parse_cells(raw[AREA_OFFSET : AREA_OFFSET + AREA_SIZE], raw[:IDENTITY_SIZE])


def read_side(directory: str, identity: bytes) -> tuple[int, int]:
    """The mark stored in ``directory``'s side file for the file whose header is
    ``identity`` (log format 3, data format 2)."""
    fs = _fs.FS
    path = os.path.join(directory, MARK_NAME)
    if not fs.exists(path):
        return (0, 0)
    try:
        raw = fs.read_file(path)
    except OSError:
        return (0, 0)
    return parse_cells(raw, identity)


def drop_side(directory: str) -> None:
    """Remove ``directory``'s side file, if any (it names no file that is appended to
    any more, or salvage cut its file below it)."""
    path = os.path.join(directory, MARK_NAME)
    if _fs.FS.exists(path):
        _fs.FS.unlink(path)


def clear_area(fd: int) -> None:
    """Zero the mark area of an open file of a current format (salvage cut the file
    below its mark: open then judges by the records' flags alone)."""
    _fs.FS.pwrite(fd, bytes(AREA_SIZE), AREA_OFFSET)


class MarkWriter:
    """Writes the mark cells into the mark area of one appendable file (the caller
    serialises calls and owns the descriptor)."""

    def __init__(self, fd: int, identity: bytes, mark: int, generation: int = 0) -> None:
        self.fd = fd
        self.identity = identity
        self._digest = _digest(identity)  # hashed once, not at every sync's cell
        self.mark = mark  # the highest mark written (or read at open)
        self.generation = generation  # that of the valid cell with the highest one (0: none)

    def rebind(self, fd: int, identity: bytes, mark: int, generation: int = 0) -> None:
        """The appendable file changed (rotation, a reset header): later cells go to it."""
        self.fd, self.identity, self.mark, self.generation = fd, identity, mark, generation
        self._digest = _digest(identity)

    def write(self, mark: int, *, force: bool = False) -> None:
        """Record that a completed sync covered the file up to ``mark`` (a page-cache
        write; durable with the file's next sync).  Only a mark above the last one is
        written, unless ``force`` (a clean close, which names the file's end whatever it
        is).  The cell goes to the slot that does not hold the newest valid cell, so a
        write torn by a power cut leaves that one readable."""
        if mark <= self.mark and not force:
            return
        # u32, wrapping from 2**32 - 1 to 1: for the one write after a wrap the older
        # cell wins, whose mark is smaller, which only makes open less sure.
        generation = self.generation % _GEN_WRAP + 1
        _fs.FS.pwrite(self.fd, _cell(self._digest, mark, generation), AREA_OFFSET + (generation % 2) * CELL_SIZE)
        self.generation = generation
        self.mark = mark

    def seal(self, end: int) -> None:
        """At a clean close, once a sync covered the file up to ``end``: mark ``end`` and
        sync the file again, so that any bad byte found in it later lies below its mark."""
        self.write(end, force=True)
        _fs.FS.fdatasync(self.fd)
