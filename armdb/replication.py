"""Replication (SPEC section 11, R1 and R3): a primary streams its file writes, a follower
applies them and can be promoted.  The design and its guarantees: docs/replication.md.

The stream is taken at one place, the file-system seam ``armdb._fs.FS``: while a database
replicates, :class:`ReplicatingFS` (the plain file system plus a record of every change
to a file under a replicating database's directory) is installed there, so every write
of every store (FixedStore slots through ``MappedFile.wrote``, Bitcask and log
``pwrite``, the atomic meta files, creations, renames, unlinks, truncations and
allocations) is recorded inside the call that made it, in order.  The follower applies
the same operations to the same relative paths, so its files are byte copies of the
primary's, and opening them runs the normal crash recovery.

Lock policy: ``Primary.cond`` guards the stream (sequence, backlog); it is taken inside
the file-system call, under whatever store lock the writer holds, and never the other
way round (a sender thread holds it only to copy frame references, never across a
socket call).  ``Follower._lock`` guards the follower's files and state: the apply
thread holds it for one batch of frames, ``promote``/``close`` take it to stop.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import os
import select
import socket
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np

from . import _fs
from . import fixed as _fixed
from ._core import fixed as _kfixed
from .errors import (
    ConfigError,
    FormatError,
    ReadOnly,
    ReplicaMismatch,
    ReplicationError,
    ReplicationFrameError,
)
from .layout import LOCK_FILE, META_FILE, DirLock

__all__ = ["STATE_FILE", "Follower", "Primary", "ReadOnlyDb", "ReplicatingFS", "encode_frame", "start_primary"]

LOG = logging.getLogger("armdb")

MAGIC = "armdb-repl"
VERSION = 2  # 2: batch frames, delta copies
STATE_FILE = "replica.state"  # the follower's position (never replicated)
_STATE_MAGIC = b"ARMREPL1"
_HEAD = struct.Struct(">III")  # body length, crc32 of the body, crc32 of the first 8 bytes
MAX_FRAME = 64 << 20  # a longer frame is not ours (a W frame holds at most CHUNK bytes)
MAX_BATCH_OPS = 4096  # operations per batch frame of the stream
MAX_BATCH_BYTES = 4 << 20  # written bytes per batch frame (a batch frame stays far below MAX_FRAME)
BLOCK = 64 << 10  # bytes per digest of a delta copy (files other than FixedStore slots)
CHUNK = 1 << 20  # bytes per W frame of a snapshot
BACKLOG_BYTES = 64 << 20  # frames a primary keeps for followers to resume from
HEARTBEAT_S = 0.2  # an idle primary says where it is this often
LINGER_S = 0.001  # a sender woken by a write lets a batch gather this long (not with synchronous followers)
DRAIN_S = 0.01  # a follower applies what keeps arriving this long before it syncs
DEAD_PEER_S = 5.0  # a follower that heard nothing this long reconnects
_NOT_REPLICATED = frozenset({LOCK_FILE, STATE_FILE, STATE_FILE + ".tmp"})


# -- frames ---------------------------------------------------------------------------------------
def encode_frame(obj: Any) -> bytes:
    """One frame: ``len: u32 BE``, ``crc32: u32 BE`` of the body, ``crc32: u32 BE`` of
    those 8 bytes (a damaged length is refused at once, not waited for), the msgpack body."""
    body = msgpack.packb(obj, use_bin_type=True)
    head = struct.pack(">II", len(body), zlib.crc32(body))
    return head + struct.pack(">I", zlib.crc32(head)) + body


class _Reader:
    """Frames from a socket, through one buffer (a frame is never applied half read)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the peer closed the connection")
        self.buf += data

    def fill_ready(self) -> bool:
        """Read what the socket holds already, without waiting; whether anything came
        (the end of the stream is left for the next :meth:`fill` to raise)."""
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.buf += data
        return True

    def take_ready(self) -> bool:
        """Whether a complete frame (or a length no frame has) is buffered."""
        if len(self.buf) < _HEAD.size:
            return False
        n, _, hcrc = _HEAD.unpack_from(self.buf)
        return n > MAX_FRAME or hcrc != zlib.crc32(bytes(self.buf[:8])) or len(self.buf) >= _HEAD.size + n

    def take(self) -> Any:
        """The next complete frame, or ``None`` when the buffer holds none yet."""
        if len(self.buf) < _HEAD.size:
            return _NONE
        n, crc, hcrc = _HEAD.unpack_from(self.buf)
        if hcrc != zlib.crc32(bytes(self.buf[:8])):
            raise ReplicationFrameError(
                "a replication frame header failed its CRC; it was not applied, the follower resynchronises"
            )
        if n > MAX_FRAME:
            raise ReplicationFrameError(f"a replication frame claims {n} bytes; this is not an armdb replication stream")
        if len(self.buf) < _HEAD.size + n:
            return _NONE
        body = bytes(self.buf[_HEAD.size : _HEAD.size + n])
        del self.buf[: _HEAD.size + n]
        if zlib.crc32(body) != crc:
            raise ReplicationFrameError("a replication frame failed its CRC; it was not applied, the follower resynchronises")
        try:
            return msgpack.unpackb(body, raw=False)
        except Exception as e:  # msgpack raises several classes for garbage
            raise ReplicationFrameError(f"a replication frame does not decode ({e}); it was not applied") from e

    def frame(self) -> Any:
        """The next frame, waiting for it."""
        while True:
            got = self.take()
            if got is not _NONE:
                return got
            self.fill()


_NONE: Any = object()
_OPS = frozenset("WTACRUD")  # the operations of a stream frame


def _safe_rel(rel: Any) -> str:
    """A relative path from a frame, refused if it could leave the follower's directory."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or rel != os.path.normpath(rel) or rel.startswith(".."):
        raise ReplicationFrameError(f"a replication frame names the path {rel!r}, which is not inside a database")
    if rel in _NOT_REPLICATED:
        raise ReplicationFrameError(f"a replication frame writes {rel!r}, which is never replicated")
    return rel


# -- the primary's side: the recording file system ------------------------------------------------
class _RecordingMap(_fs.MappedFile):
    """A memory map whose reported stores go to the stream (``FixedShard`` then reports
    every slot write, and the compiled queue code calls its hook for each)."""

    def __init__(self, fs: _fs.RealFS, fd: int, length: int, pub: Primary, rel: str) -> None:
        super().__init__(fs, fd, length)
        self._pub = pub
        self._rel = rel

    def wrote(self, offset: int, length: int) -> None:
        view = self._view
        if view is not None:
            self._pub.record(("W", self._rel, offset, view[offset : offset + length].tobytes()), length)

    def wrote_after(self, first: _fs.MappedFile, first_offset: int, first_length: int, offset: int,
                    length: int) -> None:
        view, other = self._view, first._view
        if view is None or other is None or not isinstance(first, _RecordingMap) or first._pub is not self._pub:
            super().wrote_after(first, first_offset, first_length, offset, length)
            return
        self._pub.record_two(("W", first._rel, first_offset, other[first_offset : first_offset + first_length].tobytes()),
                             ("W", self._rel, offset, view[offset : offset + length].tobytes()),
                             first_length + length)

    def durable(self) -> None:
        """A durable write to this map is on the primary's disk: with ``sync_replicas(n)``,
        wait until ``n`` followers have it (and everything recorded before it) too (R4)."""
        pub = self._pub
        if pub.sync_n:
            pub.wait_replicated(pub.sync_n)


class ReplicatingFS(_fs.RealFS):
    """The plain file system, plus a record of every change under a replicating root."""

    def __init__(self) -> None:
        self.roots: dict[str, Primary] = {}
        self._fds: dict[int, tuple[Primary, str] | None] = {}

    def _match(self, path: str) -> tuple[Primary, str] | None:
        if not self.roots:
            return None
        full = os.path.realpath(path)  # as /proc/self/fd names it: symbolic links resolved
        for root, pub in self.roots.items():
            if full.startswith(root + os.sep):
                rel = full[len(root) + 1 :]
                return None if rel in _NOT_REPLICATED else (pub, rel)
        return None

    def _of_fd(self, fd: int) -> tuple[Primary, str] | None:
        try:
            return self._fds[fd]
        except KeyError:
            pass
        # A descriptor opened before replication started: ask the kernel its path.
        try:
            hit = self._match(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            hit = None
        self._fds[fd] = hit
        return hit

    def open(self, path: str, flags: int, mode: int = _fs.FILE_MODE) -> int:
        fd = super().open(path, flags, mode)
        hit = self._match(path)
        self._fds[fd] = hit
        if hit is not None and flags & os.O_CREAT:
            hit[0].record(("C", hit[1], bool(flags & os.O_TRUNC)))
        return fd

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        super().pwrite(fd, data, offset)
        hit = self._of_fd(fd)
        if hit is not None:
            n = len(data)
            if n <= CHUNK:
                hit[0].record(("W", hit[1], offset, bytes(data)), n)
                return
            view = memoryview(data)  # a large write travels in pieces: every frame stays far below MAX_FRAME
            for lo in range(0, n, CHUNK):
                hit[0].record(("W", hit[1], offset + lo, bytes(view[lo : lo + CHUNK])), min(CHUNK, n - lo))

    def ftruncate(self, fd: int, size: int) -> None:
        super().ftruncate(fd, size)
        hit = self._of_fd(fd)
        if hit is not None:
            hit[0].record(("T", hit[1], size))

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        super().fallocate(fd, offset, length)
        hit = self._of_fd(fd)
        if hit is not None and length > 0:
            hit[0].record(("A", hit[1], offset, length))

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        a, b = self._match(src), self._match(dst)
        if a is not None and b is not None and a[0] is b[0]:
            a[0].record(("R", a[1], b[1]))
            for fd, hit in list(self._fds.items()):  # an open descriptor now writes ``dst``
                if hit == a:
                    self._fds[fd] = b
        elif b is not None:  # a file moved in from elsewhere: send its bytes
            b[0].record_file(b[1])
        elif a is not None:
            a[0].record(("U", a[1]))

    def unlink(self, path: str) -> None:
        super().unlink(path)
        hit = self._match(path)
        if hit is not None:
            hit[0].record(("U", hit[1]))

    def makedirs(self, path: str) -> None:
        super().makedirs(path)
        hit = self._match(path)
        if hit is not None:
            hit[0].record(("D", hit[1]))

    def mmap(self, fd: int, length: int) -> _fs.MappedFile:
        hit = self._of_fd(fd)
        if hit is None:
            return super().mmap(fd, length)
        return _RecordingMap(self, fd, length, hit[0], hit[1])


_INSTALL = threading.Lock()
_PLAIN: list[_fs.RealFS] = []  # the file system ReplicatingFS replaced, put back by the last stop


def _install(pub: Primary) -> None:
    with _INSTALL:
        fs = _fs.FS
        if not isinstance(fs, ReplicatingFS):
            if type(fs) is not _fs.RealFS:
                raise ConfigError(
                    "replication needs armdb's own file system, and another one is installed (a test's); "
                    "remove it before calling db.replicate()"
                )
            _PLAIN[:] = [fs]
            fs = ReplicatingFS()
            _fs.FS = fs
        for root in fs.roots:
            if pub.root.startswith(root + os.sep) or root.startswith(pub.root + os.sep):
                raise ConfigError(f"{pub.root} and {root} are nested; replicate databases in separate directories")
        fs.roots[pub.root] = pub
        fs._fds.clear()  # descriptors are looked up again (a cached "not ours" may now be ours)


def _uninstall(pub: Primary) -> None:
    with _INSTALL:
        fs = _fs.FS
        if isinstance(fs, ReplicatingFS):
            fs.roots.pop(pub.root, None)
            fs._fds.clear()
            if not fs.roots:
                _fs.FS = _PLAIN.pop() if _PLAIN else _fs.RealFS()


# -- the primary's side: the stream and its connections --------------------------------------------
class Primary:
    """The stream of one replicating database and the server its followers connect to.

    Recording is cheap on purpose: :meth:`record` appends the operation (a tuple) to a
    pending list under a plain lock.  Operations are encoded in batches (:meth:`seal`:
    one msgpack call and one CRC for up to ``MAX_BATCH_OPS`` of them), by a connection's
    sender as soon as it is idle, or by the writer whose operation fills a batch.
    Sealed batches form the backlog followers resume from."""

    def __init__(self, root: str, db_id: bytes, listen: tuple[str, int], sync_replicas: int = 0) -> None:
        self.root = os.path.realpath(root)
        self.db_id = db_id
        self.sync_n = sync_replicas
        self.stream = os.urandom(16)
        self._lock = threading.Lock()
        self.cond = threading.Condition(self._lock)
        self._seal_lock = threading.Lock()  # taken before _lock, never after
        self.seq = 0  # the last recorded operation
        self._pending: list[tuple[Any, ...]] = []  # recorded, not yet sealed
        self._pend_bytes = 0
        self._pend_t0 = 0.0  # when the first pending operation was recorded
        self._sleepers = 0  # senders waiting for operations (a record wakes them)
        self._sync_waiters = 0  # commits waiting for followers (R4): senders do not linger
        # The backlog: sealed batches, oldest first, as parallel lists.
        self._firsts: list[int] = []  # the sequence of each batch's first operation
        self._batches: list[bytes] = []  # each batch's frame
        self._starts: list[int] = []  # stream bytes before each batch
        self._times: list[float] = []  # when each batch's first operation was recorded
        self.sealed = 0  # the last sealed sequence
        self._total = 0  # stream bytes sealed so far
        self._backlog = 0  # bytes the backlog holds
        self.closed = False
        self.released = False  # wait_replicated returns at once (closing)
        self._conns: set[socket.socket] = set()
        self._peers: dict[socket.socket, dict[str, Any]] = {}  # per follower: phase, acked (R4), address
        self._threads: list[threading.Thread] = []
        # Called with (sequence, monotonic time) for each follower confirmation (the bench's lag).
        self.ack_listener: Callable[[int, float], None] | None = None
        try:
            self._server = socket.create_server(listen)
        except (OSError, TypeError, ValueError, OverflowError) as e:
            raise ConfigError(f"cannot listen on {listen!r} ({e}); pass listen=(host, port) of a free local address") from e
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._server.settimeout(0.2)
        self._accepter = threading.Thread(target=self._accept, name="armdb-replicate", daemon=True)

    # -- recording (called inside the file-system calls) --
    def record(self, op: tuple[Any, ...], nbytes: int = 0) -> None:
        """Append one operation; ``nbytes`` is the size of the data it carries."""
        with self._lock:
            self.seq += 1
            pend = self._pending
            if not pend:
                self._pend_t0 = time.monotonic()
            pend.append(op)
            self._pend_bytes += nbytes
            full = len(pend) >= MAX_BATCH_OPS or self._pend_bytes >= MAX_BATCH_BYTES
            if self._sleepers:  # woken once: the next records find no sleeper to notify
                self._sleepers = 0
                self.cond.notify_all()
        if full:
            self.seal()

    def record_two(self, op: tuple[Any, ...], op2: tuple[Any, ...], nbytes: int) -> None:
        """:meth:`record` of two operations in a row (a slot write's redo record and slot)."""
        with self._lock:
            self.seq += 2
            pend = self._pending
            if not pend:
                self._pend_t0 = time.monotonic()
            pend.append(op)
            pend.append(op2)
            self._pend_bytes += nbytes
            full = len(pend) >= MAX_BATCH_OPS or self._pend_bytes >= MAX_BATCH_BYTES
            if self._sleepers:
                self._sleepers = 0
                self.cond.notify_all()
        if full:
            self.seal()

    def record_file(self, rel: str) -> None:
        """A whole file as operations (a file renamed in from outside the directory)."""
        for frame in _file_frames(self.root, rel):
            self.record(tuple(frame))

    def seal(self) -> int:
        """Encode the pending operations as one batch of the backlog; returns the last
        sealed sequence (every operation up to it is in the backlog, none after it)."""
        with self._seal_lock:
            with self._lock:
                ops, self._pending = self._pending, []
                self._pend_bytes = 0
                t0, last = self._pend_t0, self.seq
            if not ops:
                return self.sealed
            first = last - len(ops) + 1
            frame = encode_frame(["B", first, ops])
            with self._lock:
                self._firsts.append(first)
                self._batches.append(frame)
                self._starts.append(self._total)
                self._times.append(t0)
                self._total += len(frame)
                self._backlog += len(frame)
                self.sealed = last
                if self._backlog > BACKLOG_BYTES and len(self._batches) > 1:
                    drop = max(1, len(self._batches) // 4)
                    self._backlog -= sum(len(f) for f in self._batches[:drop])
                    for lst in (self._firsts, self._batches, self._starts, self._times):
                        del lst[:drop]  # type: ignore[attr-defined]
                self.cond.notify_all()
            return last

    def _index_after(self, seq: int) -> int | None:
        """The backlog index of the batch that follows sequence ``seq`` (its length when
        ``seq`` is the last sealed one); ``None`` when the backlog no longer holds it or
        ``seq`` is not a batch boundary.  Under ``_lock``."""
        if seq == self.sealed:
            return len(self._firsts)
        k = bisect.bisect_left(self._firsts, seq + 1)
        if k < len(self._firsts) and self._firsts[k] == seq + 1:
            return k
        return None

    # -- serving --
    def start(self) -> None:
        self._accepter.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn, peer), name="armdb-replicate-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(DEAD_PEER_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a batch or heartbeat goes at once
            reader = _Reader(conn)
            hello = reader.frame()
            if not (isinstance(hello, dict) and hello.get("magic") == MAGIC):
                return  # not a follower: say nothing
            if hello.get("version") != VERSION:
                conn.sendall(encode_frame({"magic": MAGIC, "version": VERSION, "error": "version"}))
                return
            seq = hello.get("seq")
            head = self.seal()  # the sealed head is a batch boundary: a copy starts there
            with self._lock:
                resume = (hello.get("stream") == self.stream and isinstance(seq, int)
                          and self._index_after(seq) is not None)
            start = seq if resume else head
            assert isinstance(start, int)
            # A follower that holds a complete copy of this database gets only what differs.
            mode = "resume" if resume else ("delta" if hello.get("db_id") == self.db_id
                                            and hello.get("complete") is True else "snapshot")
            reply = {"magic": MAGIC, "version": VERSION, "db_id": self.db_id, "stream": self.stream,
                     "mode": mode, "seq": start}
            conn.sendall(encode_frame(reply))
            if hello.get("db_id") not in (None, self.db_id):
                return  # the follower refuses us (ReplicaMismatch on its side)
            with self._lock:
                self._peers[conn] = {"address": f"{peer[0]}:{peer[1]}", "phase": mode if mode != "resume" else
                                     "streaming", "acked": start}
            if mode == "snapshot":
                self._send_snapshot(conn, start)
            elif mode == "delta":
                self._send_delta(conn, reader, start)
            with self._lock:
                if self.closed:
                    return
                self._peers[conn]["phase"] = "streaming"
            acks = threading.Thread(target=self._read_acks, args=(conn, reader), name="armdb-replicate-acks",
                                    daemon=True)
            acks.start()
            self._stream(conn, start)
            # The end of the stream: FIN after the last frame, then wait for the follower
            # to hang up.  Closing with its acks unread would send a reset, and a reset
            # makes the follower's kernel drop frames it has received but not yet read.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
            acks.join(DEAD_PEER_S)
        except (OSError, ReplicationError) as e:
            LOG.info("replication: a follower connection ended (%s)", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._peers.pop(conn, None)
                self.cond.notify_all()
            with contextlib.suppress(OSError):
                conn.close()

    def _walk(self) -> Iterator[tuple[str, bool]]:
        """Every directory and file of the database as ``(relative path, is a directory)``
        (directories before what they hold); not the lock."""
        fs = _fs.FS
        todo = [""]
        while todo:
            rel_dir = todo.pop()
            full_dir = os.path.join(self.root, rel_dir) if rel_dir else self.root
            try:
                names = fs.listdir(full_dir)
            except FileNotFoundError:
                continue
            if rel_dir:
                yield rel_dir, True
            for name in names:
                if self.closed:
                    raise ReplicationError("the primary closed during a copy; the follower will copy again")
                rel = os.path.join(rel_dir, name) if rel_dir else name
                if rel in _NOT_REPLICATED:
                    continue
                if fs.isdir(os.path.join(self.root, rel)):
                    todo.append(rel)
                else:
                    yield rel, False

    def _send_snapshot(self, conn: socket.socket, start: int) -> None:
        """Every file of the directory as it is now (writes go on), then where the copy
        ended; the frames after ``start`` make the copy consistent (docs/replication.md)."""
        conn.sendall(encode_frame(["S", start]))
        for rel, is_dir in self._walk():
            if is_dir:
                conn.sendall(encode_frame(["D", rel]))
                continue
            for frame in _file_frames(self.root, rel):
                conn.sendall(encode_frame(frame))
        conn.sendall(encode_frame(["E", self.seal()]))

    def _send_delta(self, conn: socket.socket, reader: _Reader, start: int) -> None:
        """A copy of only what differs (R5): for each file a manifest (``M``: its size and
        digests, per slot for a FixedStore file, per block for the others); the follower
        compares it with its own copy and asks (``Q``) for the ranges that differ, read
        now, like a snapshot's (the frames after ``start`` make the copy consistent)."""
        conn.sendall(encode_frame(["S", start]))
        conn.settimeout(max(DEAD_PEER_S, 60.0))  # the follower digests its own copy of each file
        for rel, is_dir in self._walk():
            if is_dir:
                conn.sendall(encode_frame(["D", rel]))
                continue
            man = _manifest(os.path.join(self.root, rel))
            if man is None:
                continue  # gone meanwhile: its removal is a frame after start
            size, kind, unit, digest = man
            conn.sendall(encode_frame(["M", rel, size, kind, unit, digest]))
            ask = reader.frame()
            if not (isinstance(ask, list) and len(ask) == 3 and ask[0] == "Q" and ask[1] == rel
                    and isinstance(ask[2], list) and len(ask[2]) % 2 == 0):
                raise ReplicationError(f"a follower answered a manifest of {rel} with {str(ask)[:80]}")
            conn.sendall(encode_frame(["C", rel, False]) + encode_frame(["T", rel, size]))
            for frame in _range_frames(self.root, rel, ask[2]):
                conn.sendall(encode_frame(frame))
        conn.settimeout(DEAD_PEER_S)
        conn.sendall(encode_frame(["E", self.seal()]))

    def _stream(self, conn: socket.socket, cursor: int) -> None:
        while True:
            woke = False
            with self._lock:
                if cursor == self.seq and not self.closed:
                    self._sleepers += 1
                    woke = self.cond.wait(HEARTBEAT_S)
                    if not woke and self._sleepers:
                        self._sleepers -= 1
                pending = bool(self._pending)
                linger = (woke and len(self._pending) < MAX_BATCH_OPS // 16 and not self._sync_waiters
                          and not self.sync_n)  # with synchronous followers, latency first
            if linger:
                time.sleep(LINGER_S)  # the writer goes on: fewer, larger batches
            if pending:
                self.seal()
            with self._lock:
                i = self._index_after(cursor)
                if i is None:
                    raise ReplicationError("the follower fell behind the backlog; it will copy what differs")
                batch = self._batches[i : i + 64]
                if batch:
                    j = i + len(batch)
                    cursor = self._firsts[j] - 1 if j < len(self._firsts) else self.sealed
                done = self.closed and cursor == self.seq
                head = self.sealed
            if batch:
                conn.sendall(b"".join(batch))
            elif done:
                return
            elif not pending:
                conn.sendall(encode_frame(["H", head, time.time()]))

    def _read_acks(self, conn: socket.socket, reader: _Reader) -> None:
        """A follower's ``["A", seq]`` frames: it has every frame through ``seq`` on disk."""
        try:
            while True:
                try:
                    frame = reader.frame()
                except TimeoutError:
                    continue  # an idle follower sends no acks
                if isinstance(frame, list) and len(frame) == 2 and frame[0] == "A" and isinstance(frame[1], int):
                    with self._lock:
                        peer = self._peers.get(conn)
                        if peer is not None and peer["phase"] == "streaming":
                            peer["acked"] = frame[1]
                            self.cond.notify_all()
                    listener = self.ack_listener
                    if listener is not None:
                        listener(frame[1], time.monotonic())
        except (OSError, ReplicationError):
            with self._lock:
                peer = self._peers.get(conn)
                if peer is not None:
                    peer["phase"] = "gone"
                self.cond.notify_all()

    def wait_replicated(self, n: int) -> None:
        """Wait until ``n`` followers have every operation recorded so far on disk (or
        the primary stops: a closing database confirms nothing more)."""
        with self._lock:
            target = self.seq
            self._sync_waiters += 1
            try:
                while not self.released and sum(
                    1 for p in self._peers.values() if p["phase"] == "streaming" and p["acked"] >= target
                ) < n:
                    if self._sleepers:
                        self.cond.notify_all()  # a sender seals and sends what we wait for
                    self.cond.wait(0.5)
            finally:
                self._sync_waiters -= 1

    def release(self) -> None:
        """Stop making commits wait for followers (the database is closing)."""
        with self._lock:
            self.released = True
            self.cond.notify_all()

    def _lag(self, acked: int, now: float) -> tuple[int, float]:
        """Bytes of stream and seconds a follower that holds everything through
        ``acked`` is behind (the age of the oldest operation it lacks).  Under ``_lock``."""
        if acked >= self.seq:
            return 0, 0.0
        k = bisect.bisect_right(self._firsts, acked)  # the first batch with an operation it lacks
        if k < len(self._firsts):
            return self._total - self._starts[k] + self._pend_bytes, max(0.0, now - self._times[k])
        return self._pend_bytes, max(0.0, now - self._pend_t0)

    def status(self) -> dict[str, Any]:
        """See ``Db.replication_status``."""
        now = time.monotonic()
        with self._lock:
            followers = []
            for p in self._peers.values():
                if p["phase"] == "gone":
                    continue
                lag_bytes, lag_s = self._lag(p["acked"], now)
                followers.append({"address": p["address"], "phase": p["phase"], "acked_seq": p["acked"],
                                  "lag_frames": max(0, self.seq - p["acked"]), "lag_bytes": lag_bytes,
                                  "lag_seconds": lag_s})
            return {"seq": self.seq, "address": self.address, "followers": followers,
                    "sync_replicas": self.sync_n, "stream_bytes": self._total, "backlog_bytes": self._backlog}

    def stop(self) -> None:
        """Stop accepting; connected followers get every recorded frame, then the end."""
        _uninstall(self)
        self.seal()
        with self._lock:
            self.closed = self.released = True
            self.cond.notify_all()
        with contextlib.suppress(OSError):
            self._server.close()
        if self._accepter.is_alive():
            self._accepter.join(2.0)
        with self._lock:  # a connection still in its hello or copy gets nothing more
            idle = [c for c in self._conns if self._peers.get(c, {}).get("phase") != "streaming"]
        for c in idle:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5.0  # streaming followers get the frames recorded so far
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            stuck = list(self._conns)
        for c in stuck:  # a follower that does not read: cut
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def _file_frames(root: str, rel: str) -> Any:
    """``C``, ``T`` and ``W`` frames (no sequence) that recreate one file; nothing if it is gone."""
    fs = _fs.FS
    try:
        fd = fs.open(os.path.join(root, rel), os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        size = fs.size(fd)
        yield ["C", rel, True]
        yield ["T", rel, size]
        for lo, hi in fs.data_extents(fd, 0, size):
            yield from _write_frames(fd, rel, lo, hi)
    finally:
        fs.close(fd)


def _write_frames(fd: int, rel: str, pos: int, end: int) -> Any:
    """``W`` frames of bytes ``pos .. end`` of the open file ``rel``, at most ``CHUNK`` each."""
    fs = _fs.FS
    while pos < end:
        data = fs.pread(fd, min(CHUNK, end - pos), pos)
        if not data:
            break
        yield ["W", rel, pos, data]
        pos += len(data)


def _range_frames(root: str, rel: str, ranges: list[Any]) -> Any:
    """``W`` frames of the byte ranges ``[off, len, off, len, ...]`` of one file, read now."""
    fs = _fs.FS
    try:
        fd = fs.open(os.path.join(root, rel), os.O_RDONLY)
    except FileNotFoundError:
        return  # removed meanwhile: a frame after the copy's start says so
    try:
        for i in range(0, len(ranges), 2):
            pos = int(ranges[i])
            yield from _write_frames(fd, rel, pos, pos + int(ranges[i + 1]))
    finally:
        fs.close(fd)


# -- digests of a delta copy (R5) ------------------------------------------------------------------
def _manifest(path: str) -> tuple[int, str, int, bytes] | None:
    """``(size, kind, unit, digest)`` of one file, or ``None`` if it is gone.  A FixedStore
    data file is described per slot: the 8-byte slot header (``meta = version << 2 |
    status`` and the slot's CRC), whose version the follower compares on the ring of S3;
    any other file per ``BLOCK`` bytes, a 16-byte BLAKE2b digest each."""
    fs = _fs.FS
    try:
        fd = fs.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = fs.size(fd)
        slot_size = _slot_size(fd, path) if os.path.basename(path) == _fixed.FILE_NAME else None
        if slot_size is not None:
            return size, "slots", slot_size, _slot_headers(fd, size, slot_size).tobytes()
        return size, "blocks", BLOCK, _block_digests(fd, size)
    finally:
        fs.close(fd)


def _slot_size(fd: int, path: str) -> int | None:
    raw = _fs.FS.pread(fd, _fixed.HEADER_PAGE, 0)
    try:
        slot_size = _fixed.decode_header(raw, path)[0]
    except FormatError:
        return None
    return slot_size if slot_size >= 8 else None


def _slot_headers(fd: int, size: int, slot_size: int) -> np.ndarray:
    """The 8-byte header of every whole slot of a FixedStore data file, as ``uint32`` pairs."""
    n = max(0, (size - _fixed.HEADER_PAGE) // slot_size)
    out = np.zeros((n, 2), dtype="<u4")
    per = max(1, CHUNK // slot_size)
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        raw = _fs.FS.pread(fd, (hi - lo) * slot_size, _fixed.HEADER_PAGE + lo * slot_size)
        got = len(raw) // slot_size
        if got:
            rows = np.frombuffer(raw, dtype=np.uint8, count=got * slot_size).reshape(got, slot_size)
            out[lo : lo + got] = rows[:, :8].copy().view("<u4")
    return out


def _block_digests(fd: int, size: int) -> bytes:
    out = []
    for off in range(0, size, BLOCK):
        out.append(hashlib.blake2b(_fs.FS.pread(fd, min(BLOCK, size - off), off), digest_size=16).digest())
    return b"".join(out)


def _ranges_to_ask(path: str, size: int, kind: str, unit: int, digest: bytes,
                   counts: dict[str, int]) -> list[int]:
    """What a follower asks for, given a primary's manifest of its file ``path``: the
    ranges ``[off, len, ...]`` that differ or that its copy lacks.  For slots the
    versions are compared on the ring of S3: a slot whose version is behind the
    primary's is recopied (``slots_behind``); one that is ahead of it, or exactly half
    the ring away (a slot more than 2^29 versions behind reads as ahead, and half the
    ring cannot be ordered), is unusably stale and recopied, never guessed
    (``slots_stale``); one of the same version whose CRC or status differs (a history
    the primary lost) is recopied too (``slots_diverged``)."""
    fs = _fs.FS
    try:
        fd = fs.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return [0, size] if size else []
    try:
        mine = fs.size(fd)
        if kind == "slots":
            theirs = np.frombuffer(digest, dtype="<u4").reshape(-1, 2)
            n = theirs.shape[0]
            local = _slot_headers(fd, min(mine, size), unit) if _slot_size(fd, path) == unit else np.zeros((0, 2), "<u4")
            m = min(n, local.shape[0])
            ring = np.zeros(m, dtype=np.int8)
            _kfixed.compare_many(np.ascontiguousarray(local[:m, 0] >> 2), np.ascontiguousarray(theirs[:m, 0] >> 2),
                                 ring)
            same = (ring == _kfixed.EQUAL) & (local[:m, 0] == theirs[:m, 0]) & (local[:m, 1] == theirs[:m, 1])
            counts["slots_behind"] += int(np.count_nonzero(ring == _kfixed.OLDER))
            counts["slots_stale"] += int(np.count_nonzero((ring == _kfixed.NEWER) | (ring == _kfixed.STALE)))
            counts["slots_diverged"] += int(np.count_nonzero((ring == _kfixed.EQUAL) & ~same))
            counts["slots_missing"] += n - m
            want = np.ones(n, dtype=bool)
            want[:m] = ~same
            out: list[int] = [0, min(size, _fixed.HEADER_PAGE)]  # the header page: small, always sent
            out += _runs(want, unit, _fixed.HEADER_PAGE)
            tail = _fixed.HEADER_PAGE + n * unit
            if size > tail:
                out += [tail, size - tail]
            return _coalesce(out)
        theirs_b = [digest[i : i + 16] for i in range(0, len(digest), 16)]
        mine_b = _block_digests(fd, min(mine, size))
        want = np.array([mine_b[i * 16 : i * 16 + 16] != d for i, d in enumerate(theirs_b)], dtype=bool)
        runs = _runs(want, unit, 0)
        for i in range(0, len(runs), 2):  # the last block may be short
            runs[i + 1] = min(runs[i + 1], size - runs[i])
        return runs
    finally:
        fs.close(fd)


def _runs(want: np.ndarray, unit: int, base: int) -> list[int]:
    """``[off, len, ...]`` of the runs of ``True`` in ``want``, each index ``unit`` bytes from ``base``."""
    if not want.size:
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], want.astype(np.int8), [0]))))
    out: list[int] = []
    for lo, hi in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
        out += [base + lo * unit, (hi - lo) * unit]
    return out


def _coalesce(ranges: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(ranges), 2):
        off, n = ranges[i], ranges[i + 1]
        if n <= 0:
            continue
        if out and out[-2] + out[-1] >= off:
            out[-1] = max(out[-2] + out[-1], off + n) - out[-2]
        else:
            out += [off, n]
    return out


def start_primary(root: str, db_id: bytes, listen: Any, sync_replicas: int = 0) -> Primary:
    """Serve ``root``'s stream on ``listen`` (a ``(host, port)`` pair) and record from now on."""
    if not (isinstance(listen, tuple) and len(listen) == 2 and isinstance(listen[0], str) and isinstance(listen[1], int)):
        raise ConfigError(f"listen must be a (host, port) pair such as ('127.0.0.1', 7070), not {listen!r}")
    pub = Primary(root, db_id, listen, sync_replicas)
    try:
        _install(pub)
    except BaseException:
        pub._server.close()
        raise
    pub.start()
    return pub


# -- the follower's side ---------------------------------------------------------------------------
# replica.state: two copies of STATE_COPY bytes, written alternately in place (the
# newer valid one wins), each ``ARMREPL2``, crc32 of what follows it, body length,
# counter, msgpack body.  Written in place without a sync of its own after the files
# it describes are synced: whichever copy survives a power loss names a position whose
# files were already on disk, and re-applying from an older one is harmless.
_STATE_MAGIC2 = b"ARMREPL2"
_STATE_COPY = 4096
_STATE_HEAD = struct.Struct("<8sIIQ")  # magic, crc32, body length, counter


def _state_copy(state: dict[str, Any], counter: int) -> bytes:
    body = msgpack.packb(state, use_bin_type=True)
    rest = struct.pack("<IQ", len(body), counter) + body
    return (_STATE_MAGIC2 + struct.pack("<I", zlib.crc32(rest)) + rest).ljust(_STATE_COPY, b"\0")


def _encode_state(state: dict[str, Any], counter: int = 0) -> bytes:
    """A whole state file: both copies the same."""
    one = _state_copy(state, counter)
    return one + one


def _decode_state_counted(raw: bytes, path: str) -> tuple[dict[str, Any], int]:
    """The newest valid copy of a state file, and its counter."""
    damaged = ReplicationError(f"{path} is damaged; delete the follower's directory and follow again "
                               "(it copies a snapshot)")
    if raw[:8] == _STATE_MAGIC:  # the first format: one copy, the body up to the end
        if len(raw) < 12 or struct.unpack_from("<I", raw, 8)[0] != zlib.crc32(raw[12:]):
            raise damaged
        best: tuple[Any, int] | None = (msgpack.unpackb(raw[12:], raw=False), -1)
    else:
        best = None
        for i in (0, 1):
            copy = raw[i * _STATE_COPY : (i + 1) * _STATE_COPY]
            if len(copy) < _STATE_HEAD.size or copy[:8] != _STATE_MAGIC2:
                continue
            _, crc, n, counter = _STATE_HEAD.unpack_from(copy)
            if n > _STATE_COPY - _STATE_HEAD.size or zlib.crc32(copy[12 : _STATE_HEAD.size + n]) != crc:
                continue
            if best is None or counter > best[1]:
                best = (msgpack.unpackb(copy[_STATE_HEAD.size : _STATE_HEAD.size + n], raw=False), counter)
    if best is None or not isinstance(best[0], dict):
        raise damaged
    return best[0], best[1]


def _decode_state(raw: bytes, path: str) -> dict[str, Any]:
    return _decode_state_counted(raw, path)[0]


def is_follower(path: str) -> bool:
    """Whether ``path`` is a follower's directory (it must be promoted before it opens)."""
    return _fs.FS.exists(os.path.join(path, STATE_FILE))


class Follower:
    """A directory that follows a primary (``Db.follow``); see docs/replication.md."""

    def __init__(self, path: str, primary: tuple[str, int], opener: Any) -> None:
        if not (isinstance(primary, tuple) and len(primary) == 2 and isinstance(primary[0], str)
                and isinstance(primary[1], int)):
            raise ConfigError(f"primary must be a (host, port) pair such as ('127.0.0.1', 7070), not {primary!r}")
        fs = _fs.FS
        self.path = os.path.abspath(path)
        self.primary = primary
        self._opener = opener
        self._state_path = os.path.join(self.path, STATE_FILE)
        self._root = self.path  # where frames are applied: the staging copy during a re-copy
        self._staging = self.path + ".resync"
        _finish_swap(self.path, self._staging)
        if fs.exists(self.path) and not fs.isdir(self.path):
            raise ConfigError(f"{self.path} exists and is not a directory; give a directory for the follower")
        if fs.isdir(self.path) and not fs.exists(self._state_path):
            left = [n for n in fs.listdir(self.path) if n != LOCK_FILE]
            if META_FILE in left:
                raise ReplicationError(
                    f"{self.path} is a database of its own, not a follower; follow into a new, empty directory"
                )
            if left:
                raise ConfigError(f"{self.path} is not empty and holds no follower; give a new, empty directory")
        fs.makedirs(self.path)
        self._dirlock: DirLock | None = DirLock(self.path)
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._touched: set[str] = set()
        self._dirs_touched: set[str] = set()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._end_seq: int | None = None  # a snapshot's end: consistent once applied
        self._new_state: dict[str, Any] = {}  # the staging copy's position during a re-copy
        self.primary_seq = 0
        self.last_error: BaseException | None = None
        self.connected = False
        self._behind_since: float | None = None
        self.frames_applied = 0
        self.refused_frames = 0  # frames refused (CRC, length, version, order): never applied
        self.connections = 0  # successful handshakes, the first included
        self.resync: dict[str, Any] = {}  # what the last copy (snapshot or delta) took
        self._ok_rels: set[str] = set()  # paths of stream frames already checked
        self._state_counter = 0  # of the newest copy in replica.state
        self._state_fd: int | None = None  # replica.state, open for writes in place
        self._delta_seen: set[str] = set()  # what the primary listed during a delta copy
        try:
            if fs.exists(self._state_path):
                self.state, self._state_counter = _decode_state_counted(fs.read_file(self._state_path),
                                                                        self._state_path)
                if self._state_counter < 0:
                    self._save_state()  # the first format: rewritten in the one written in place
            else:
                self.state = {"db_id": None, "stream": None, "seq": 0, "complete": False}
                self._save_state()
            self._connect()  # the first connection raises what it meets
        except BaseException:
            self._close_files()
            self._dirlock.release()
            self._dirlock = None
            raise
        self._thread = threading.Thread(target=self._run, name="armdb-follow", daemon=True)
        self._thread.start()

    # -- connection --
    def _connect(self) -> None:
        host, port = self.primary
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection(self.primary, timeout=DEAD_PEER_S)
        except OSError as e:
            raise ReplicationError(f"cannot connect to the primary at {where} ({e}); start it with db.replicate()") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # an ack goes at once
            st = self.state
            sock.sendall(encode_frame({"magic": MAGIC, "version": VERSION, "db_id": st["db_id"],
                                       "stream": st["stream"] if st["complete"] else None, "seq": st["seq"],
                                       "complete": bool(st["complete"])}))
            reader = _Reader(sock)
            try:
                reply = reader.frame()
            except ReplicationFrameError as e:
                raise ReplicationError(f"{where} does not answer as an armdb primary ({e})") from e
            except OSError as e:
                raise ReplicationError(f"{where} does not answer as an armdb primary ({e or type(e).__name__})") from e
            if not (isinstance(reply, dict) and reply.get("magic") == MAGIC):
                raise ReplicationError(f"{where} does not answer as an armdb primary")
            if reply.get("version") != VERSION or reply.get("error") == "version":
                raise ReplicationFrameError(
                    f"the primary at {where} speaks replication version {reply.get('version')!r}, this armdb "
                    f"speaks {VERSION}; run the same armdb version on both"
                )
            if st["db_id"] is not None and reply.get("db_id") != st["db_id"]:
                raise ReplicaMismatch(
                    f"the primary at {where} is another database than the one {self.path} follows; "
                    "point the follower at its own primary, or follow into a new directory"
                )
            if reply.get("mode") not in ("resume", "snapshot", "delta") or not isinstance(reply.get("seq"), int):
                raise ReplicationFrameError(f"the primary at {where} sent a hello this armdb cannot read")
        except BaseException:
            sock.close()
            raise
        self._mode = reply["mode"]
        self._stream_id = reply["stream"]
        self._db_id = reply["db_id"]
        self._expect = reply["seq"] + 1
        self._reader = reader
        self._sock = sock
        self.connected = True
        self.connections += 1
        self.last_error = None

    def _run(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                if self._sock is None:
                    self._connect()
                    delay = 0.05
                self._pump()
            except ReplicaMismatch as e:
                self.last_error = e
                LOG.error("replication: %s", e)
                self._drop()
                return
            except (OSError, ReplicationError) as e:
                if self._stop.is_set():
                    break
                if isinstance(e, ReplicationFrameError):
                    self.refused_frames += 1
                self.last_error = e
                LOG.warning("replication: the connection to the primary broke (%s); reconnecting", e)
                self._drop()
                self._stop.wait(delay)
                delay = min(2.0, delay * 2)
        self._drop()

    def _drop(self) -> None:
        self.connected = False
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _pump(self) -> None:
        """Read and apply frames until the connection ends or the follower stops."""
        sock, reader = self._sock, self._reader
        assert sock is not None
        sock.settimeout(DEAD_PEER_S)
        while not self._stop.is_set():
            if not reader.take_ready():  # frames left over from the hello go first
                reader.fill()
            with self._lock:
                if self._stop.is_set():
                    return
                applied = False
                # Apply what has arrived, and what arrives meanwhile, then sync once: under
                # load the follower's fsyncs are shared by many batches.
                end = time.monotonic() + DRAIN_S
                while True:
                    frame = reader.take()
                    if frame is _NONE:
                        if time.monotonic() >= end or not reader.fill_ready():
                            break
                        continue
                    applied |= self._frame(frame)
                if applied:
                    self._persist()

    def _frame(self, frame: Any) -> bool:
        """Apply one frame; whether it changed files.  A bad one raises before any change."""
        if not isinstance(frame, list) or not frame:
            raise ReplicationFrameError("a replication frame is not a list; it was not applied")
        head = frame[0]
        if head == "B":  # ["B", first_seq, [[op, args...], ...]]: a batch of the stream
            if len(frame) != 3 or not isinstance(frame[1], int) or not isinstance(frame[2], list) or not frame[2]:
                raise ReplicationFrameError("a replication batch frame this armdb cannot read; it was not applied")
            if frame[1] != self._expect:
                raise ReplicationFrameError(
                    f"replication frame {frame[1]} arrived where {self._expect} was next; it was not applied"
                )
            ops = frame[2]
            ok = self._ok_rels
            for op in ops:  # every operation checked before the first is applied
                if not (type(op) is list and len(op) >= 2 and op[0] in _OPS):
                    raise ReplicationFrameError(f"a replication batch holds the operation {str(op)[:40]}; "
                                                "it was not applied")
                rel = op[1]
                if type(rel) is not str or rel not in ok:
                    ok.add(_safe_rel(rel))
                if op[0] == "W" and not (len(op) == 4 and type(op[2]) is int and op[2] >= 0 and type(op[3]) is bytes):
                    raise ReplicationFrameError("a replication frame 'W' has arguments this armdb cannot read")
            fds, touched, pwrite = self._fds, self._touched, _fs.FS.pwrite
            for op in ops:
                if op[0] == "W":  # most of a stream: checked above
                    rel = op[1]
                    fd = fds.get(rel)
                    pwrite(fd if fd is not None else self._fd(rel), op[3], op[2])
                    touched.add(rel)
                else:
                    self._apply(op[0], op[1:])
            self._expect += len(ops)
            self._applying["seq"] = self._expect - 1
            self.frames_applied += len(ops)
            return True
        if isinstance(head, int):  # [seq, op, args...]
            if head != self._expect:
                raise ReplicationFrameError(
                    f"replication frame {head} arrived where {self._expect} was next; it was not applied"
                )
            if len(frame) < 2:
                raise ReplicationFrameError("a replication frame has no operation; it was not applied")
            self._apply(frame[1], frame[2:])
            self._expect += 1
            self._applying["seq"] = head
            self.frames_applied += 1
            return True
        if head == "H":
            if len(frame) >= 2 and isinstance(frame[1], int):
                self.primary_seq = frame[1]
            return False
        if head == "S":
            self._begin_snapshot()
            return True
        if head == "E":
            if len(frame) != 2 or not isinstance(frame[1], int):
                raise ReplicationFrameError("a snapshot end frame this armdb cannot read; it was not applied")
            if self._mode == "delta":
                self._drop_unlisted()
            self._end_seq = frame[1]
            return True
        copying = self._end_seq is None and self._applying.get("complete") is False
        if head == "M" and copying and self._mode == "delta":
            self._answer_manifest(frame)
            return False
        if copying and self._mode in ("snapshot", "delta"):
            if self._mode == "delta" and head == "D" and len(frame) == 2:
                self._delta_seen.add(_safe_rel(frame[1]))
            self._apply(head, frame[1:])  # a file image of the copy
            return True
        raise ReplicationFrameError(f"a replication frame of unknown kind {head!r}; it was not applied")

    def _begin_snapshot(self) -> None:
        """A new copy.  A follower that holds a complete copy keeps it (promotable, and
        what restarts resume from) and builds the new one beside it, in ``<path>.resync``,
        swapped in once consistent (:meth:`_swap`); a follower without one starts over."""
        if self._mode not in ("snapshot", "delta"):
            raise ReplicationFrameError("a snapshot arrived on a resumed stream; it was not applied")
        self._close_files()
        fs = _fs.FS
        new = {"db_id": self._db_id, "stream": self._stream_id, "seq": self._expect - 1, "complete": False}
        self.resync = {"mode": self._mode, "bytes": 0, "slots_behind": 0, "slots_stale": 0, "slots_diverged": 0,
                       "slots_missing": 0}
        if self._mode == "delta":
            # Only what differs comes: the new copy starts as a local copy of the complete one.
            if not self.state["complete"] or self.state["db_id"] != self._db_id:
                raise ReplicationFrameError("a delta copy arrived for a follower without a complete copy; "
                                            "it was not applied")
            if fs.exists(self._staging):
                fs.remove_tree(self._staging)
            _copy_tree(self.path, self._staging, sync=True)
            self._root = self._staging
            self._new_state = new
            self._delta_seen = set()
        elif self.state["complete"] or self._root != self.path:
            if fs.exists(self._staging):
                fs.remove_tree(self._staging)
            fs.makedirs(self._staging)
            self._root = self._staging
            self._new_state = new
        else:
            self.state = new
            self._save_state()
            for name in fs.listdir(self.path):
                if name in _NOT_REPLICATED:
                    continue
                full = os.path.join(self.path, name)
                if fs.isdir(full):
                    fs.remove_tree(full)
                else:
                    fs.unlink(full)
        self._end_seq = None

    def _answer_manifest(self, frame: list[Any]) -> None:
        """A primary's manifest of one file: ask for what differs from our copy (R5)."""
        try:
            _, rel, size, kind, unit, digest = frame
            rel = _safe_rel(rel)
            if (not isinstance(size, int) or size < 0 or kind not in ("slots", "blocks") or not isinstance(unit, int)
                    or unit < 8 or not isinstance(digest, bytes) or len(digest) % (8 if kind == "slots" else 16)):
                raise TypeError
        except (TypeError, ValueError) as e:
            raise ReplicationFrameError("a replication manifest frame this armdb cannot read; it was not applied") from e
        self._delta_seen.add(rel)
        self._forget(rel)
        ask = _ranges_to_ask(os.path.join(self._root, rel), size, kind, unit, digest, self.resync)
        self.resync["bytes"] += sum(ask[1::2])
        sock = self._sock
        assert sock is not None
        sock.sendall(encode_frame(["Q", rel, ask]))

    def _drop_unlisted(self) -> None:
        """The end of a delta copy's files: what the primary did not list is gone there."""
        fs = _fs.FS
        seen = self._delta_seen
        todo = [""]
        while todo:
            rel_d = todo.pop()
            for name in fs.listdir(os.path.join(self._root, rel_d) if rel_d else self._root):
                rel = os.path.join(rel_d, name) if rel_d else name
                if rel in seen or rel in _NOT_REPLICATED:
                    if rel in seen and fs.isdir(os.path.join(self._root, rel)):
                        todo.append(rel)
                    continue
                if fs.isdir(os.path.join(self._root, rel)):
                    for fd_rel in [r for r in self._fds if r.startswith(rel + os.sep)]:
                        self._forget(fd_rel)
                    fs.remove_tree(os.path.join(self._root, rel))
                else:
                    self._forget(rel)
                    fs.unlink(os.path.join(self._root, rel))
                self._dirs_touched.add(rel_d)

    @property
    def _applying(self) -> dict[str, Any]:
        """The position of the copy frames go to (the staging copy's during a re-copy)."""
        return self._new_state if self._root != self.path else self.state

    def _swap(self) -> None:
        """The re-copy is consistent: it replaces the follower's copy.  A crash at any
        point leaves either copy whole (:func:`_finish_swap` completes or undoes it)."""
        fs = _fs.FS
        self._close_files()
        fs.write_file_atomic(os.path.join(self._staging, STATE_FILE), _encode_state(self._new_state))
        old = self.path + ".old"
        if fs.exists(old):
            fs.remove_tree(old)
        assert self._dirlock is not None
        fs.rename(self.path, old)
        fs.rename(self._staging, self.path)
        fs.fsync_dir(os.path.dirname(self.path))
        lock = self._dirlock
        self._dirlock = DirLock(self.path)
        lock.release()
        fs.remove_tree(old)
        self.state = self._new_state
        self._root = self.path

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is None:
            fd = _fs.FS.open(os.path.join(self._root, rel), os.O_RDWR | os.O_CREAT)
            self._fds[rel] = fd
        return fd

    def _forget(self, rel: str) -> None:
        fd = self._fds.pop(rel, None)
        if fd is not None:
            try:
                if rel in self._touched:  # what was written to it is durable before the position says so
                    _fs.FS.fsync(fd)
            finally:
                _fs.FS.close(fd)
        self._touched.discard(rel)

    def _apply(self, op: Any, args: list[Any]) -> None:
        """One operation, checked whole before anything is written."""
        fs = _fs.FS
        try:
            if op == "W":
                rel, off, data = _safe_rel(args[0]), int(args[1]), args[2]
                if not isinstance(data, bytes) or off < 0:
                    raise TypeError
                fs.pwrite(self._fd(rel), data, off)
                self._touched.add(rel)
            elif op == "T":
                rel, size = _safe_rel(args[0]), int(args[1])
                fs.ftruncate(self._fd(rel), size)
                self._touched.add(rel)
            elif op == "A":
                rel, off, length = _safe_rel(args[0]), int(args[1]), int(args[2])
                fs.fallocate(self._fd(rel), off, length)
                self._touched.add(rel)
            elif op == "C":
                rel, trunc = _safe_rel(args[0]), bool(args[1])
                self._forget(rel)
                flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0)
                self._fds[rel] = fs.open(os.path.join(self._root, rel), flags)
                self._touched.add(rel)
                self._dirs_touched.add(os.path.dirname(rel))
            elif op == "R":
                src, dst = _safe_rel(args[0]), _safe_rel(args[1])
                self._forget(src)
                self._forget(dst)
                if fs.exists(os.path.join(self._root, src)):  # replayed after a restart: done already
                    fs.rename(os.path.join(self._root, src), os.path.join(self._root, dst))
                self._dirs_touched.add(os.path.dirname(dst))
            elif op == "U":
                rel = _safe_rel(args[0])
                self._forget(rel)
                with contextlib.suppress(FileNotFoundError):
                    fs.unlink(os.path.join(self._root, rel))
                self._dirs_touched.add(os.path.dirname(rel))
            elif op == "D":
                rel = _safe_rel(args[0])
                fs.makedirs(os.path.join(self._root, rel))
            else:
                raise ReplicationFrameError(f"a replication frame of unknown operation {op!r}; it was not applied")
        except (IndexError, TypeError, ValueError) as e:
            raise ReplicationFrameError(f"a replication frame {op!r} has arguments this armdb cannot read") from e

    def _persist(self) -> None:
        """Make the applied frames durable, then the position that says so."""
        fs = _fs.FS
        for rel in sorted(self._touched):
            fd = self._fds.get(rel)
            if fd is not None:
                fs.fdatasync(fd)  # data and size; the directories are synced below
        self._touched.clear()
        for d in sorted(self._dirs_touched):
            full = os.path.join(self._root, d) if d else self._root
            if fs.isdir(full):
                fs.fsync_dir(full)
        self._dirs_touched.clear()
        in_place = True
        if self._end_seq is not None and self._applying["seq"] >= self._end_seq:
            self._applying["complete"] = True
            self._end_seq = None
            in_place = False  # a copy became complete: its state is synced
            if self._root != self.path:
                self._swap()
        if self._root == self.path:
            self._save_state(sync=not in_place)
            sock = self._sock
            if sock is not None and self.state["complete"]:
                with contextlib.suppress(OSError):  # a broken link shows in the next read
                    sock.sendall(encode_frame(["A", self.state["seq"]]))  # on disk: the primary may count it

    def _save_state(self, *, sync: bool = True) -> None:
        """Write the position: ``sync`` replaces the file atomically and durably, else
        the older of its two copies is overwritten in place (see ``_STATE_COPY``)."""
        fs = _fs.FS
        self._state_counter += 1
        if sync:
            self._close_state()
            fs.write_file_atomic(self._state_path, _encode_state(self.state, self._state_counter))
            return
        if self._state_fd is None:
            self._state_fd = fs.open(self._state_path, os.O_RDWR)
        fs.pwrite(self._state_fd, _state_copy(self.state, self._state_counter),
                  (self._state_counter % 2) * _STATE_COPY)

    def _close_state(self) -> None:
        fd, self._state_fd = self._state_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                _fs.FS.close(fd)

    def _close_files(self) -> None:
        self._close_state()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                _fs.FS.close(fd)
        self._fds.clear()
        self._touched.clear()

    # -- public --
    def status(self) -> dict[str, Any]:
        """Where the follower is: ``connected``, ``applied_seq``, ``primary_seq`` (from the
        primary's last heartbeat), ``frames_behind``, ``seconds_behind`` (0 when caught
        up), ``snapshot_complete``, ``recopying`` (a new copy is being built beside the
        complete one), ``last_error``, ``connections`` (handshakes so far),
        ``refused_frames`` (damaged or out-of-order frames, never applied) and
        ``last_copy`` (what the last copy took: ``mode`` ``snapshot`` or ``delta``,
        ``bytes`` asked for, and for slots ``slots_behind``, ``slots_stale``,
        ``slots_diverged``, ``slots_missing``; docs/replication.md)."""
        applied = int(self.state["seq"])
        behind = max(0, self.primary_seq - applied)
        now = time.monotonic()
        if behind == 0:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = now
        return {
            "connected": self.connected,
            "applied_seq": applied,
            "primary_seq": self.primary_seq,
            "frames_behind": behind,
            "seconds_behind": 0.0 if self._behind_since is None else now - self._behind_since,
            "snapshot_complete": bool(self.state["complete"]),
            "recopying": self._root != self.path,
            "last_error": None if self.last_error is None else str(self.last_error),
            "connections": self.connections,
            "refused_frames": self.refused_frames,
            "last_copy": dict(self.resync),
        }

    def wait_applied(self, seq: int, timeout: float = 10.0) -> bool:
        """Wait until frame ``seq`` of the current stream is applied to a complete copy;
        ``False`` on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.state
            if (self._root == self.path and st["complete"] and st["stream"] == self._stream_id
                    and st["seq"] >= seq):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop following; the directory stays a follower (follow it again to resume)."""
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not threading.current_thread():
            self._thread.join(10.0)
        with self._lock:
            if self._dirlock is None:
                return
            try:
                if self._touched or self._dirs_touched:
                    self._persist()
            finally:
                self._close_files()
                if self._root != self.path:  # an unfinished re-copy: the complete copy stays
                    _fs.FS.remove_tree(self._staging)
                    self._root = self.path
                self._dirlock.release()
                self._dirlock = None

    def promote(self, **open_kwargs: Any) -> Any:
        """Stop following and open the directory as a writable database (R3).

        Raises
        ------
        ReplicationError
            The first copy of the primary's files is not complete: there is nothing
            consistent to open yet.
        """
        self.close()
        if not self.state["complete"]:
            raise ReplicationError(
                f"{self.path} has not finished copying the primary's files, so it holds no consistent "
                "database; follow until status()['snapshot_complete'] is True"
            )
        fs = _fs.FS
        fs.unlink(self._state_path)
        fs.fsync_dir(self.path)
        return self._opener(self.path, **open_kwargs)

    def copy_to(self, dest: str | os.PathLike[str]) -> None:
        """Copy the follower's files, at a frame boundary, into ``dest`` (a new directory)
        and recover them there: ``dest`` is then a normal, closed database (a backup,
        or a place for ``armdb.check``) while the follower goes on following.

        Raises
        ------
        ReplicationError
            The first copy of the primary's files is not complete yet.
        ConfigError
            ``dest`` exists.
        """
        dest = os.path.abspath(os.fspath(dest))
        fs = _fs.FS
        if fs.exists(dest):
            raise ConfigError(f"{dest} exists; copy_to() makes a new directory")
        with self._lock:  # no frame is half applied while the files are read
            if not self.state["complete"]:
                raise ReplicationError(
                    f"{self.path} has not finished copying the primary's files; "
                    "wait until status()['snapshot_complete'] is True"
                )
            _copy_tree(self.path, dest)
        self._opener(dest).close()  # the copy is a crash image: recover it once

    @contextlib.contextmanager
    def reader(self, **open_kwargs: Any) -> Iterator[ReadOnlyDb]:
        """A read-only database of the follower's contents now (R2): ``stats``, queues'
        ``peek``, ``snapshot``, ``len``, maps' ``get`` and ``items`` work, every write
        raises ``ReadOnly``.  It reads a private copy (:meth:`copy_to`), deleted at the
        end of the block; the follower goes on following meanwhile."""
        tmp = tempfile.mkdtemp(prefix="armdb-follower-")
        try:
            dest = os.path.join(tmp, "db")
            self.copy_to(dest)
            db = self._opener(dest, **open_kwargs)
            try:
                yield ReadOnlyDb(db, self.path)
            finally:
                db.close()
        finally:
            _fs.FS.remove_tree(tmp)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finish_swap(path: str, staging: str) -> None:
    """Complete or undo a swap of a re-copy that a crash interrupted (``Follower._swap``):
    the staging copy replaces the follower's only once it holds a complete state."""
    fs = _fs.FS
    old = path + ".old"
    if not fs.exists(path):
        done = os.path.join(staging, STATE_FILE)
        if fs.exists(done) and _decode_state(fs.read_file(done), done).get("complete"):
            fs.rename(staging, path)
        elif fs.exists(old):
            fs.rename(old, path)
    for leftover in (staging, old):
        if fs.exists(leftover) and fs.exists(path):
            fs.remove_tree(leftover)


def _copy_tree(src: str, dest: str, *, sync: bool = False) -> None:
    """Copy a database directory (holes of sparse files kept), without its lock and
    state; ``sync`` fsyncs every file and directory it makes."""
    fs = _fs.FS
    fs.makedirs(dest)
    for name in fs.listdir(src):
        if name in _NOT_REPLICATED:
            continue
        s, d = os.path.join(src, name), os.path.join(dest, name)
        if fs.isdir(s):
            _copy_tree(s, d, sync=sync)
            continue
        rfd = fs.open(s, os.O_RDONLY)
        try:
            wfd = fs.open(d, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                size = fs.size(rfd)
                fs.ftruncate(wfd, size)
                for lo, hi in fs.data_extents(rfd, 0, size):
                    pos = lo
                    while pos < hi:
                        data = fs.pread(rfd, min(CHUNK, hi - pos), pos)
                        if not data:
                            break
                        fs.pwrite(wfd, data, pos)
                        pos += len(data)
                if sync:
                    fs.fsync(wfd)
            finally:
                fs.close(wfd)
        finally:
            fs.close(rfd)
    if sync:
        fs.fsync_dir(dest)


# -- the read-only view of a follower (R2) ---------------------------------------------------------
def _refuse(what: str, where: str) -> ReadOnly:
    return ReadOnly(f"{what} writes, and this is a read-only view of the follower {where}; "
                    "write to the primary, or promote the follower first")


class _ReadOnlyHandle:
    """A collection handle that forwards only the calls in ``READS``."""

    READS: frozenset[str] = frozenset()

    def __init__(self, inner: Any, where: str) -> None:
        self._inner = inner
        self._where = where

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.READS:
            return getattr(self._inner, name)
        raise _refuse(f"{type(self._inner).__name__}.{name}", self._where)

    def __len__(self) -> int:
        return len(self._inner)

    def __repr__(self) -> str:
        return f"<read-only {self._inner!r}>"


class ReadOnlyQueue(_ReadOnlyHandle):
    """A queue of a follower: inspection only."""

    READS = frozenset({"name", "config", "len", "dead_len", "peek", "snapshot", "snapshot_frame", "stats",
                       "next_delay"})


class ReadOnlyMap(_ReadOnlyHandle):
    """A map of a follower: ``get``, ``in``, ``len``, ``items`` only."""

    READS = frozenset({"name", "get", "items", "keys", "values", "stats", "__contains__"})

    def __contains__(self, key: object) -> bool:
        return key in self._inner


class ReadOnlyDb:
    """What :meth:`Follower.reader` yields: a database whose every write raises ``ReadOnly``."""

    def __init__(self, db: Any, where: str) -> None:
        self._db = db
        self._where = where

    def _exists(self, name: str) -> None:
        if not _fs.FS.isdir(self._db.collection_dir(name)):
            raise _refuse(f"opening {name!r}, which the primary does not have,", self._where)

    def open_queue(self, spec: Any, config: Any = None) -> ReadOnlyQueue:
        self._exists(spec.name)
        return ReadOnlyQueue(self._db.open_queue(spec, config), self._where)

    def open_map(self, name: str, config: Any = None) -> ReadOnlyMap:
        self._exists(name)
        return ReadOnlyMap(self._db.open_map(name, config), self._where)

    def stats(self) -> dict[str, Any]:
        return dict(self._db.stats())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise _refuse(f"Db.{name}", self._where)
