"""The persisted sequence map: id blocks reserved ahead of use (SPEC T5).

Queue row ids and the global sequence numbers (gsn) of Bitcask records are handed
out from blocks of :data:`ID_BLOCK`.  Before the first id of a block is handed out,
the block's end is written to the ``seqmap`` file (tmp + fsync + rename + fsync of
the directory).  After a crash, counting restarts at the end of every reserved
block, so no id is handed out twice; at most ``ID_BLOCK - 1`` ids per name are
skipped (fewer than ``2 * ID_BLOCK`` when the next block was reserved ahead).

Reserving ahead: once a name has handed out a quarter of a block, the next block's
reservation is posted to an :class:`armdb._core.atomicfile.AtomicWriter`, whose thread writes the
file without the GIL; the thread that reaches the block's end then finds it on disk
instead of waiting for two fsyncs and a rename.  Nothing changes for T5: a
reservation counts (``_reserved``) only once its write is durable, ids are handed
out only below it, a failed write ahead is dropped (the block's end reserves in the
foreground and raises there), and every foreground write first waits for the one
ahead, so the file only moves forward.  Only on the real file system with no
failpoint armed: the tests' fault-injecting and recording file systems see every
reservation made by the calling thread, as before.

File layout: ``b"ARMSEQ01"``, ``u32`` format version, ``u32`` body length, msgpack
``{name: reserved_end}``, ``u32`` CRC32 of everything before it.
"""

from __future__ import annotations

import collections.abc
import functools
import os
import struct
import threading
import zlib

import msgpack

from . import _fail, _fs
from ._core.atomicfile import AtomicWriter, draw_id, draw_run
from .errors import CorruptionError, DbClosed, FormatError, StorageError

ID_BLOCK = 1024
# A name that draws ids in batches reserves blocks of at least 16 ordinary blocks and 64
# batches (at most MAX_SPAN ids), posted ahead when a quarter is used: the next block is
# then on disk before it is needed, and a batch never waits for a reservation.
MAX_SPAN = 1 << 22
# Post the next block once less than this is left of the reserved one (from its second
# quarter on: a Db that draws only a few ids never starts the writer).
_AHEAD_AT = 3 * ID_BLOCK // 4
_NO_BLOCK: collections.abc.Iterator[int] = iter(())  # the rest of a block not yet reserved: empty
# The largest reserved end a sequence map may hold.  Ids are handed out one at a time, so
# a database drawing ten million ids a second would need 228 years to reach 2**56; a
# larger number in the file is damage, not use, and accepting one (a gsn near 2**60
# or a queue id near 2**64) would stop every later write at the top of the id space.
MAX_RESERVED = 1 << 56
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
    try:
        data = msgpack.unpackb(raw[_HEAD.size : end], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # CRC-valid bytes we never wrote
        raise FormatError(f"{path}: sequence map body does not decode ({e}); restore it from a backup") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path}: sequence map body is not a map; restore it from a backup")
    for k, v in data.items():
        if not isinstance(k, str) or type(v) is not int or not 1 <= v <= MAX_RESERVED:
            raise FormatError(
                f"{path}: sequence map entry {k!r}: {v!r} is not a name with a reserved end in "
                f"[1, {MAX_RESERVED}]; the file is damaged: restore it from a backup"
            )
    return dict(data)


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
        # are below ``_next`` (where that range stops: a quarter of a block on), and
        # a new iterator is installed, under the lock, only once the old one is empty, so
        # ids still come out increasing.  The dict is never replaced: a fixed queue's
        # compiled push (armdb._core.qshard.FixedFast) holds it and does what next() does.
        self._rest: dict[str, collections.abc.Iterator[int]] = {}
        self._span: dict[str, int] = {}  # block size of a name drawn in batches (else ID_BLOCK)
        self.flushes = 0
        # Reserving ahead (module docstring): the writer and its thread, started on first
        # need, and the write in flight: (ticket, the reserved map it makes durable).
        self._writer: AtomicWriter | None = None
        self._writer_thread: threading.Thread | None = None
        self._ahead: tuple[int, dict[str, int]] | None = None
        self._closed = False

    def next(self, name: str) -> int:
        """The next id for ``name`` (ids start at 1), reserved on disk before it is returned."""
        n = next(self._rest.get(name, _NO_BLOCK), None)
        if n is not None:
            return n
        with self._lock:
            n = next(self._rest.get(name, _NO_BLOCK), None)  # another thread may have refilled it
            if n is None:
                if self._ahead is not None:
                    self._finish_ahead(wait=False)
                n = self._next.get(name, 1)
                end = self._reserved.get(name, 1)
                if n >= end:
                    if self._ahead is not None:
                        self._finish_ahead(wait=True)  # it may hold this very block
                        end = self._reserved.get(name, 1)
                    if n >= end:
                        end = n + ID_BLOCK
                        self._reserve(name, end)
                self._refill(name, n, end)
            return n

    def _refill(self, name: str, n: int, end: int) -> None:
        """Hand out the reserved ids after ``n`` (which the caller returns) a quarter of a
        block at a time, by ``_rest`` (caller holds ``_lock``; ``n < end``, the end of
        the reserved block).  From the second quarter on, until the next block is
        reserved, each refill posts its reservation: a post is refused while another is
        in flight, and a failed one is dropped."""
        stop = min(end, n + ID_BLOCK // 4)
        self._rest[name] = iter(range(n + 1, stop))
        self._next[name] = stop
        if end - stop < _AHEAD_AT:
            self._reserve_ahead()

    def drawer(self, name: str) -> collections.abc.Callable[[], int]:
        """``lambda: self.next(name)``, its common case (an id of the reserved block's
        rest) compiled: no Python frame (a Bitcask store's gsn source)."""
        return functools.partial(draw_id, self._rest, name, self.next)

    def draw(self, name: str) -> int:
        """An id for a transaction: from the reserved block while it lasts (refilled as
        :meth:`next` refills it; ``armdb.plan.Plan.draw`` takes from ``_rest`` first,
        without the lock), else one that is not yet reserved on disk, and the caller
        must call :meth:`reserve_through` before it can reach a file (so a refused
        commit writes nothing)."""
        with self._lock:
            n = next(self._rest.get(name, _NO_BLOCK), None)  # another thread may have refilled it
            if n is None:
                if self._ahead is not None:
                    self._finish_ahead(wait=False)  # a reservation that landed counts now
                n = self._next.get(name, 1)
                end = self._reserved.get(name, 1)
                if n < end:
                    self._refill(name, n, end)
                else:
                    self._next[name] = n + 1
            return n

    def draw_block(self, name: str, n: int) -> int:
        """The first of ``n`` consecutive ids for a batch in a transaction (as :meth:`draw`,
        so the caller must call :meth:`reserve_through` for the last one).  The ids come
        from the rest of the current block when it holds ``n`` (``draw_run``: they are
        reserved already); otherwise the batch starts after it and the rest is left
        unused (ids must be consecutive and increasing)."""
        first = draw_run(self._rest, name, n)
        if first is not None:
            return first
        with self._lock:
            first = self._next.get(name, 1)
            self._next[name] = first + n
            self._rest[name] = _NO_BLOCK
            span = min(MAX_SPAN, max(16 * ID_BLOCK, 64 * n))
            if span > self._span.get(name, ID_BLOCK):
                self._span[name] = span
            return first

    def reserve_through(self, name: str, n: int) -> None:
        """Make sure ids up to ``n`` are covered by a persisted reservation."""
        end = self._reserved.get(name, 1)
        if n < end:  # covered: _reserved is replaced, never changed in place, so this read is safe
            low = self._span.get(name, ID_BLOCK) * 3 // 4
            if end - n < low:
                # Transactions draw ids without next(): post the next block ahead here
                # (once the write in flight, if any, has landed).
                with self._lock:
                    if self._ahead is not None:
                        self._finish_ahead(wait=False)
                    if self._ahead is None and self._reserved.get(name, 1) - n < low:
                        self._reserve_ahead()
            return
        with self._lock:
            if self._ahead is not None:
                self._finish_ahead(wait=False)
            if n >= self._reserved.get(name, 1):
                self._reserve(name, max(n, self._next.get(name, 1)) + self._span.get(name, ID_BLOCK))

    def reserved(self, name: str) -> int | None:
        """The end of the block reserved on disk for ``name`` (every id of it found in a file
        is below it), or None when ``name`` never drew an id."""
        return self._reserved.get(name)

    def advance(self, name: str, at_least: int) -> None:
        """Make sure later ids for ``name`` are above ``at_least`` (ids found on disk)."""
        if not 0 <= at_least < MAX_RESERVED:
            raise CorruptionError(
                f"id {at_least} found on disk for {name!r} is beyond the id space armdb hands out "
                f"({MAX_RESERVED}); a file of the database is damaged: run armdb.check to find it"
            )
        with self._lock:
            if self._next.get(name, 1) <= at_least:
                self._next[name] = at_least + 1
                self._rest.pop(name, None)  # its ids are all below the new start

    def _reserve_ahead(self) -> None:
        """Post to the writer the next block of every name that has less than a block
        reserved beyond the ids it handed out (caller holds ``_lock``).  One write
        carries them all: names that advance together would otherwise take turns at
        the single write in flight, and a name whose turn never came would reserve
        in the foreground at its block's end."""
        if self._closed or self._ahead is not None or type(_fs.FS) is not _fs.RealFS or _fail.armed():
            return
        if self._writer is None:
            self._writer = AtomicWriter(self.path)
            self._writer_thread = threading.Thread(target=self._writer.run, name="armdb-seqmap", daemon=True)
            self._writer_thread.start()
        reserved = dict(self._reserved)
        for name, n in self._next.items():
            end = reserved.get(name, 1)
            span = self._span.get(name, ID_BLOCK)
            if end - n < span:
                reserved[name] = max(end, n) + span
        ticket = self._writer.post(encode(reserved))
        if ticket:
            self._ahead = (ticket, reserved)

    def _finish_ahead(self, *, wait: bool) -> None:
        """Count the write ahead once it is durable (caller holds ``_lock``); a failed one
        is dropped.  ``wait=False`` leaves one still in flight alone."""
        assert self._ahead is not None and self._writer is not None
        ticket, reserved = self._ahead
        err = self._writer.wait(ticket) if wait else self._writer.result(ticket)
        if err < 0:
            return
        self._ahead = None
        if err == 0:
            self._reserved = reserved  # nothing else wrote meanwhile: _reserve waits for it first
            self.flushes += 1
            _fail.point("seqmap.after_write")

    def close(self) -> None:
        """Finish the write ahead and stop the writer's thread (the Db is closing)."""
        with self._lock:
            self._closed = True
            if self._ahead is not None:
                self._finish_ahead(wait=True)
        if self._writer is not None:
            self._writer.stop()
            assert self._writer_thread is not None
            self._writer_thread.join()

    def _reserve(self, name: str, end: int) -> None:
        if self._closed:  # a call racing Db.close: the directory may belong to another process now
            raise DbClosed(f"the database of {self.path!r}")
        if self._ahead is not None:
            self._finish_ahead(wait=True)  # one writer at a time, so the file only moves forward
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
