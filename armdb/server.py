"""The owner serves other processes of the same user over a Unix socket (SPEC P1, P3, P5).

``db.serve(path=None)`` starts a :class:`Server`: a listening Unix stream socket, by default
``DIR/armdb.sock``, mode 0600, and a peer-uid check (``SO_PEERCRED``) on every connection.
The server is a thin dispatcher: it decodes a frame (armdb.wire), calls the very ``Queue``,
``Map`` and ``db.tx()`` objects the owner uses, and encodes the result or the error's class
and message.  No queue rule lives here; :data:`OPS`, the operation table, maps each
operation name to a handler, so adding an operation is one entry.

Threads: one accept thread; one reader thread per connection, which runs each request in
arrival order and writes its reply; an operation that blocks (a wait for a due row) runs on
a thread of its own, so it holds back no other request of its connection.  The requests
one ``recv`` brings (a client's pipelined batch) are run in order and their replies sent
with one ``send``.

Tokens are bound to their connection (P3): each connection keeps the set of tokens its
leases returned, and a settle, extend or transaction step with a token not in that set
raises ``StaleToken``.  The set stays bounded on a long-lived connection: a token the queue
refuses as stale is dropped when it is used, and when the set passes twice its size after the
last prune (at least ``PRUNE_MIN``) every token is checked against its queue
(``Queue._holds``: a lookup, nothing written) and the stale ones (expired and leased again,
settled through a transaction that failed, a closed queue) are dropped; the set is then at
most about twice the leases the connection really holds, and the checks cost O(1) per
lease on average.  When a connection closes (the client closed it, its process died,
or it broke the protocol), every lease it still holds is given back at once, as if it had
expired: ``Queue.extend`` to a deadline 1 ms from now, so the next lease applies the
expiry rule of armdb.transitions (attempt counted, dead-lettered at ``max_attempts``).

Lock policy: ``Server._lock`` guards the table of connections and the closed flag;
``_Conn.wlock`` serialises the replies written to one socket; ``_Conn.lock`` guards its
token set.  None is held while calling into the database.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import socket
import struct
import sys
import threading
import typing
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _fs, wire
from ._version import __version__
from .errors import (
    ArmdbError,
    ConfigError,
    DbClosed,
    QueueAlreadyOpen,
    SchemaMismatch,
    StaleToken,
)
from .qspec import QueueSpec, VarCodec, layout_from_fingerprint, queue
from .queue import LeaseBatch, LeaseToken, Queue
from .wire import BadFrame

if TYPE_CHECKING:
    from .db import Db
    from .maps import Map

log = logging.getLogger("armdb")

HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection may take to say hello
MAX_CONNECTIONS = 1024
MAX_WAITS = 64  # blocking waits one connection may have running at once
RELEASE_MS = 1  # a released lease expires this many ms after its connection closed
PRUNE_MIN = 4096  # a connection's token set is pruned when it passes max(this, 2 x its size after the last prune)


_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child must not keep the owner's sockets open: a client would then see no
    # end of its connection when the owner dies.  Closing a descriptor in the child
    # leaves the parent's untouched (no shutdown is sent).
    for srv in list(_SERVERS):
        srv._closed = True
        for s in [srv._sock, *(c.sock for c in srv._conns)]:
            try:
                s.close()
            except OSError:
                pass
    _SERVERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Server:
    """Serves one open ``Db`` over a Unix socket.  Made by :meth:`armdb.Db.serve`."""

    def __init__(self, db: Db, path: str | None = None) -> None:
        self.db = db
        self.path = os.path.abspath(path) if path is not None else os.path.join(db.path, wire.SOCKET_NAME)
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._closed = False
        self._uid = os.getuid()
        # A socket file left by a crashed owner is replaced: the directory lock, which the
        # caller holds, says no other owner serves this database.  A path outside the
        # directory is refused if something answers there.
        if _fs.FS.exists(self.path):
            if path is not None and _answers(self.path):
                raise ConfigError(f"another process serves {self.path}; choose another socket path")
            _fs.FS.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # the socket file is created 0600, never wider for a moment
            try:
                sock.bind(self.path)
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
            sock.listen(socket.SOMAXCONN)
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot serve on {self.path}: {e.strerror or e}; check the path and permissions") from e
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="armdb-serve", daemon=True)
        self._thread.start()
        _SERVERS.add(self)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def connections(self) -> int:
        """How many clients are connected now."""
        with self._lock:
            return len(self._conns)

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, let the calls in flight finish (up to ``timeout`` s), close
        every connection (releasing its leases) and remove the socket file.  A second
        call is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for c in conns:
            c.stop_reading()
        for c in conns:
            if c.reader is not threading.current_thread():
                c.reader.join(timeout)
            c.close()
        try:
            st = os.lstat(self.path)
            if st.st_uid == self._uid:
                _fs.FS.unlink(self.path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # the listening socket was closed
            try:
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                pid, uid, _gid = struct.unpack("3i", creds)
            except OSError:
                sock.close()
                continue
            if uid != self._uid:
                log.warning("armdb server %s: refused a connection from uid %d (process %d): only uid %d is served",
                            self.path, uid, pid, self._uid)
                sock.close()
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    log.warning("armdb server %s: refused a connection from process %d: %d connections are open",
                                self.path, pid, MAX_CONNECTIONS)
                    sock.close()
                    continue
                conn = _Conn(self, sock, pid)
                self._conns.add(conn)
            conn.reader.start()

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)


def _answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


# -- one connection ------------------------------------------------------------------------


class _Conn:
    def __init__(self, server: Server, sock: socket.socket, pid: int) -> None:
        self.server = server
        self.db = server.db
        self.sock = sock
        self.pid = pid
        self.wlock = threading.Lock()
        self.lock = threading.Lock()
        # This connection's leases, by queue handle: the queue, and by row id the lease's
        # (shard, due, epoch).  A row is leased by one holder at a time and its epoch is
        # bumped by every lease, so (handle, id, epoch) names one lease; shard and due are
        # kept to compare a token whole and to release the lease at close.
        self.held: dict[int, tuple[Queue[Any], dict[int, tuple[int, int, int]]]] = {}
        self.prune_at = PRUNE_MIN  # prune ``held`` when it grows past this many leases
        self.queues: dict[str, _QueueRef] = {}
        self.maps: dict[str, Map] = {}
        self.waits = 0
        self.closed = False
        self._inbox: list[Any] = []  # requests read with the handshake, not yet run
        self.frames = wire.FrameReader(sock)
        self.reader = threading.Thread(target=self._run, name=f"armdb-conn-{pid}", daemon=True)

    # -- io -------------------------------------------------------------------------------
    def _read_frame(self) -> Any:
        """The next request (for the handshake: nothing is pipelined before it)."""
        while not self._inbox:
            got = self.frames.read()
            if got is None:
                return _EOF
            self._inbox.extend(got)
        return self._inbox.pop(0)

    def send(self, obj: Any) -> None:
        self.send_raw(self.encode(obj))

    @staticmethod
    def encode(obj: Any) -> bytes:
        """A reply as a frame; a result over the frame limit (or one msgpack refuses)
        becomes an error reply."""
        try:
            return wire.frame(obj)
        except Exception as e:  # noqa: BLE001 - a reply over the frame limit, or a value msgpack refuses
            if not (isinstance(obj, list) and len(obj) == 3 and obj[1] == wire.OK):
                raise
            err = e if isinstance(e, ArmdbError) else ArmdbError(
                f"the reply cannot be sent ({type(e).__name__}: {e}); ask for less at once")
            return wire.frame([obj[0], wire.ERR, wire.error_to_wire(err)])

    def send_raw(self, data: bytes) -> None:
        with self.wlock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                pass  # the client has gone; the reader sees it and closes

    def stop_reading(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.sock.settimeout(HANDSHAKE_TIMEOUT)
            self._handshake()
            self.sock.settimeout(None)
            # Every request that one recv brought is run in order and their replies go
            # out in one send: a client's pipelined batch costs one system call each way.
            out: list[bytes] = []
            reqs: list[Any] = self._inbox
            self._inbox = []
            while True:
                try:
                    for req in reqs:
                        self._request(req, out)
                finally:
                    if out:
                        self.send_raw(out[0] if len(out) == 1 else b"".join(out))
                        out.clear()
                got = self.frames.read()
                if got is None:
                    return
                reqs = got
        except BadFrame as e:
            log.warning("armdb server %s: closed the connection of process %d: %s", self.server.path, self.pid, e)
        except TimeoutError:
            log.warning("armdb server %s: closed the connection of process %d: no handshake within %.0f s",
                        self.server.path, self.pid, HANDSHAKE_TIMEOUT)
        except OSError:
            pass  # reset by the peer
        except Exception:  # a bug here must not take the server down
            log.exception("armdb server %s: the connection of process %d failed", self.server.path, self.pid)
        finally:
            self.close()

    def _handshake(self) -> None:
        hello = self._read_frame()
        if hello is _EOF:
            raise OSError("closed before the handshake")
        if not isinstance(hello, dict) or hello.get("armdb") != wire.MAGIC:
            raise BadFrame("the first frame is not an armdb handshake")
        versions = hello.get("versions")
        if not isinstance(versions, list) or wire.VERSION not in versions:
            self.send({"armdb": wire.MAGIC, "error": f"this server speaks protocol version {wire.VERSION} only; "
                       f"use the same armdb version ({__version__}) on both sides"})
            raise BadFrame(f"the client offers protocol versions {versions!r}, not {wire.VERSION}")
        self.send({"armdb": wire.MAGIC, "version": wire.VERSION, "pid": os.getpid(), "server": __version__})

    def _request(self, req: Any, out: list[bytes]) -> None:
        if not (isinstance(req, list) and len(req) == 3 and type(req[0]) is int and isinstance(req[1], str)
                and isinstance(req[2], dict)):
            raise BadFrame("a request must be [id, op, args]")
        rid, name, args = req
        op = OPS.get(name)
        if op is None:
            raise BadFrame(f"unknown operation {name!r}")
        args = op.check(args)
        if op.blocking:
            with self.lock:
                if self.waits >= MAX_WAITS:
                    raise BadFrame(f"more than {MAX_WAITS} waits at once on one connection")
                self.waits += 1
            threading.Thread(target=self._call_blocking, args=(rid, op, args), daemon=True,
                             name=f"armdb-wait-{self.pid}").start()
            return
        out.append(self._call(rid, op, args))

    def _call(self, rid: int, op: _Op, args: dict[str, Any]) -> bytes:
        """Run one request; its reply frame."""
        try:
            result = op.handler(self, **args)
        except BadFrame:
            raise
        except ArmdbError as e:
            return self.encode([rid, wire.ERR, wire.error_to_wire(e)])
        except Exception as e:  # a bug: tell the client, log it, keep serving
            log.exception("armdb server %s: operation %s failed", self.server.path, op.name)
            return self.encode([rid, wire.ERR, wire.error_to_wire(e)])
        return self.encode([rid, wire.OK, result])

    def _call_blocking(self, rid: int, op: _Op, args: dict[str, Any]) -> None:
        try:
            self.send_raw(self._call(rid, op, args))
        except BadFrame as e:
            log.warning("armdb server %s: closed the connection of process %d: %s", self.server.path, self.pid, e)
            self.stop_reading()
        finally:
            with self.lock:
                self.waits -= 1

    def close(self) -> None:
        """Release every lease this connection holds (as if expired) and close it."""
        with self.wlock:
            if self.closed:
                return
            self.closed = True
        with self.lock:
            held, self.held = self.held, {}
        touched: set[int] = set()
        for token, q in _held_tokens(held):
            try:
                q.extend(token, by=timedelta(milliseconds=RELEASE_MS))
                touched.add(id(q))
            except (StaleToken, DbClosed):
                pass  # settled, or expired and taken by someone else; or the Db is closing
            except ArmdbError as e:
                log.warning("armdb server %s: could not release row %d of queue %s: %s",
                            self.server.path, token.seq, q.name, e)
        for ref in self.queues.values():
            if id(ref.q) in touched:
                ref.q._notify()  # wake waiters: the released rows are due in a millisecond
        try:
            self.sock.close()
        except OSError:
            pass
        self.server._forget(self)

    # -- helpers for the handlers -----------------------------------------------------------
    def queue(self, name: str) -> _QueueRef:
        ref = self.queues.get(name)
        if ref is None:
            raise BadFrame(f"queue {name!r} was not opened on this connection")
        return ref

    def token(self, raw: Any, ref: _QueueRef) -> LeaseToken:
        """A token of a request, checked to be held by this connection for ``ref``'s queue."""
        tok = tuple.__new__(LeaseToken, wire.token_fields(raw))
        with self.lock:
            ent = self.held.get(tok[0])
            ok = ent is not None and ent[0] is ref.q and ent[1].get(tok[3]) == (tok[1], tok[2], tok[4])
        if not ok:
            raise StaleToken(
                f"row {tok.seq}: this token is not held by this connection (issued to another client, or "
                f"already acked or nacked); lease the row again through this client"
            )
        return tok

    def _leases_of(self, handle: int, q: Queue[Any]) -> dict[int, tuple[int, int, int]]:
        """The leases of ``handle`` (``self.lock`` held)."""
        ent = self.held.get(handle)
        if ent is None:
            ent = self.held[handle] = (q, {})
        return ent[1]

    def remember(self, tokens: Iterable[LeaseToken], q: Queue[Any]) -> None:
        """Add leases' tokens to this connection's set, pruning it when it has grown."""
        with self.lock:
            for t in tokens:
                self._leases_of(t[0], q)[t[3]] = (t[1], t[2], t[4])
            grown = self._count() > self.prune_at
        if grown:
            self.prune()

    def remember_batch(self, handle: int, q: Queue[Any], shards: list[int], dues: list[int], ids: list[int],
                       epochs: list[int]) -> None:
        """:meth:`remember` for a batch's leases, given as lists of their fields."""
        with self.lock:
            m = self._leases_of(handle, q)
            m.update(zip(ids, zip(shards, dues, epochs)))
            grown = len(m) > self.prune_at and self._count() > self.prune_at
        if grown:
            self.prune()

    def check_batch(self, handle: int, q: Queue[Any], shards: list[int], dues: list[int], ids: list[int],
                    epochs: list[int], done: str) -> None:
        """Raise ``StaleToken`` unless this connection holds every lease of a token batch."""
        with self.lock:
            ent = self.held.get(handle)
            if ent is not None and ent[0] is q:
                m = ent[1]
                if all(map(operator.eq, map(m.get, ids), zip(shards, dues, epochs))):
                    return
                bad = next(i for i, s, d, e in zip(ids, shards, dues, epochs) if m.get(i) != (s, d, e))
            elif not ids:
                return
            else:
                bad = ids[0]
        raise StaleToken(
            f"row {bad}: this token is not held by this connection (issued to another client, or "
            f"already acked or nacked); lease the row again through this client; nothing was {done}"
        )

    def _count(self) -> int:
        """How many leases the set holds (``self.lock`` held)."""
        return sum(len(m) for _q, m in self.held.values())

    def prune(self) -> int:
        """Drop the tokens whose lease is gone (checked against the queue, no lock of this
        connection held meanwhile); return how many were dropped."""
        with self.lock:
            items = list(_held_tokens(self.held))
        stale = []
        for t, q in items:
            try:
                if not q._holds(t):
                    stale.append(t)
            except DbClosed:
                stale.append(t)
        self.drop(stale)
        with self.lock:
            self.prune_at = max(PRUNE_MIN, 2 * self._count())
        return len(stale)

    def drop(self, tokens: Iterable[LeaseToken]) -> None:
        """Forget settled leases (each only if it is the lease this connection holds for its row)."""
        with self.lock:
            for t in tokens:
                ent = self.held.get(t[0])
                if ent is not None and ent[1].get(t[3]) == (t[1], t[2], t[4]):
                    del ent[1][t[3]]

    def drop_batch(self, handle: int, ids: list[int]) -> None:
        """Forget the leases of a token batch that :meth:`check_batch` passed: a
        connection's requests run one after another, so none was leased again between."""
        with self.lock:
            ent = self.held.get(handle)
            if ent is not None:
                pop = ent[1].pop
                for i in ids:
                    pop(i, None)

    def map(self, name: str) -> Map:
        m = self.maps.get(name)
        if m is None:
            raise BadFrame(f"map {name!r} was not opened on this connection")
        return m


_EOF = object()
_EPOCH_DT = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass
class _QueueRef:
    """A queue as one connection uses it: the owner's handle and how payloads cross."""

    q: Queue[Any]
    var: bool
    dtype: np.dtype | None

    def payload_in(self, raw: Any) -> Any:
        """A client's encoded payload as the object ``Queue.push`` takes."""
        if not isinstance(raw, bytes):
            raise BadFrame("a payload must be bytes")
        if self.var:
            # The plain decode (no layout tag): the client encodes with its own class,
            # whose fingerprint is the queue's.
            return VarCodec.decode(typing.cast(VarCodec, self.q._codec), raw)
        assert self.dtype is not None
        if len(raw) != self.dtype.itemsize:
            raise BadFrame(f"a payload of queue {self.q.name!r} must be {self.dtype.itemsize} bytes")
        return np.frombuffer(raw, dtype=self.dtype)[0]

    def payload_out(self, payload: Any) -> bytes:
        if self.var:
            return wire.pack(self.plain_out(payload))
        return payload.tobytes()  # type: ignore[no-any-return]

    def plain_out(self, payload: Any) -> Any:
        """A var payload as the msgpack value its body holds (a dataclass: its fields),
        sent inside the reply: the reply is packed once, not each payload."""
        codec = typing.cast(VarCodec, self.q._codec)
        if codec.is_dataclass:
            return [getattr(payload, f) for f in codec.fields]
        return payload


# -- the operation table ---------------------------------------------------------------------

_INT = (int,)
_NUM = (int, float)


@dataclass
class _Op:
    name: str
    handler: Callable[..., Any]
    args: dict[str, tuple[tuple[type, ...], bool]]  # name -> (types, required)
    blocking: bool = False

    def check(self, args: dict[Any, Any]) -> dict[str, Any]:
        for k, v in args.items():
            spec = self.args.get(k) if isinstance(k, str) else None
            if spec is None:
                raise BadFrame(f"operation {self.name!r} takes no argument {k!r}")
            types, _required = spec
            if v is None and type(None) in types:
                continue
            if type(v) is bool and bool not in types:
                raise BadFrame(f"argument {k!r} of {self.name!r} must not be a bool")
            if not isinstance(v, types):
                raise BadFrame(f"argument {k!r} of {self.name!r} has the wrong type {type(v).__name__}")
        for k, (_types, required) in self.args.items():
            if required and k not in args:
                raise BadFrame(f"operation {self.name!r} needs argument {k!r}")
        return typing.cast(dict[str, Any], args)


OPS: dict[str, _Op] = {}
_NONE = type(None)


def op(name: str, /, *, blocking: bool = False, **args: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``handler(conn, **args)`` as operation ``name``.  Each keyword names an
    argument: a type or tuple of types (required), or ``(types, False)`` (optional)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec: dict[str, tuple[tuple[type, ...], bool]] = {}
        for k, v in args.items():
            if isinstance(v, list):
                types, req = tuple(v[0]) if isinstance(v[0], tuple) else (v[0],), bool(v[1])
            else:
                types, req = (v if isinstance(v, tuple) else (v,)), True
            spec[k] = (types, req)
        OPS[name] = _Op(name, fn, spec, blocking)
        return fn

    return deco


def _opt(*types: type) -> list[Any]:
    return [(*types, _NONE), False]


def _secs(ms_or_s: Any) -> float | None:
    return None if ms_or_s is None else float(ms_or_s)


# queues ------------------------------------------------------------------------------------


@op("open_queue", name=str, var=bool, fingerprint=str, dtype=_opt(str, list), config=_opt(dict))
def _open_queue(conn: _Conn, name: str, var: bool, fingerprint: str, dtype: Any = None,
                config: dict[str, Any] | None = None) -> dict[str, Any]:
    db = conn.db
    cfg = wire.config_from_wire(config) if config is not None else None
    with db._lock:  # the owner's table of open queues (Db.open_queue fills it)
        q = db._queues.get(name)
    if q is None:
        spec = _surrogate_spec(name, var, fingerprint, dtype)
        try:
            q = db.open_queue(spec, cfg)
        except QueueAlreadyOpen:
            with db._lock:
                q = db._queues[name]  # another connection opened it meanwhile
    if q.spec.var != var or q.spec.fingerprint != fingerprint:
        raise SchemaMismatch(
            f"queue {name!r} is open in the owner with payload schema {q.spec.fingerprint}; this client declares "
            f"{fingerprint}: declare the same payload type on both sides"
        )
    if cfg is not None and cfg != q.config:
        raise ConfigError(
            f"queue {name!r} is open in the owner with another config ({q.config}); pass the owner's "
            f"config or none (config=None takes the owner's)"
        )
    conn.queues[name] = _QueueRef(q, q.spec.var, None if q.spec.var else q.spec.dtype)
    return {"config": wire.config_to_wire(q.config)}


def _surrogate_spec(name: str, var: bool, fingerprint: str, dtype: Any) -> QueueSpec[Any]:
    """The spec the server opens a queue with for a client, without the client's payload
    class: the dtype for a fixed queue; for a var queue a stand-in with the fields the
    fingerprint lists (a dataclass) or any msgpack value, under the client's fingerprint."""
    if not var:
        if dtype is None:
            raise BadFrame("a fixed queue needs its dtype")
        spec: QueueSpec[Any] = queue(name, payload=wire.dtype_from_wire(dtype))  # checks the dtype
        if spec.fingerprint != fingerprint:
            raise BadFrame("the dtype does not match the fingerprint")
        return spec
    layout = layout_from_fingerprint(fingerprint)
    if layout is not None:
        fields = [(fname, type(tp, (), {})) for fname, tp in layout]  # stand-ins named as the types
        cls = dataclasses.make_dataclass("Payload_" + name.replace(".", "_").replace("-", "_"), fields)
        return QueueSpec(name, cls, True, fingerprint)
    if not fingerprint.startswith("var:"):
        raise BadFrame(f"not a var queue fingerprint: {fingerprint!r}")
    return QueueSpec(name, typing.Any, True, fingerprint)


@op("push", q=str, p=bytes, delay=_opt(int, float))
def _push(conn: _Conn, q: str, p: bytes, delay: float | None = None) -> int:
    ref = conn.queue(q)
    return ref.q.push(ref.payload_in(p), delay=delay)


@op("push_many", q=str, ps=_opt(list), blob=_opt(bytes), delay=_opt(int, float))
def _push_many(conn: _Conn, q: str, ps: list[Any] | None = None, blob: bytes | None = None,
               delay: float | None = None) -> list[int] | bytes:
    """A list of encoded payloads (``ps``), or (a fixed queue) one blob of records: one
    commit.  A var queue's bodies are checked once and stored as they came
    (``Queue._push_many_encoded``): no decode and second encode here."""
    ref = conn.queue(q)
    if blob is not None:
        if ps is not None or ref.dtype is None or len(blob) % ref.dtype.itemsize:
            raise BadFrame("a push_many blob is whole records of a fixed queue's dtype")
        ids = ref.q.push_many(np.frombuffer(blob, dtype=ref.dtype), delay=delay)
        return np.asarray(ids, dtype="<u8").tobytes()
    if ps is None:
        raise BadFrame("push_many needs ps or blob")
    if ref.var:
        if not set(map(type, ps)) <= {bytes}:
            raise BadFrame("a payload must be bytes")
        return ref.q._push_many_encoded(ps, delay=delay)
    return list(ref.q.push_many([ref.payload_in(p) for p in ps], delay=delay))


@op("lease", q=str, n=int, lease_timeout=_opt(int, float))
def _lease(conn: _Conn, q: str, n: int, lease_timeout: float | None = None) -> list[Any]:
    ref = conn.queue(q)
    leases = ref.q.lease(n, lease_timeout=lease_timeout)
    if not leases:
        return []
    conn.remember([lz.token for lz in leases], ref.q)
    dl = wire.dt_to_ms(leases[0].deadline)
    if ref.var:
        plain = ref.plain_out
        return [[lz.id, plain(lz.payload), lz.attempt, dl, wire.token_to_wire(lz.token)] for lz in leases]
    return [[lz.id, lz.payload.tobytes(), lz.attempt, dl, wire.token_to_wire(lz.token)] for lz in leases]


@op("ack", q=str, t=list)
def _ack(conn: _Conn, q: str, t: list[Any]) -> None:
    ref = conn.queue(q)
    tok = conn.token(t, ref)
    try:
        ref.q.ack(tok)
    finally:
        conn.drop([tok])


@op("lease_batch", q=str, n=int, lease_timeout=_opt(int, float), ack_tb=_opt(list), ack_ts=_opt(list))
def _lease_batch(conn: _Conn, q: str, n: int, lease_timeout: float | None = None, ack_tb: list[Any] | None = None,
                 ack_ts: list[Any] | None = None) -> list[Any] | None:
    """A LeaseBatch as arrays: [handle, shards u4, dues u8, ids u8, attempts u2, epochs u4,
    deadline ms, payloads (a fixed queue: one blob of records; a var queue: one msgpack
    array of the stored bodies, joined behind an array header, never decoded here)].

    ``ack_tb`` / ``ack_ts``: tokens to ack first, as ``ack_many``'s ``tb`` / ``ts``
    (``Queue.lease_batch(ack=)``: one request, one round trip); if the acks raise, nothing
    is acked nor leased."""
    ref = conn.queue(q)
    if ack_tb is not None or ack_ts is not None:
        ref.q._lease_arg(n, lease_timeout, "lease_batch")  # a bad argument raises before anything is acked
        _ack_many(conn, q, ts=ack_ts, tb=ack_tb)
    b: LeaseBatch[Any]
    if ref.var:
        b = ref.q._lease_batch_encoded(n, lease_timeout=lease_timeout)
    else:
        b = ref.q.lease_batch(n, lease_timeout=lease_timeout)
    if not len(b):
        return None
    handle = b._handle
    ids = b.ids.tolist()
    conn.remember_batch(handle, ref.q, b._shards.tolist(), b._dues.tolist(), ids, b._epochs.tolist())
    payloads: Any
    if not ref.var:
        payloads = np.ascontiguousarray(b.payloads).tobytes()
    else:
        payloads = _ARRAY32 + len(ids).to_bytes(4, "big") + b"".join(b.payloads)
    return [handle.to_bytes(16, "big"), _le(b._shards, _U4), _le(b._dues, _U8), _le(b.ids, _U8),
            _le(b.attempts, _U2), _le(b._epochs, _U4), wire.dt_to_ms(b._deadline), payloads]


_U2, _U4, _U8 = np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8")


def _le(a: np.ndarray, dt: np.dtype) -> bytes:
    """``a``'s values as ``dt`` (little-endian) bytes: no conversion when it already is."""
    return a.tobytes() if a.dtype == dt else a.astype(dt).tobytes()


@op("ack_many", q=str, ts=_opt(list), tb=_opt(list))
def _ack_many(conn: _Conn, q: str, ts: list[Any] | None = None, tb: list[Any] | None = None) -> int:
    """Tokens as a list, or (``tb``) as a batch's arrays [handle, shards u4, dues u8, ids u8,
    epochs u4]: all or nothing, as ``Queue.ack_many``."""
    ref = conn.queue(q)
    if tb is not None:
        batch, ids = _token_batch(tb, conn, ref)
        n = int(ref.q.ack_many(batch))
        conn.drop_batch(batch._handle, ids)
        return n
    if ts is None:
        raise BadFrame("ack_many needs ts or tb")
    toks = [conn.token(raw, ref) for raw in ts]
    n = int(ref.q.ack_many(toks))
    conn.drop(toks)
    return n


@op("release_many", q=str, ts=_opt(list), tb=_opt(list))
def _release_many(conn: _Conn, q: str, ts: list[Any] | None = None, tb: list[Any] | None = None) -> int:
    """Give back leases not started (``Queue.release_many``): tokens as for ``ack_many``,
    each held by this connection (else ``StaleToken``, nothing released); how many were
    released (a lease that ended meanwhile is not)."""
    ref = conn.queue(q)
    if tb is not None:
        batch, ids = _token_batch(tb, conn, ref, "released")
        n = ref.q.release_many(batch)
        conn.drop_batch(batch._handle, ids)
        return n
    if ts is None:
        raise BadFrame("release_many needs ts or tb")
    toks = [conn.token(raw, ref) for raw in ts]
    n = ref.q.release_many(toks)
    conn.drop(toks)
    return n


_ARRAY32 = b"\xdd"  # msgpack's array 32 marker: a var lease batch's bodies are its elements


def _held_tokens(held: dict[int, tuple[Queue[Any], dict[int, tuple[int, int, int]]]]
                 ) -> Iterable[tuple[LeaseToken, Queue[Any]]]:
    """Each lease of a connection's set as its ``LeaseToken`` and queue."""
    new = tuple.__new__
    for handle, (q, m) in list(held.items()):
        for seq, (shard, due, epoch) in list(m.items()):
            yield new(LeaseToken, (handle, shard, due, seq, epoch)), q


def _token_batch(tb: list[Any], conn: _Conn, ref: _QueueRef,
                 done: str = "acked") -> tuple[LeaseBatch[Any], list[int]]:
    """A token batch as a ``LeaseBatch`` (no payloads) and its row ids, once every token
    is checked to be held by this connection."""
    if not (len(tb) == 5 and all(isinstance(x, bytes) for x in tb) and len(tb[0]) == 16):
        raise BadFrame("a token batch is [16 bytes, shards, dues, ids, epochs]")
    try:
        shards, dues, ids, epochs = (_native(tb[i], d) for i, d in ((1, _U4), (2, _U8), (3, _U8), (4, _U4)))
    except ValueError:
        raise BadFrame("a token batch's arrays have a wrong length") from None
    n = len(ids)
    if not len(shards) == len(dues) == len(epochs) == n:
        raise BadFrame("a token batch's arrays differ in length")
    handle = int.from_bytes(tb[0], "big")
    id_list = ids.tolist()
    q = ref.q
    conn.check_batch(handle, q, shards.tolist(), dues.tolist(), id_list, epochs.tolist(), done)
    none = np.zeros(n, dtype=np.uint16)
    return LeaseBatch(q.name, handle, shards, dues, ids, none, epochs, (0, _EPOCH_DT), [None] * n), id_list


_LITTLE = sys.byteorder == "little"


def _native(raw: bytes, dt: np.dtype) -> np.ndarray:
    """Little-endian ``dt`` values as a native array (a view of ``raw`` on a
    little-endian host); ``ValueError`` if ``raw`` is not whole values."""
    a = np.frombuffer(raw, dtype=dt)
    return a if _LITTLE else a.astype(dt.newbyteorder("="))


@op("nack", q=str, t=list, delay=_opt(int, float), dead=bool)
def _nack(conn: _Conn, q: str, t: list[Any], dead: bool, delay: float | None = None) -> None:
    ref = conn.queue(q)
    tok = conn.token(t, ref)
    try:
        ref.q.nack(tok, delay=delay, dead=dead)
    except StaleToken:
        conn.drop([tok])
        raise
    conn.drop([tok])


@op("extend", q=str, t=list, by=_opt(int, float))
def _extend(conn: _Conn, q: str, t: list[Any], by: float | None = None) -> int:
    ref = conn.queue(q)
    tok = conn.token(t, ref)
    try:
        return wire.dt_to_ms(ref.q.extend(tok, by=by))
    except StaleToken:
        conn.drop([tok])  # leased again by another client, or settled: never valid again
        raise


@op("len", q=str)
def _len(conn: _Conn, q: str) -> int:
    return conn.queue(q).q.len()


@op("dead_len", q=str)
def _dead_len(conn: _Conn, q: str) -> int:
    return conn.queue(q).q.dead_len()


@op("next_delay", q=str)
def _next_delay(conn: _Conn, q: str) -> int | None:
    d = conn.queue(q).q.next_delay()
    return None if d is None else d // timedelta(milliseconds=1)


@op("wait_due", blocking=True, q=str, timeout=_NUM)
def _wait_due(conn: _Conn, q: str, timeout: float) -> bool:
    return conn.queue(q).q.wait_due_timeout(timeout)


@op("peek", q=str, n=int, dead=bool)
def _peek(conn: _Conn, q: str, n: int, dead: bool) -> list[Any]:
    ref = conn.queue(q)
    out = []
    for job in ref.q.peek(n, dead=dead):
        try:
            raw, poisoned = ref.payload_out(job.payload), False
        except Exception:  # noqa: BLE001 - a poisoned row's raw bytes
            raw, poisoned = job.payload, True
        out.append([job.id, int(job.state), job.attempts, wire.dt_to_ms(job.due), raw, poisoned])
    return out


@op("redrive", q=str, ids=_opt(list), delay=_opt(int, float))
def _redrive(conn: _Conn, q: str, ids: list[Any] | None = None, delay: float | None = None) -> int:
    return conn.queue(q).q.redrive(ids, delay=delay)


@op("purge_dead", q=str, ids=_opt(list))
def _purge_dead(conn: _Conn, q: str, ids: list[Any] | None = None) -> int:
    return conn.queue(q).q.purge_dead(ids)


@op("stats", q=str)
def _stats(conn: _Conn, q: str) -> dict[str, Any]:
    return conn.queue(q).q.stats().to_dict()


@op("snapshot", q=str)
def _snapshot(conn: _Conn, q: str) -> list[Any]:
    arr = conn.queue(q).q.snapshot()
    return [wire.dtype_to_wire(arr.dtype), arr.tobytes()]


# maps, transactions, the database -------------------------------------------------------------


@op("open_map", name=str)
def _open_map(conn: _Conn, name: str) -> None:
    conn.maps[name] = conn.db.open_map(name)


_KEY = (bytes, str, int)


@op("map_get", m=str, k=_KEY)
def _map_get(conn: _Conn, m: str, k: Any) -> list[Any]:
    mp = conn.map(m)
    missing = _MISSING
    v = mp.get(k, missing)
    return [False, None] if v is missing else [True, v]


_MISSING = object()


@op("map_put", m=str, k=_KEY, v=(object,))
def _map_put(conn: _Conn, m: str, k: Any, v: Any) -> None:
    conn.map(m).put(k, v)


@op("map_delete", m=str, k=_KEY)
def _map_delete(conn: _Conn, m: str, k: Any) -> bool:
    return conn.map(m).delete(k)


@op("map_len", m=str)
def _map_len(conn: _Conn, m: str) -> int:
    return len(conn.map(m))


@op("tx", steps=list, durable=bool)
def _tx(conn: _Conn, steps: list[Any], durable: bool) -> list[int]:
    tx = conn.db.tx()
    settled: list[LeaseToken] = []
    for step in steps:
        if not (isinstance(step, list) and step and isinstance(step[0], str) and len(step) >= 2
                and isinstance(step[1], str)):
            raise BadFrame("a transaction step must be [kind, collection, ...]")
        kind, coll = step[0], step[1]
        if kind == "push" and len(step) == 4 and isinstance(step[3], (int, float, _NONE)):
            ref = conn.queue(coll)
            tx.push(ref.q, ref.payload_in(step[2]), delay=step[3])
        elif kind == "ack" and len(step) == 3:
            ref = conn.queue(coll)
            tok = conn.token(step[2], ref)
            tx.ack(ref.q, tok)
            settled.append(tok)
        elif kind == "nack" and len(step) == 5 and isinstance(step[3], (int, float, _NONE)) \
                and type(step[4]) is bool:
            ref = conn.queue(coll)
            tok = conn.token(step[2], ref)
            tx.nack(ref.q, tok, delay=step[3], dead=step[4])
            settled.append(tok)
        elif kind == "put" and len(step) == 4 and isinstance(step[2], _KEY):
            tx.put(conn.map(coll), step[2], step[3])
        elif kind == "delete" and len(step) == 3 and isinstance(step[2], _KEY):
            tx.delete(conn.map(coll), step[2])
        else:
            raise BadFrame(f"a malformed transaction step {kind!r}")
    if durable:
        tx.durable()
    ids = tx.commit()
    conn.drop(settled)
    return ids


@op("db_stats")
def _db_stats(conn: _Conn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, s in conn.db.stats().items():
        out[name] = ["queue", s.to_dict()] if hasattr(s, "to_dict") else ["map", s]
    return out


@op("ping")
def _ping(conn: _Conn) -> int:
    return os.getpid()
