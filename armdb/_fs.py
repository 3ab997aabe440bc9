"""The one module that touches the operating system for storage: the seam where tests install file systems.

Every open, read, write, sync, rename, unlink, truncate, allocation, lock and
memory map that armdb does goes through the object in ``armdb._fs.FS``.  Callers always spell it
``_fs.FS.pwrite(...)`` (attribute lookup at call time), so a test can install a
fault-injecting or write-recording file system with :func:`use` and every layer
above sees it.  A guard test greps the package and fails if any other module
calls the OS directly.

One exception, declared here: the transaction log's group commit
(``armdb._core.groupsync``) calls ``fdatasync(2)`` from C, without the GIL, but
only while :meth:`RealFS.native_fdatasync` allows it, i.e. while the installed
file system's ``fdatasync`` is the plain one; a file system that overrides
``fdatasync`` has its method called for every log sync.

Memory maps: :meth:`RealFS.mmap` returns a :class:`MappedFile`, whose ``array``
is an ``np.memmap`` over the whole file.  Readers (and the Cython kernels) read
that array directly; writers store through it and then report the range with
:meth:`MappedFile.wrote`, which the real file system ignores and a recording
file system uses to log the bytes.  ``mmap.mmap.flush`` cannot be patched on an
instance, which is why flushing goes through :meth:`MappedFile.flush` too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap as _mmap
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import _fail
from ._core.atomicfile import msync_range, pwrite_all, pwritev_all

PAGE = _mmap.PAGESIZE
# New files and folders are private to their owner, like PostgreSQL's data directory
# (docs/operations.md, "File permissions").  A umask can only take bits away; inside a
# setgid folder they also get that folder's group bits, which is how a database is
# shared with a group.  Existing files keep their modes.
FILE_MODE = 0o600
DIR_MODE = 0o700
# posix_fallocate errors that mean "this file system cannot allocate", not "no room".
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL})

__all__ = ["FS", "PAGE", "MappedFile", "RealFS", "SyncFailed", "use"]


class SyncFailed(OSError):
    """An fsync inside :meth:`RealFS.create_file` failed (callers poison on it, S12)."""


class MappedFile:
    """A shared, writable memory map of a whole file, as an ``np.memmap`` of bytes."""

    def __init__(self, fs: RealFS, fd: int, length: int) -> None:
        self.fs = fs
        self.fd = fd
        self.length = length
        # np.memmap wants a file object; a non-owning one around our fd is enough.
        with open(fd, "r+b", closefd=False) as fobj:
            self.array: np.memmap = np.memmap(fobj, dtype=np.uint8, mode="r+", shape=(length,))
        # Stores through a memoryview: slicing an np.memmap builds a memmap per call
        # (several µs, paid by every durable sync for its high-water-mark copy).
        self._view: memoryview | None = self.array.data

    def write(self, offset: int, data: bytes) -> None:
        """Store ``data`` at ``offset`` and report the write."""
        n = len(data)
        assert self._view is not None, "write to a closed MappedFile"
        self._view[offset : offset + n] = data
        self.wrote(offset, n)

    def wrote(self, offset: int, length: int) -> None:
        """Report a store the caller made directly into ``array`` (a hook for tests)."""

    def wrote_after(self, first: MappedFile, first_offset: int, first_length: int, offset: int, length: int) -> None:
        """Report a store into ``first`` and then one into this map (a FixedStore slot
        write: its redo record, then the slot), in that order."""
        first.wrote(first_offset, first_length)
        self.wrote(offset, length)

    def durable(self) -> None:
        """A durable write to this map was just synced (a hook: a replicating file system
        waits here for its synchronous followers, docs/replication.md)."""

    def flush(self, offset: int = 0, length: int | None = None, *, release_gil: bool = False) -> None:
        """``msync`` a range (rounded out to whole pages); raises ``OSError`` on failure.

        ``msync`` keeps the GIL (``mmap.flush``): a durable writer that gave it up would
        wait for it behind any busy thread after every sync (docs/performance.md, "msync
        keeps the GIL").  ``release_gil``: the flusher's background sync, which must not
        stop the writers for the disk's time; only on the plain file system (the
        flusher syncs in the background only there, ``background_sync_ok``)."""
        if length is None:
            length = self.length - offset
        start = offset - offset % PAGE
        end = min(self.length, offset + length)
        if end <= start:
            return
        if release_gil:
            RealFS._msync_released(self, start, end - start)
        else:
            FS._msync(self, start, end - start)  # the installed file system, looked up now

    def close(self) -> None:
        """Drop the map.  The pages are unmapped once no array view refers to them."""
        if self._view is not None:
            self._view.release()
            self._view = None
        self.array = None  # type: ignore[assignment]


class RealFS:
    """The production file system: thin wrappers over ``os`` with full-write loops."""

    # -- descriptors -------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = FILE_MODE) -> int:
        if flags & os.O_CREAT and mode == FILE_MODE:
            mode = _creation_mode(path, FILE_MODE)
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def dup(self, fd: int) -> int:
        return os.dup(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        chunks = []
        while n > 0:
            chunk = os.pread(fd, n, offset)
            if not chunk:
                break
            chunks.append(chunk)
            n -= len(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    # Not os.pwrite: it gives the GIL up for a page-cache write (armdb._core.atomicfile).
    # The compiled function itself, not a method that calls it: every append (a Bitcask
    # record, a log record) calls ``_fs.FS.pwrite``, and a Python frame around the call
    # cost about as much as the write.  A file system that overrides ``pwrite`` (tests)
    # has its own method called, as before.
    pwrite = staticmethod(pwrite_all)

    def pwritev(self, fd: int, parts: list[bytes | bytearray], offset: int) -> None:
        """``pwrite`` of ``parts`` end to end (a batch's log record, left in pieces): one
        vectored write, without their join, while ``pwrite`` is this class's own; a file
        system that overrides ``pwrite`` (tests, replication) gets the join through it,
        one call as before."""
        if type(self).pwrite is RealFS.pwrite:
            pwritev_all(fd, parts, offset)
        else:
            self.pwrite(fd, b"".join(parts), offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def native_fdatasync(self) -> bool:
        """Whether the transaction log may call ``fdatasync(2)`` itself, without the GIL
        (``armdb._core.groupsync``, group commit).  Only while this class's
        ``fdatasync`` is the plain one above: a file system that overrides it (fault
        injection, recording, counting) has its own method called for every sync."""
        return type(self).fdatasync is RealFS.fdatasync

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        """Allocate the disk blocks of ``[offset, offset + length)`` without changing a
        byte, extending the file when the range ends past it.

        A memory-mapped file gets its blocks here, before its pages are stored into: a
        store into a page without blocks on a full disk is a ``SIGBUS`` that kills the
        process, while this call fails with ``OSError(ENOSPC)``.  Where the file system
        cannot allocate (``EOPNOTSUPP``, ``EINVAL``) the blocks are allocated by writing
        (:meth:`_allocate_by_writing`), never skipped.
        """
        if length <= 0:
            return
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as e:
            if e.errno not in _NO_FALLOCATE:
                raise
            self._allocate_by_writing(fd, offset, length)

    def _allocate_by_writing(self, fd: int, offset: int, length: int) -> None:
        """:meth:`fallocate` for file systems without it: zeros written past the end of
        the file; inside it, every all-zero page is written again with its zeros (a page
        holding data has its blocks already).  Only called where no one else writes the
        range (creation, open, growth under the store's lock)."""
        end = offset + length
        size = self.size(fd)
        pos = offset - offset % PAGE
        chunk = 1 << 20
        while pos < min(end, size):
            n = min(chunk, min(end, size) - pos)
            data = self.pread(fd, n, pos)
            p = 0
            while p < len(data):
                q = min(p + PAGE, len(data))
                if not any(data[p:q]):
                    r = q
                    while r < len(data) and not any(data[r : r + PAGE]):
                        r = min(r + PAGE, len(data))
                    self.pwrite(fd, bytes(r - p), pos + p)
                    q = r
                p = q
            pos += n
        pos = max(pos, size)
        while pos < end:
            n = min(chunk, end - pos)
            self.pwrite(fd, bytes(n), pos)
            pos += n

    def flock(self, fd: int) -> bool:
        """Try to take an exclusive lock; ``False`` when someone else holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def funlock(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

    # -- paths -------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def writable(self, path: str) -> bool:
        """Whether this process may create files in the directory ``path`` (a read-only
        mount or missing permission says no; root ignores permission bits)."""
        return os.access(path, os.W_OK | os.X_OK)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents, fsyncing each new entry into its parent
        directory so that the directory itself survives a power loss."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent != path:
            self.makedirs(parent)
        try:
            os.mkdir(path, _creation_mode(path, DIR_MODE))
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            return
        self.fsync_dir(parent)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def remove_tree(self, path: str) -> None:
        """Delete the folder ``path`` and everything in it (a follower's restart of its copy)."""
        shutil.rmtree(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def data_extents(self, fd: int, start: int, end: int) -> list[tuple[int, int]]:
        """Byte ranges in ``[start, end)`` that hold data (holes of a sparse file skipped).

        Falls back to the whole range where the file system cannot tell.
        """
        out: list[tuple[int, int]] = []
        pos = start
        try:
            while pos < end:
                try:
                    data = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # no data after pos
                        break
                    raise
                if data >= end:
                    break
                hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
                out.append((data, hole))
                pos = hole
        except (OSError, AttributeError):
            return [(start, end)]
        return out

    def file_size(self, path: str) -> int:
        return os.stat(path).st_size

    def physical_size(self, path: str) -> int:
        """Bytes the file occupies on disk (sparse holes excluded)."""
        return os.stat(path).st_blocks * 512

    # -- whole small files ---------------------------------------------------------
    def read_file(self, path: str) -> bytes:
        fd = self.open(path, os.O_RDONLY)
        try:
            return self.pread(fd, self.size(fd), 0)
        finally:
            self.close(fd)

    def write_file_atomic(self, path: str, data: bytes, *, sync: bool = True) -> None:
        """Write ``path`` by tmp + fsync + rename + fsync of the directory."""
        tmp = path + ".tmp"
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            _keep_mode(fd, path)
            self.pwrite(fd, data, 0)
            if sync:
                self.fsync(fd)
        except BaseException:
            self.close(fd)
            self.unlink(tmp)
            raise
        self.close(fd)
        _fail.point("meta.after_tmp_write")
        self.rename(tmp, path)
        if sync:
            self.fsync_dir(os.path.dirname(path) or ".")

    def create_file(self, path: str, head: bytes, size: int = 0) -> int:
        """Create ``path`` holding ``head`` (zero-extended to ``size``, with its blocks
        allocated by :meth:`fallocate`) durably and atomically.

        The file is built as ``path + ".tmp"``, fsynced, renamed over ``path``, and the
        directory fsynced; the returned ``O_RDWR`` descriptor is the final file's.  So a
        file under its final name always carries its complete header, whatever power
        loss does to unsynced writes: a header torn into garbage could otherwise not be
        told from a foreign file (SPEC D5).  A power cut before the rename leaves only
        the ``.tmp`` file, which the creator's next open deletes.
        """
        tmp = path + ".tmp"
        fd = self.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            _keep_mode(fd, path)
            self.pwrite(fd, head, 0)
            if size > len(head):
                self.fallocate(fd, 0, size)  # blocks allocated: the file may be mapped
            _synced(self.fsync, fd)
            self.rename(tmp, path)
            _synced(self.fsync_dir, os.path.dirname(path) or ".")
        except BaseException:
            self.close(fd)
            with contextlib.suppress(OSError):
                self.unlink(tmp)
            raise
        return fd

    def remove_stale_tmp(self, path: str) -> None:
        """Delete ``path + ".tmp"``, the leftover of a :meth:`create_file` cut short."""
        tmp = path + ".tmp"
        if self.exists(tmp):
            self.unlink(tmp)

    # -- memory maps ---------------------------------------------------------------
    def mmap(self, fd: int, length: int) -> MappedFile:
        return MappedFile(self, fd, length)

    def _msync(self, mf: MappedFile, offset: int, length: int) -> None:
        mf.array._mmap.flush(offset, length)  # type: ignore[union-attr,attr-defined]

    @staticmethod
    def _msync_released(mf: MappedFile, offset: int, length: int) -> None:
        array = mf.array
        if array is None:
            raise OSError(errno.EBADF, "msync of a closed mapping")
        msync_range(array, offset, length)  # compiled: the GIL is released through the sync


def _creation_mode(path: str, base: int) -> int:
    """``base`` (``FILE_MODE`` or ``DIR_MODE``), plus the group bits of the folder that
    will hold ``path`` when that folder is setgid (a folder shared with a group)."""
    try:
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return base
    if not parent.st_mode & stat.S_ISGID:
        return base
    group = parent.st_mode & (0o070 if base == DIR_MODE else 0o060)
    return base | group


def _keep_mode(fd: int, path: str) -> None:
    """Give ``fd``, a tmp file about to be renamed over ``path``, the mode ``path`` has
    now, or a new file's mode (a stale tmp file keeps its own mode when reopened)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = _creation_mode(path, FILE_MODE)
    os.fchmod(fd, mode)


def _synced(fn: Callable[[Any], None], arg: Any) -> None:
    try:
        fn(arg)
    except SyncFailed:
        raise
    except OSError as e:
        raise SyncFailed(e.errno, f"{e.strerror or e} (sync inside a file creation)") from e


FS: RealFS = RealFS()


def background_sync_ok() -> bool:
    """Whether a store may leave its timed syncs to the Db's flusher thread, which syncs
    outside the store's lock: only on the plain file system with no failpoint armed.  A
    recording or fault-injecting file system (the tests) gets every sync in the writing
    thread, in order, as before."""
    return type(FS) is RealFS and not _fail.armed()


@contextlib.contextmanager
def use(fs: RealFS) -> Iterator[RealFS]:
    """Install ``fs`` as the file system for the duration of the block (tests only)."""
    global FS
    old = FS
    FS = fs
    try:
        yield fs
    finally:
        FS = old
