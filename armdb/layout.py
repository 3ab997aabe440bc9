"""The database directory's layout: its names, the collection naming rule, ``db.meta``
and the directory lock (SPEC D1, D3, D9, D10).

::

    <db>/LOCK                      owner's pid; fcntl.flock'ed while open (DirLock)
    <db>/db.meta                   magic, format version, CRC, identity block
    <db>/seqmap                    reserved id blocks (armdb.seqmap)
    <db>/txlog/                    transaction log (armdb.txlog)
    <db>/collections/<name>/       one folder per collection, one subfolder per shard
    <db>/collections/<q>/queue.meta   a queue's header collection (armdb.qrows)
    <db>/collections/<q>.payload/  a var queue's bodies (a Bitcask collection)

A format module: it names files and encodes ``db.meta``; it runs no store.  Everything
that reads or writes a database directory (``Db``, the log, check, salvage, the command
line) takes these names from here (docs/architecture.md).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass

from . import _fs
from ._crypto import KEY_CHECK_LEN
from .errors import ConfigError, DbLocked, FormatError

MAGIC = b"ARMDBMT1"
# Version 2 adds the identity block; a version-1 file (exactly 16 bytes) still opens and
# is rewritten as version 2 (docs/format.md).
FORMAT_VERSION = 2
_META = struct.Struct("<8sI")
LOCK_FILE = "LOCK"
META_FILE = "db.meta"
COLLECTIONS = "collections"
QUEUE_META = "queue.meta"  # in a queue's header collection: what makes a folder a queue
SEQMAP_FILE = "seqmap"  # armdb.seqmap.FILE_NAME
TXLOG_DIR = "txlog"  # armdb.txlog.DIR
PAYLOAD_SUFFIX = ".payload"  # a var queue's body collection: "<queue>.payload"
NAME_RE = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,127}")
QUEUE_NAME_MAX = 120


def validate_name(name: object, *, queue: bool = False) -> str:
    """Check a collection name (D3); ``ConfigError`` says what is allowed."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ConfigError(
            f"invalid collection name {name!r}: use 1-128 characters of a-z, 0-9, '_', '.', '-', "
            f"starting with a letter, digit or '_'"
        )
    if queue and len(name) > QUEUE_NAME_MAX:
        raise ConfigError(f"queue name {name!r} is longer than {QUEUE_NAME_MAX} characters")
    if name.endswith(".payload") and not queue:
        raise ConfigError(f"collection name {name!r} ends in '.payload', which is reserved for var queues")
    return name


# The identity block after the first 16 bytes of db.meta (docs/format.md): the
# database's random id, which the transaction log's sealed records are bound to, and the
# check value of the log key, which refuses a wrong log key at open.  A version-2 file
# must have it, so a file cut back to 16 bytes is refused, not read as version 1.
IDENT_MAGIC = b"ARMDBID1"
_IDENT = struct.Struct("<8s16sI")  # magic, database id, length of the log key check value
DB_ID_LEN = 16


@dataclass(frozen=True)
class DbMeta:
    """What ``db.meta`` holds: the database id (``b""`` in a file written before ids
    existed) and the log key check value (``b""`` until a log key is first given)."""

    db_id: bytes = b""
    log_key_check: bytes = b""


def encode_meta(meta: DbMeta | None = None) -> bytes:
    """``db.meta`` for ``meta``; a new database (``meta`` None) gets a fresh random id."""
    if meta is None:
        meta = DbMeta(os.urandom(DB_ID_LEN))
    body = _META.pack(MAGIC, FORMAT_VERSION if meta.db_id else 1)
    raw = body + struct.pack("<I", zlib.crc32(body))
    if not meta.db_id:
        return raw
    ident = _IDENT.pack(IDENT_MAGIC, meta.db_id, len(meta.log_key_check)) + meta.log_key_check
    return raw + ident + struct.pack("<I", zlib.crc32(ident))


def check_meta(raw: bytes, path: str) -> DbMeta:
    """Check ``db.meta`` and return what it holds; ``FormatError`` for anything else."""
    if len(raw) < _META.size + 4 or raw[:8] != MAGIC:
        raise FormatError(f"{path}: not an armdb database (bad magic); point armdb at its own directory")
    _, version = _META.unpack_from(raw)
    if struct.unpack_from("<I", raw, _META.size)[0] != zlib.crc32(raw[: _META.size]):
        raise FormatError(f"{path}: database meta file fails its CRC; restore it from a backup")
    if version not in (1, FORMAT_VERSION):
        raise FormatError(
            f"{path}: database format version {version} is not supported (this armdb knows 1 and "
            f"{FORMAT_VERSION}); upgrade armdb"
        )
    start = _META.size + 4
    damaged = f"{path}: the identity block of the database meta file is damaged; restore it from a backup"
    if version == 1:
        if len(raw) != start:
            raise FormatError(damaged)
        return DbMeta()  # written before database ids: open adds them
    if len(raw) < start + _IDENT.size + 4 or raw[start : start + 8] != IDENT_MAGIC:
        raise FormatError(damaged)
    _, db_id, n = _IDENT.unpack_from(raw, start)
    end = start + _IDENT.size + n
    if n not in (0, KEY_CHECK_LEN) or len(raw) != end + 4:
        raise FormatError(damaged)
    if struct.unpack_from("<I", raw, end)[0] != zlib.crc32(raw[start:end]):
        raise FormatError(damaged)
    return DbMeta(bytes(db_id), bytes(raw[start + _IDENT.size : end]))


class DirLock:
    """An exclusive ``flock`` on ``<dir>/LOCK`` holding the owner's pid (D1).

    ``LOCK`` must be a regular file of its own: a symbolic link, a hard link to another
    file, a folder or a fifo there is refused with a ``ConfigError`` naming what to
    remove, so that writing the pid can never change another file.

    With ``write=False`` (read-only inspection, D10) nothing is created or written: an
    existing ``LOCK`` is opened read-only and locked, which still refuses a database
    that is open elsewhere, and a missing one is left missing.
    """

    def __init__(self, directory: str, *, write: bool = True) -> None:
        fs = _fs.FS
        self.path = os.path.join(directory, LOCK_FILE)
        self.fd = -1
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        try:
            # O_NOFOLLOW: never a symlink; O_NONBLOCK: a fifo cannot hang the open.
            fd = fs.open(self.path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            if write:
                raise
            return  # nobody ever opened this copy for writing: nothing to lock
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(self._refusal("is a symbolic link")) from None
            if e.errno == errno.EISDIR:
                raise ConfigError(self._refusal("is a directory")) from None
            if e.errno == errno.ENXIO:
                raise ConfigError(self._refusal("is a socket")) from None
            raise
        try:
            st = fs.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kinds = {stat.S_IFDIR: "directory", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket"}
                kind = kinds.get(stat.S_IFMT(st.st_mode), "special file")
                raise ConfigError(self._refusal(f"is a {kind}"))
            if st.st_nlink != 1:
                raise ConfigError(self._refusal(f"has other hard links ({st.st_nlink - 1}) to its contents"))
        except BaseException:
            fs.close(fd)
            raise
        if not fs.flock(fd):
            raw = fs.pread(fd, 32, 0)
            fs.close(fd)
            try:
                pid: int | None = int(raw.decode().strip())
            except ValueError:
                pid = None
            raise DbLocked(directory, pid)
        self.fd = fd
        if not write:
            return
        try:  # the lock is held and LOCK is our own regular file: record the owner
            fs.ftruncate(fd, 0)
            fs.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            self.release()
            raise

    def _refusal(self, what: str) -> str:
        return (
            f"{self.path} {what}; armdb's lock file must be a regular file of its own: "
            f"remove {self.path} (armdb creates it again) and open the database again"
        )

    @classmethod
    def for_inspection(cls, directory: str) -> DirLock:
        """The lock as read-only inspection takes it (D10): as ``Db.open`` does where the
        directory is writable, without writing anything where it is not (or where
        ``LOCK`` itself cannot be written)."""
        if _fs.FS.writable(directory):
            try:
                return cls(directory)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
        return cls(directory, write=False)

    def release(self) -> None:
        if self.fd >= 0:
            fs = _fs.FS
            try:
                fs.funlock(self.fd)
            finally:
                fs.close(self.fd)
                self.fd = -1
