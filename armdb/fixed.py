"""FixedStore: equal-size slots in one memory-mapped ``fixed.data`` file per shard (SPEC S1-S5).

Layout (docs/format.md): a 4096-byte header page (magic, format version, slot
geometry, CRC), then ``capacity`` slots of ``slot_size`` bytes.  Each slot is an
8-byte slot header (``meta = version << 2 | status``, ``crc32``) followed by a
``key_size``-byte key and a ``value_size``-byte value.  The whole file is mapped
with ``np.memmap`` (through ``armdb._fs``); ``slots`` is a ``(capacity, slot_size)``
uint8 view of it that the Cython kernels in ``armdb._core.fixed`` read and write.

The in-RAM version vector is a ``uint32`` array with one word per preallocated slot
(S2): 400,000 bytes per shard with ``grow_step = 100_000``.

Lock policy: each :class:`FixedShard` has one ``threading.Lock``.  Callers (the queue
layer, the transaction log) hold it around every slot allocation, write and free of
that shard.  ``sync`` takes it only to snapshot the dirty range; the msync itself runs
outside the lock, because the kernel flushes pages that later writers may touch again
and a write racing a flush is simply flushed next time.  ``close`` syncs, drops the
views and unmaps under the lock and marks the shard closed (``sf.closed``), so every
access made under the lock afterwards raises ``DbClosed`` instead of touching the
unmapped file (``SlotFile`` checks it in every method that reads or writes the map).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator

import numpy as np

from . import _fail, _fs
from ._core import fixed as _k
from ._core.locks import Lock
from .config import FixedConfig
from .errors import CorruptionError, DbClosed, FormatError, StorageError, as_storage_error

log = logging.getLogger("armdb")

MAGIC = b"ARMFIXD1"
FORMAT_VERSION = 1
HEADER_PAGE = 4096
_HDR = struct.Struct("<8sIIIII")  # magic, version, slot_size, key_size, value_size, shard
FILE_NAME = "fixed.data"
REDO_NAME = "fixed.redo"
REDO_MAGIC = b"ARMREDO1"
_REDO_HDR = struct.Struct("<8sII")  # magic, version, slot_size; then crc32

FREE, OCCUPIED, DELETED, TORN = _k.FREE, _k.OCCUPIED, _k.DELETED, _k.TORN

# The high-water mark (docs/format.md): how many slots, counted from slot 0, have
# durably held data.  Slots are handed out lowest first and a written slot never
# reads as all zero again (a freed slot is DELETED, with a version), so an all-zero
# slot below the mark is damage: a zeroed page, a punched hole, a truncated file.
# Two copies, written alternately: one in the header page of fixed.data, one in the
# first sector of fixed.redo, so that no single damaged file erases both.
HWM_DATA_OFFSET = 512
HWM_REDO_OFFSET = 32
HWM_STEP = 64  # slots copy A may lag behind while writes keep coming (see _sync_locked)
BUSY_SYNC_GAP = 0.05  # s: a durable store that synced within this is busy (sync() leaves it)
_HWM = struct.Struct("<8sQQ")  # magic, generation, mark; then crc32
HWM_BYTES = _HWM.size + 4
HWM_MAGIC = b"ARMHWM01"
_monotonic = time.monotonic


def encode_hwm(generation: int, mark: int) -> bytes:
    body = _HWM.pack(HWM_MAGIC, generation, mark)
    return body + struct.pack("<I", zlib.crc32(body))


def read_hwm(data_page: bytes | np.ndarray, redo_page: bytes | np.ndarray) -> tuple[int, int]:
    """``(generation, mark)`` of the newest valid copy, ``(0, 0)`` if none."""
    best = (0, 0)
    n = HWM_BYTES
    for page, off in ((data_page, HWM_DATA_OFFSET), (redo_page, HWM_REDO_OFFSET)):
        raw = bytes(page[off : off + n])
        if len(raw) < n or raw[:8] != HWM_MAGIC or struct.unpack_from("<I", raw, _HWM.size)[0] != zlib.crc32(
            raw[: _HWM.size]
        ):
            continue  # never written, torn by a power cut mid-update, or damaged: the other copy stands
        _, gen, mark = _HWM.unpack_from(raw)
        best = max(best, (gen, mark))
    return best


def lost_below_hwm(status: np.ndarray, mark: int) -> tuple[int, int]:
    """``(count, first)`` of never-written (all-zero) slots below ``mark``; slots past the
    end of ``status`` (a file cut short) count too."""
    n = min(mark, status.shape[0])
    zero = np.flatnonzero(status[:n] == FREE)
    missing = mark - n
    if zero.shape[0]:
        return int(zero.shape[0]) + missing, int(zero[0])
    return missing, n if missing else -1


SECTOR = 512


def slot_size_for(key_size: int, value_size: int) -> int:
    """8-byte slot header + key + value, rounded up so that no slot straddles a sector.

    Up to 512 bytes the size is the next power of two (a divisor of 512); beyond,
    a multiple of 512.  The header page is 4096 bytes, so every slot of up to 512
    bytes lies inside one 512-byte sector, and a sector is the unit a disk writes
    whole: an in-place update that power loss cuts short leaves the old or the new
    slot, never a mix of the two, even on a store that does not sync every write.
    """
    raw = 8 + key_size + value_size
    if raw <= SECTOR:
        return 1 << (raw - 1).bit_length()
    return -(-raw // SECTOR) * SECTOR


def encode_header(slot_size: int, key_size: int, value_size: int, shard: int) -> bytes:
    body = _HDR.pack(MAGIC, FORMAT_VERSION, slot_size, key_size, value_size, shard)
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(raw: bytes, path: str) -> tuple[int, int, int, int]:
    """Parse and check a header page; ``FormatError`` names the file and the problem."""
    if len(raw) < _HDR.size + 4:
        raise FormatError(f"{path}: file is shorter than its header; it is not an armdb fixed.data file")
    magic, version, slot_size, key_size, value_size, shard = _HDR.unpack_from(raw)
    if magic != MAGIC:
        raise FormatError(f"{path}: not an armdb fixed.data file (magic {magic!r}); point armdb at its own directory")
    (crc,) = struct.unpack_from("<I", raw, _HDR.size)
    if crc != zlib.crc32(raw[: _HDR.size]):
        raise FormatError(f"{path}: header page fails its CRC; restore the file from a backup")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{path}: format version {version} is not supported by this armdb (knows {FORMAT_VERSION}); "
            f"upgrade armdb"
        )
    return slot_size, key_size, value_size, shard


def redo_header(slot_size: int) -> bytes:
    """The header of a ``fixed.redo`` for slots of ``slot_size`` bytes (magic, version, slot size, CRC)."""
    head = _REDO_HDR.pack(REDO_MAGIC, FORMAT_VERSION, slot_size)
    return head + struct.pack("<I", zlib.crc32(head))


def judge_redo_header(raw: bytes, path: str, slot_size: int) -> bool:
    """Judge an existing ``fixed.redo`` (its whole content ``raw``) as open does.

    ``True``: its header is valid for slots of ``slot_size`` bytes.  ``False``: the header
    is damaged but the file holds no redo record (files are created whole, by rename, so
    only damage does this; open recreates the file, nothing is lost).  A bad header over
    a record raises ``FormatError``: open refuses the shard, and ``armdb.check`` reports it.
    """
    head = redo_header(slot_size)
    if raw[: len(head)] == head:
        return True
    if not any(raw[_k.REDO_OFFSET :]):
        return False
    magic, version, found = _REDO_HDR.unpack_from(raw[: len(head)].ljust(len(head), b"\0"))
    if magic != REDO_MAGIC or raw[_REDO_HDR.size : len(head)] != struct.pack("<I", zlib.crc32(raw[: _REDO_HDR.size])):
        raise FormatError(f"{path}: not an armdb redo file; point armdb at its own directory")
    raise FormatError(f"{path}: redo file of version {version} / slot size {found} does not "
                      f"match this store; upgrade armdb or restore the directory")


class FixedShard(_k.SlotStore):
    """One shard: a mapped ``fixed.data``, its version vector and its free-slot stack.

    It derives from ``armdb._core.fixed.SlotStore``, through which the compiled queue
    shard (armdb._core.qshard) reads ``index``, ``poisoned`` and ``sync_error`` and calls
    ``raise_sync_error``; off the hot path it calls ``check_writable``, ``grow``,
    ``sync_redo`` and ``after_write``, defined here.
    """

    def __init__(self, directory: str, index: int, key_size: int, value_size: int, config: FixedConfig) -> None:
        # A plain dict of its own before the first attribute: the one CPython makes for an
        # instance of a class derived from a compiled one shares the class's keys (a
        # split table), and the interpreter does not specialize attribute reads on it
        # (armdb._objdict): ten reads of this shard's attributes took 235 ns, 88 ns now.
        self.__dict__ = {}
        self.directory = directory
        self.index = index
        self.key_size = key_size
        self.value_size = value_size
        self.slot_size = slot_size_for(key_size, value_size)
        self.body_size = self.slot_size - 8
        self.config = config
        # Durable store: every write is synced before it returns (S5 sync_interval 0).
        self.ordered = config.enable_fsync and config.sync_interval == 0
        self.lock = Lock()  # (armdb._core.locks: a cheaper acquire than threading.Lock)
        self.path = os.path.join(directory, FILE_NAME)
        self.poisoned: BaseException | None = None
        self.sync_error: StorageError | None = None  # stashed by _wrote_or_stash
        self.repaired_on_open = 0
        self.sf = _k.SlotFile(HEADER_PAGE, directory)  # the hot path's view of the arrays (rebound by _bind)
        self.sf.last_sync = time.monotonic()
        # High-water mark: on disk, and covered by a completed sync (in memory: sf.hwm).
        # The marks stored in the two copies (A: fixed.data, B: fixed.redo).
        self._hwm_a = self._hwm_b = self._hwm_synced = self._hwm_gen = 0
        self.sync_every = config.sync_interval if config.enable_fsync else None
        # Set by the Db: wakes its flusher, which then runs the timed sync (sync()) on its
        # own thread; False when there is no flusher to wake.  None: sync in the writer.
        self.kick: Callable[[], bool] | None = None
        self._flushing = False  # a sync() is flushing outside the lock
        self._fd = -1
        self._redo_fd = -1
        self._open()

    # -- open and grow -----------------------------------------------------------
    def _open(self) -> None:
        fs = _fs.FS
        fs.makedirs(self.directory)
        fs.remove_stale_tmp(self.path)
        header = encode_header(self.slot_size, self.key_size, self.value_size, self.index)
        fd, size = self._open_data_file(fs, header)
        self._fd = fd
        try:
            slot_size, key_size, value_size, _shard = decode_header(fs.pread(fd, HEADER_PAGE, 0), self.path)
            if size < HEADER_PAGE:
                raise CorruptionError(
                    f"{self.path}: the file is cut short inside its {HEADER_PAGE}-byte header page ({size} "
                    f"bytes); rows may be lost. Restore the database directory from a backup"
                )
            if (slot_size, key_size, value_size) != (self.slot_size, self.key_size, self.value_size):
                raise FormatError(
                    f"{self.path}: slots are {key_size}+{value_size} bytes on disk but "
                    f"{self.key_size}+{self.value_size} were expected; open with the original payload type"
                )
            capacity = max(0, (size - HEADER_PAGE) // self.slot_size)
            # Preallocate whole grow steps (S2); a crash mid-grow leaves a ragged end.
            step = self.config.grow_step
            target = max(step, -(-capacity // step) * step)
            self._map(target, grow_file=HEADER_PAGE + target * self.slot_size != size)
            self.status = np.zeros(self.capacity, dtype=np.uint8)
            occupied, torn = self._validate(fs)
            self._open_redo(fs)
            self._bind()
            self._hwm_gen, mark = read_hwm(self.mapped.array[:HEADER_PAGE], self.redo[: _k.REDO_OFFSET])
            lost, first = lost_below_hwm(self.status, mark)
            if lost:
                raise CorruptionError(
                    f"{self.path}: {lost} slot(s) below the high-water mark {mark} read as never written "
                    f"(first: slot {first}); the file was zeroed or cut short and rows may be lost. Restore "
                    f"the database directory from a backup"
                )
            self._set_mark(mark)
            if self._apply_redo():
                torn -= 1
                occupied = int(np.count_nonzero(self.status == OCCUPIED))
            self.sf.occupied = occupied
            self.fill_holes()
            self._build_free_list()
            if torn:
                log.warning("%s: %d torn slot(s) found on open; they are not served", self.path, torn)
        except BaseException:
            if self._redo_fd >= 0:
                fs.close(self._redo_fd)
                self._redo_fd = -1
            fs.close(fd)
            self._fd = -1
            raise

    def _open_data_file(self, fs: _fs.RealFS, header: bytes) -> tuple[int, int]:
        """``(fd, size)`` of ``fixed.data``, created whole when missing."""
        if not fs.exists(self.path):
            return fs.create_file(self.path, header, HEADER_PAGE), HEADER_PAGE
        fd = fs.open(self.path, os.O_RDWR)
        try:
            size = fs.size(fd)
            if size and not self._unwritten_new_file(fs, fd, size):
                return fd, size
        except BaseException:
            fs.close(fd)
            raise
        # Only damage can leave this (files are created whole, by rename): an invalid
        # header and no slot data.  Nothing was stored; start afresh.
        log.warning("%s: header page never written and no slot data; re-initialising", self.path)
        fs.close(fd)
        fs.unlink(self.path)
        return fs.create_file(self.path, header, HEADER_PAGE), HEADER_PAGE

    @staticmethod
    def _unwritten_new_file(fs: _fs.RealFS, fd: int, size: int) -> bool:
        """True when the header page is invalid and nothing after it holds a byte."""
        raw = fs.pread(fd, HEADER_PAGE, 0)
        try:
            decode_header(raw, "")
            return False
        except FormatError:
            pass
        if raw[:8] == MAGIC:
            if len(raw) >= _HDR.size + 4 and struct.unpack_from("<I", raw, _HDR.size)[0] == zlib.crc32(raw[: _HDR.size]):
                return False  # a complete header of another version: refuse it (D5)
        elif not MAGIC.startswith(raw[:8].rstrip(b"\0")):
            return False  # a foreign file: refuse it (D5)
        for lo, hi in fs.data_extents(fd, HEADER_PAGE, size):
            pos = lo
            while pos < hi:
                n = min(hi - pos, 1 << 20)
                if any(fs.pread(fd, n, pos)):
                    return False
                pos += n
        return True

    # -- the redo record (crash-atomic in-place updates) -----------------------------
    def _open_redo(self, fs: _fs.RealFS) -> None:
        """Map ``fixed.redo``: one record of the slot image being written (docs/format.md)."""
        path = os.path.join(self.directory, REDO_NAME)
        fs.remove_stale_tmp(path)
        length = -(-(_k.REDO_OFFSET + _k.REDO_HEAD + self.slot_size) // _fs.PAGE) * _fs.PAGE
        fresh = not fs.exists(path)
        if not fresh:
            fd = fs.open(path, os.O_RDWR)
            try:
                raw = fs.pread(fd, fs.size(fd), 0)
                kept = judge_redo_header(raw, path, self.slot_size)
            except BaseException:
                fs.close(fd)
                raise
            if not kept:
                # Damage only (files are created whole, by rename): no record to lose.
                fs.close(fd)
                fs.unlink(path)
                fresh = True
        if fresh:
            fd = fs.create_file(path, redo_header(self.slot_size), length)
        self._redo_fd = fd
        # Blocks for the whole record before it is mapped (a file an older armdb
        # extended sparse has none): a full disk is an error here, not a SIGBUS later.
        try:
            fs.fallocate(fd, 0, length)
        except OSError as e:
            raise as_storage_error(e, f"{path}: allocating {length:,} bytes of disk")
        self.redo_mapped = fs.mmap(fd, length)
        self.redo = np.asarray(self.redo_mapped.array)

    def _apply_redo(self) -> int:
        """Finish an in-place update a crash cut short; returns how many torn slots it healed."""
        rec = _k.redo_record(self.redo, self.slot_size)
        if rec is None:
            return 0
        slot, image = rec
        if slot >= self.capacity or self.status[slot] != TORN:
            return 0  # the slot is intact: the write finished, or never began
        st = _k.restore_slot(self.slots, self.versions, slot, image)
        if st < 0:
            return 0
        self.status[slot] = st
        self.repaired_on_open += 1
        self.sf.mark(slot)
        self._wrote(slot)
        log.warning("%s: slot %d was torn by a crash mid-update; restored from the redo record", self.path, slot)
        return 1

    def _set_mark(self, mark: int) -> None:
        """Set the in-memory mark past the last slot holding anything (open).

        Slots a crashed process wrote may sit in the page cache only: the first sync
        flushes the whole range below the mark before a mark on disk may cover it.
        """
        self._hwm_a = self._hwm_b = self._hwm_synced = mark
        used = np.flatnonzero(self.status != FREE)
        sf = self.sf
        sf.hwm = max(mark, int(used[-1]) + 1 if used.shape[0] else 0)
        if sf.hwm > mark:
            sf.dirty_lo, sf.dirty_hi = HEADER_PAGE, HEADER_PAGE + sf.hwm * self.slot_size

    def fill_holes(self) -> None:
        """Never-written slots below the mark become deleted tombstones (open, and the
        log replay before its sync).

        A power cut can leave some: a later slot's write reached the disk and an earlier
        one's did not, or the log replay writes a logged slot past a direct push whose
        unsynced write was lost.  No all-zero slot may ever sit below a mark on disk.
        """
        for slot in np.flatnonzero(self.status[: self.sf.hwm] == FREE).tolist():
            self.sf.put(slot, DELETED, b"")
            self._wrote(slot)

    def _validate(self, fs: _fs.RealFS) -> tuple[int, int]:
        """CRC-check every slot that holds data (S4).

        Slots the file system reports as holes (allocated but never written blocks, or
        the holes of a file an older armdb left sparse) are all zero, hence free (S11);
        they are skipped without reading, so opening a mostly empty queue touches no
        page of it.
        """
        occupied = torn = 0
        size = self.slot_size
        for lo, hi in fs.data_extents(self._fd, HEADER_PAGE, HEADER_PAGE + self.capacity * size):
            a = (lo - HEADER_PAGE) // size
            b = min(self.capacity, -(-(hi - HEADER_PAGE) // size))
            if b > a:
                o, t = _k.validate(self.slots[a:b], self.versions[a:b], self.status[a:b])
                occupied += o
                torn += t
        return occupied, torn

    def _allocate(self, fs: _fs.RealFS, start: int, end: int) -> None:
        """Allocate the disk blocks of bytes ``[start, end)`` of the file (extending it).

        Every page is allocated before it is mapped for writing: a store into a page
        without blocks on a full disk kills the process with ``SIGBUS``, whereas here a
        full disk is a ``StorageError`` and nothing has changed: a partial allocation is
        given back, the map is the old one, the slots already there stay usable, and no
        poisoning is needed.
        """
        if end <= start:
            return
        fd = self._fd
        size = fs.size(fd)
        try:
            fs.fallocate(fd, start, end - start)
        except OSError as e:
            with contextlib.suppress(OSError):
                if fs.size(fd) > size:
                    fs.ftruncate(fd, size)
            slots = (end - max(start, HEADER_PAGE)) // self.slot_size
            what = f"{self.path}: allocating {end - start:,} bytes of disk for {slots:,} slots"
            if e.errno == errno.ENOSPC:
                more = "more " if start > 0 else ""
                what = f"{self.path}: the disk is full; allocating {end - start:,} bytes for {slots:,} {more}slots"
                if start > 0:
                    what += " (the rows already stored stay usable)"
            raise as_storage_error(e, what)

    def _map(self, capacity: int, *, grow_file: bool) -> None:
        fs = _fs.FS
        length = HEADER_PAGE + capacity * self.slot_size
        old_versions = getattr(self, "versions", None)
        if old_versions is None:
            # Open: the whole file, whose holes (a file an older armdb left sparse) would
            # otherwise be pages without blocks.  Fast where the blocks exist already.
            size = fs.size(self._fd)
            if size > length:
                fs.ftruncate(self._fd, length)  # a ragged partial slot at the end
            self._allocate(fs, 0, length)
        # (Growth: _remap_to allocated the new slots' blocks before it called this.)
        if grow_file:
            _fail.point("fixed.after_grow")
        self.mapped = fs.mmap(self._fd, length)
        # A plain ndarray view of the np.memmap: indexing an np.memmap subclass costs
        # microseconds per access (__array_finalize__), which the hot path cannot pay.
        self.slots = np.asarray(self.mapped.array[HEADER_PAGE:]).reshape(capacity, self.slot_size)
        versions = np.zeros(capacity, dtype=np.uint32)
        if old_versions is not None:
            versions[: old_versions.shape[0]] = old_versions
        self.versions = versions
        self.capacity = capacity

    def _bind(self) -> None:
        # Only a test's recording file system wants each store reported (armdb._fs).
        base = _fs.MappedFile.wrote
        self._report = type(self.mapped).wrote is not base or type(self.redo_mapped).wrote is not base
        # A durable store whose syncs need no hook (report, replication): after_write's
        # one-frame sync (_durable_flush).
        self._lean = (self.ordered and self.sync_every == 0 and not self._report
                      and type(self.mapped).durable is _fs.MappedFile.durable)
        # Such a store writes by pwrite(2) (docs/format.md, "Direct writes"): a store
        # through the mapping into a page the last sync cleaned costs a page fault, about
        # a tenth of a durable push.  (A write through the mapping passes no file-system
        # method either: only a map's hooks see it, and a hooked map is not lean.)
        fds = (self._fd, self._redo_fd) if self._lean else (-1, -1)
        self.sf.bind(self.slots, self.versions, self.status, self.redo, *fds)

    @property
    def occupied(self) -> int:
        return int(self.sf.occupied)

    @property
    def slot_writes(self) -> int:
        return int(self.sf.writes)

    def _build_free_list(self) -> None:
        """Stack of every slot that is not occupied, lowest index on top.

        The array has room for every slot so that freeing never reallocates.  Torn
        slots are free space too: recovery rewrites them before anything is allocated.
        """
        free = np.flatnonzero(self.status != OCCUPIED).astype(np.uint32)[::-1]
        self._free = np.zeros(self.capacity, dtype=np.uint32)
        self._free[: free.shape[0]] = free
        self.sf.bind_free(self._free, int(free.shape[0]))

    def _remap_to(self, new: int) -> None:
        """Extend the file to ``new`` slots, remap, and extend the status array."""
        old = self.capacity
        # First the blocks: a full disk fails here, with nothing changed and nothing poisoned.
        self._allocate(_fs.FS, HEADER_PAGE + old * self.slot_size, HEADER_PAGE + new * self.slot_size)
        try:
            self.mapped.flush()
            self._map(new, grow_file=True)
        except OSError as e:
            # A failed msync is never retried (S12), and a half-done remap cannot be trusted.
            self.poisoned = e
            raise StorageError(
                f"{self.path}: growing the file failed ({e}); writes are refused until the database is reopened"
            ) from e
        status = np.zeros(new, dtype=np.uint8)
        status[:old] = self.status
        self.status = status
        self._bind()

    def grow(self) -> None:
        """Extend the file by ``grow_step`` complete slots and remap (caller holds the lock)."""
        old = self.capacity
        new = old + self.config.grow_step
        self._remap_to(new)
        # Only called with an empty stack: the new slots, lowest on top.
        self._free = np.zeros(new, dtype=np.uint32)
        self._free[: new - old] = np.arange(new - 1, old - 1, -1, dtype=np.uint32)
        self.sf.bind_free(self._free, new - old)

    # -- slot operations (caller holds self.lock) -----------------------------------
    @property
    def closed(self) -> bool:
        return bool(self.sf.closed)

    def check_open(self) -> None:
        """Raise ``DbClosed`` once the shard is closed (caller holds the lock)."""
        if self.sf.closed:
            raise DbClosed(f"the database of {self.directory!r}")

    def check_writable(self) -> None:
        self.check_open()
        if self.poisoned is not None:
            raise StorageError(
                f"{self.path}: an earlier sync failed ({self.poisoned}); writes are refused "
                f"until the database is reopened"
            )

    def alloc(self) -> int:
        """Pop a free slot, growing the file when none is left."""
        if self.poisoned is not None or self.sf.closed:
            self.check_writable()  # raises
        slot = self.sf.pop_free()
        if slot < 0:
            self.grow()
            slot = self.sf.pop_free()
        return slot

    def unalloc(self, slot: int) -> None:
        """Give back a slot taken by :meth:`alloc` but never written."""
        self.sf.push_free(slot)

    def _put(self, slot: int, status: int, body: bytes, version: int) -> int:
        """Compose the slot image in the redo record and copy it into the slot.

        On a durable store (every write synced before it returns) an update that
        overwrites a live row first makes its redo record durable: power loss can
        tear the slot's page at any byte, and only a redo record already on disk
        lets the next open restore such a slot instead of losing the row (S4).  A
        write into a free slot needs no such ordering: torn, it was a push in flight,
        and the slot is free again.
        """
        sf = self.sf
        if not (self.ordered and self.status[slot] == OCCUPIED):
            return int(sf.put(slot, status, body, version))
        v = int(sf.put(slot, status, body, version, False))
        self.sync_redo()
        sf.commit()
        return v

    def sync_redo(self) -> None:
        """Make the composed redo record durable before it is copied over a live row
        (:meth:`_put`; armdb._core.qshard calls it for the same reason)."""
        if self.sf.werrno:
            raise self._write_failed()  # the record may not be in the file: no copy follows
        self.redo_mapped.wrote(_k.REDO_OFFSET, _k.REDO_HEAD + self.slot_size)
        try:
            self.redo_mapped.flush()
        except OSError as e:
            self.poisoned = e  # never retried (S12); the slot itself is untouched
            raise StorageError(
                f"{self.path}: msync of the redo record failed ({e}); writes are refused until the "
                f"database is reopened"
            ) from e
        _fail.point("fixed.after_redo_sync")

    def write(self, slot: int, body: bytes, version: int = 0) -> int:
        """Write an occupied slot in place; returns its new version."""
        if self.poisoned is not None:
            self.check_writable()
        v = self._put(slot, OCCUPIED, body, version)
        if self._report or self.sync_every is not None:  # else _wrote has nothing to do
            self._wrote_or_stash(slot)
        _fail.point("fixed.after_slot_write")
        return v

    def free(self, slot: int, version: int = 0) -> int:
        """Mark a slot deleted (bumping its version) and push it on the free stack."""
        if self.poisoned is not None:
            self.check_writable()
        v = self._put(slot, DELETED, b"", version)
        self.sf.push_free(slot)
        self._wrote_or_stash(slot)
        _fail.point("fixed.after_slot_write")
        return v

    def ensure_capacity(self, slots: int) -> None:
        """Grow the file (in whole grow steps) until it holds ``slots`` slots (replay)."""
        if slots <= self.capacity:
            return
        step = self.config.grow_step
        self._remap_to(-(-slots // step) * step)
        self._build_free_list()

    def replay_write(self, slot: int, status: int, body: bytes, version: int) -> None:
        """Write a logged slot image with its logged version (transaction-log replay).

        Unlike :meth:`write` and :meth:`free` it does not touch the free stack; the
        replaying code closes the store afterwards and the next open rebuilds it.
        """
        self.check_writable()
        self._put(slot, status, body, version)
        self._wrote(slot)

    def repair_torn(self, slot: int) -> None:
        """Rewrite a torn slot as deleted so that ``check`` is clean again (S4)."""
        self.sf.put(slot, DELETED, b"")
        self.repaired_on_open += 1
        self._wrote(slot)

    def body(self, slot: int) -> bytes:
        return self.sf.body(slot, 0, self.body_size)

    def occupied_slots(self) -> np.ndarray:
        return np.flatnonzero(self.status == OCCUPIED)

    def torn_slots(self) -> np.ndarray:
        return np.flatnonzero(self.status == TORN)

    def _wrote_or_stash(self, slot: int) -> None:
        """``_wrote``, but a failed sync is kept for :meth:`raise_sync_error` instead of
        raised: the slot is already changed, and the caller must first bring its own
        bookkeeping (indexes) in line with it, then raise."""
        try:
            self._wrote(slot)
        except StorageError as e:
            self.sync_error = e

    @property
    def write_hook_always(self) -> bool:
        """Whether every slot write must be followed by :meth:`after_write` (a test file
        system records writes, or a failpoint is armed)."""
        return self._report or _fail.armed()

    def after_write(self, slot: int) -> None:
        """What follows a slot write made by armdb._core.qshard: the report and the
        timed sync (a failure stashed), then the failpoint."""
        if self._lean and not _fail.armed() and self._durable_flush():
            return
        self._wrote_or_stash(slot)
        _fail.point("fixed.after_slot_write")

    def _durable_flush(self) -> bool:
        """The common sync of a durable store's write, in one frame: the dirty range
        (the page just written) flushed, copy B of the mark rewritten, a failure stashed,
        exactly as :meth:`_sync_locked` does.  Returns ``False`` (nothing done) when the
        sync must also rewrite copy A or there is nothing dirty: the general path then
        runs.  Only on a store without a reporting or replicating map (``_lean``).

        A durable push spent about 3 us of Python in the general path (five frames,
        two clock reads, a tuple), against one msync of one page: 2-3 % of a push on a
        disk that syncs in 90 us, and the push/durable row stood at 0.78-0.79x the raw
        ``pwrite`` + ``fdatasync`` loop.  Copy B is stored straight into the redo map
        (:meth:`_write_hwm` without its report, which a lean store has no use for) and
        the range goes to the file system's msync without ``MappedFile.flush``'s frame:
        4,300 of the 23,100 instructions of a durable push (callgrind), on a disk that
        syncs in 40 us."""
        sf = self.sf
        lo = sf.dirty_lo
        synced = self._hwm_synced
        if lo < 0 or synced - self._hwm_a >= HWM_STEP or sf.werrno:
            return False
        hi = sf.dirty_hi
        mark = sf.hwm
        sf.last_sync = _monotonic()
        if synced > self._hwm_b:
            gen = self._hwm_gen = self._hwm_gen + 1
            view = self.redo_mapped._view  # None only once closed, and the caller holds the store open
            view[HWM_REDO_OFFSET : HWM_REDO_OFFSET + HWM_BYTES] = encode_hwm(gen, synced)  # type: ignore[index]
            self._hwm_b = synced
        sf.dirty_lo = sf.dirty_hi = -1
        start = lo - lo % _fs.PAGE  # MappedFile.flush's rounding (the range lies inside the map)
        try:
            _fs.FS._msync(self.mapped, start, hi - start)
        except OSError as e:
            err = self._sync_failed(e)
            err.__cause__ = e
            self.sync_error = err
            return True
        if mark > synced:
            self._hwm_synced = mark
        return True

    def _wrote(self, slot: int) -> None:
        """Report a slot write (to a recording file system) and sync when one is due.

        ``sf.put`` already counted it (dirty range, high-water mark)."""
        if self._report:  # the redo record, then the slot
            self.mapped.wrote_after(self.redo_mapped, _k.REDO_OFFSET, _k.REDO_HEAD + self.slot_size,
                                    HEADER_PAGE + slot * self.slot_size, self.slot_size)
        every = self.sync_every
        if every is not None and time.monotonic() - self.sf.last_sync >= every:
            # A timed sync is due.  Unless every write must be synced, the writer only
            # wakes the flusher, which flushes without the lock (sync()): the writer and
            # the other threads go on meanwhile.  The sync starts as soon as it would
            # have, so a power loss takes no more than before.
            kick = self.kick
            if every and kick is not None and _fs.background_sync_ok() and kick():
                self.sf.last_sync = time.monotonic()
            else:
                self._sync_locked()
                if every == 0:  # a durable write: synchronous followers have it too (R4)
                    self.mapped.durable()

    # -- durability ------------------------------------------------------------------
    def _sync_plan(self, *, final: bool = False) -> tuple[int, int, int]:
        """Under the lock, the first half of a sync: returns the byte range to flush
        (``lo < 0``: none) and the high-water mark the flush will cover, after rewriting
        the mark's copies as :meth:`_sync_locked` explains.  The dirty range is left as
        it is: the caller clears it once the range is flushed."""
        sf = self.sf
        lo, hi = sf.dirty_lo, sf.dirty_hi
        sf.last_sync = time.monotonic()
        synced = self._hwm_synced
        if synced > self._hwm_b:
            self._write_hwm(synced, data=False)
        if synced > self._hwm_a and (lo < 0 or final or synced - self._hwm_a >= HWM_STEP):
            self._write_hwm(synced, data=True)
            lo, hi = 0, max(hi, HEADER_PAGE)
        return lo, hi, sf.hwm

    def _write_failed(self) -> StorageError:
        """A direct write failed (``SlotFile.werrno``; its sync reports it): the store is
        poisoned as by a failed sync, and never written again (S12)."""
        code = self.sf.werrno
        e = OSError(code, os.strerror(code))
        if self.poisoned is None:
            self.poisoned = e
        err = StorageError(f"{self.path}: writing a slot failed ({e}); writes are refused until the database is "
                           f"reopened")
        err.__cause__ = e
        return err

    def _sync_failed(self, e: OSError) -> StorageError:
        # Never retried (S12): the kernel may already have dropped the dirty pages.
        if self.poisoned is None:
            self.poisoned = e
        return StorageError(f"{self.path}: msync failed ({e}); writes are refused until the database is reopened")

    def _sync_locked(self, *, final: bool = False) -> None:
        """msync the dirty range, and bring the high-water mark up to date.

        The mark lags one sync behind: it is raised only to what the *previous* sync
        covered (slots on disk already), so whenever its bytes reach the disk, and in
        whatever order the kernel writes this sync's pages, it never claims a slot
        whose first write could still be lost.  For the same reason copy B (in
        ``fixed.redo``) needs no msync of its own: it is rewritten at every sync and
        reaches the disk with the next redo msync or write-back.  Copy A (header page
        of ``fixed.data``) would add a page to this sync, so it is rewritten only when
        it lags ``HWM_STEP`` slots, on an idle sync (the background flusher) and on
        close; a durable push costs one msync of one page.  ``final`` (close) records
        the last mark in both copies with a second, small sync.

        A flush that :meth:`sync` runs outside the lock meanwhile needs no wait: it
        leaves the dirty range in place until it is done, so this one flushes its
        pages too before it claims their mark.
        """
        sf = self.sf
        if sf.werrno:
            raise self._write_failed()
        lo, hi, mark = self._sync_plan(final=final)
        sf.dirty_lo = sf.dirty_hi = -1
        if lo < 0:
            return
        try:
            self.mapped.flush(lo, hi - lo)
            self._hwm_synced = max(self._hwm_synced, mark)
            if final and mark > min(self._hwm_a, self._hwm_b):
                self._write_hwm(mark, data=False)
                self._write_hwm(mark, data=True)
                self.redo_mapped.flush()
                self.mapped.flush(0, HEADER_PAGE)
        except OSError as e:
            raise self._sync_failed(e) from e
        _fail.point("fixed.after_flush")

    def sync(self) -> None:
        """Flush the dirty range if there is one (the background flusher's tick, and the
        timed sync a writer handed it).

        On the plain file system the flush runs outside the lock, with the GIL released,
        so writers go on meanwhile; their new writes stay in the dirty range for the next
        sync.  A file system of the tests gets the flush under the lock, in order.
        """
        if self.ordered and self.sf.dirty_lo < 0 and time.monotonic() - self.sf.last_sync < BUSY_SYNC_GAP:
            # A durable store that synced a write of its own moments ago: nothing is dirty,
            # and copy A of the mark follows within HWM_STEP slots on the writers' path.
            # Taking the lock here only made the writers wait: for the shard lock, then
            # for an msync of the header page that holds the GIL (every tick, 50 ms).  The
            # first tick after the writes stop refreshes copy A.
            return
        if self.ordered or not _fs.background_sync_ok():
            with self.lock:
                if self.poisoned is None and self.config.enable_fsync and not self.sf.closed:
                    self._sync_locked()
            return
        sf = self.sf
        with self.lock:
            if self.poisoned is not None or not self.config.enable_fsync or sf.closed or self._flushing:
                return
            writes = sf.writes
            lo, hi, mark = self._sync_plan()
            if lo < 0:
                return
            self._flushing = True
            mapped = self.mapped  # a grow may remap meanwhile: this map stays valid until flushed
        err: OSError | None = None
        try:
            mapped.flush(lo, hi - lo, release_gil=True)
        except OSError as e:
            err = e
        with self.lock:
            self._flushing = False
            if sf.closed:
                return  # the close flushed the same range again, under the lock
            if err is not None:
                raise self._sync_failed(err) from err
            if sf.writes == writes:
                sf.dirty_lo = sf.dirty_hi = -1  # nothing written since the plan: all flushed
            self._hwm_synced = max(self._hwm_synced, mark)

    def sync_now(self) -> None:
        """Flush regardless of ``enable_fsync`` (durable operations).

        On a closed shard there is nothing left to flush (close synced everything),
        unless that final sync failed: then ``StorageError``, as before the close.
        """
        with self.lock:
            if self.sf.closed and self.poisoned is None:
                return
            if self.poisoned is not None:
                raise StorageError(
                    f"{self.path}: an earlier sync failed ({self.poisoned}); writes are refused "
                    f"until the database is reopened"
                )
            self._sync_locked()

    def close(self) -> None:
        """Sync, unmap and close, all under the lock: a call racing the close either
        finishes before it or finds the shard closed and raises ``DbClosed``."""
        with self.lock:
            if self._fd < 0:
                return
            try:
                if self.poisoned is None:
                    self._sync_locked(final=True)
            finally:
                self.sf.release()
                self.mapped.close()
                self.redo_mapped.close()
                self.slots = None  # type: ignore[assignment]
                self.redo = None  # type: ignore[assignment]
                _fs.FS.close(self._fd)
                _fs.FS.close(self._redo_fd)
                self._fd = self._redo_fd = -1

    # -- inspection --------------------------------------------------------------------
    def logical_bytes(self) -> int:
        return HEADER_PAGE + self.capacity * self.slot_size

    def physical_bytes(self) -> int:
        return _fs.FS.physical_size(self.path)

    def _write_hwm(self, mark: int, *, data: bool) -> None:
        """Store the mark in copy A (``data``) or B, under a new generation; the
        valid copy with the higher generation counts, so a torn copy leaves the other."""
        self._hwm_gen += 1
        if data:
            self.mapped.write(HWM_DATA_OFFSET, encode_hwm(self._hwm_gen, mark))
            self._hwm_a = mark
        else:
            self.redo_mapped.write(HWM_REDO_OFFSET, encode_hwm(self._hwm_gen, mark))
            self._hwm_b = mark


class FixedStore:
    """A FixedStore collection: ``<dir>/shard-NNN/fixed.data`` for each shard."""

    def __init__(self, directory: str, shard_count: int, key_size: int, value_size: int, config: FixedConfig) -> None:
        self.directory = directory
        self.config = config
        self.key_size = key_size
        self.value_size = value_size
        self.shards: list[FixedShard] = []
        try:
            for i in range(shard_count):
                self.shards.append(
                    FixedShard(os.path.join(directory, f"shard-{i:03d}"), i, key_size, value_size, config)
                )
        except BaseException:
            for s in self.shards:
                s.close()
            raise

    def __iter__(self) -> Iterator[FixedShard]:
        return iter(self.shards)

    def sync(self) -> None:
        for s in self.shards:
            s.sync()

    def set_kick(self, kick: Callable[[], bool]) -> None:
        """Let timed syncs wake the Db's flusher (FixedShard.kick)."""
        for s in self.shards:
            s.kick = kick

    def sync_now(self) -> None:
        for s in self.shards:
            s.sync_now()

    def close(self) -> None:
        for s in self.shards:
            s.close()

    @property
    def repaired_on_open(self) -> int:
        return sum(s.repaired_on_open for s in self.shards)


def check_shard_file(path: str, key_size: int | None = None, value_size: int | None = None) -> list[str]:
    """Read-only check of one ``fixed.data`` (used by ``armdb.check``)."""
    fs = _fs.FS
    findings: list[str] = []
    try:
        raw = fs.read_file(path)
    except OSError as e:
        return [f"{path}: cannot read ({e})"]
    try:
        slot_size, ks, vs, _ = decode_header(raw[:HEADER_PAGE], path)
    except FormatError as e:
        return [str(e)]
    if len(raw) < HEADER_PAGE:
        findings.append(f"{path}: the file is cut short inside its header page ({len(raw)} bytes)")
    # Every header field the slots are read with is input: open refuses a geometry other
    # than the collection's, so the slots are not read with it here either.
    if key_size is not None and (ks, vs) != (key_size, value_size):
        findings.append(f"{path}: slot geometry {ks}+{vs} differs from the collection's {key_size}+{value_size}")
        return findings
    expected = slot_size_for(ks, vs)
    if slot_size != expected:
        findings.append(
            f"{path}: the header gives a slot size of {slot_size} bytes, but {ks}+{vs}-byte slots take "
            f"{expected}; open refuses the file. Restore it from a backup"
        )
        return findings
    n = max(0, (len(raw) - HEADER_PAGE) // slot_size)
    slots = np.frombuffer(raw[HEADER_PAGE:].ljust(n * slot_size, b"\0"), dtype=np.uint8, count=n * slot_size)
    slots = slots.reshape(n, slot_size).copy()
    versions = np.zeros(n, dtype=np.uint32)
    status = np.zeros(n, dtype=np.uint8)
    _, torn = _k.validate(slots, versions, status)
    redo_path = os.path.join(os.path.dirname(path), REDO_NAME)
    redo = b""
    if fs.exists(redo_path):
        try:
            redo_raw = fs.read_file(redo_path)
        except OSError as e:
            findings.append(f"{redo_path}: cannot read ({e})")
        else:
            try:
                if judge_redo_header(redo_raw, redo_path, slot_size):
                    redo = redo_raw[: _k.REDO_OFFSET]
                # else: open recreates the damaged, empty file; its high-water mark copy goes with it
            except FormatError as e:
                findings.append(str(e))
    _, mark = read_hwm(raw[:HEADER_PAGE], redo)
    lost, first = lost_below_hwm(status, mark)
    if lost:
        findings.append(
            f"{path}: {lost} slot(s) below the high-water mark {mark} read as never written (first: slot "
            f"{first}); the file was zeroed or cut short"
        )
    if torn:
        bad = np.flatnonzero(status == TORN)[:5].tolist()
        findings.append(f"{path}: {torn} slot(s) fail their CRC (first: {bad})")
    return findings


def collection_shards(directory: str) -> list[str]:
    """Shard folders of a collection directory, in order."""
    fs = _fs.FS
    return [os.path.join(directory, d) for d in fs.listdir(directory) if d.startswith("shard-")]

