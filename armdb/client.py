"""``armdb.connect``: use a database that another process owns and serves (SPEC P2-P5).

A :class:`Client` holds one Unix socket to the owner's server (armdb.server).  Replies
are matched to requests by id, so any number of threads may share a client and have
requests in flight at once (pipelining; ``_send_many`` sends several in one write).  It
has no thread of its own: a caller waiting for its reply reads the socket itself (the
reader role, one thread at a time) and hands the other callers their replies, so a call
costs one write and usually one read, with no thread hop.  A call waits at most the
client's ``timeout`` for its reply (a wait for a due row: its own timeout plus that); when
the server is gone (the socket closed, or no reply in time) every call in flight and
every later one raises :class:`armdb.errors.ServerGone`, a ``DbClosed``, and the
connection is closed, which releases its leases at the server.

Payloads are encoded here, with the codec of the client's own ``QueueSpec``; the owner
stores a var batch's bodies as they come (checked once, never decoded and encoded again)
and sends leased bodies back as they are stored, as one msgpack array decoded here once;
errors come back as their own ``armdb.errors`` class with the server's message.

Lock policy: ``Client._wlock`` serialises frames written to the socket; ``Client._lock``
(the lock of the condition ``_cv``) guards the table of pending requests, the reader role
and the closed flag.  Neither is held while reading the socket or waiting for a reply.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import numpy as np

from . import wire
from ._clock import ms_to_datetime, to_seconds
from ._core.plainpack import pack_plain, unpack_plain
from ._pack import packb, packer
from .config import QueueConfig
from .errors import ConfigError, CorruptionError, NotALease, PayloadTypeError, ServerGone, StaleToken
from .qspec import FixedCodec, QueueSpec, VarCodec
from .queue import Job, Lease, LeaseBatch, LeaseToken, QueueStats, State, as_token
from .wire import BadFrame

__all__ = ["Client", "RemoteMap", "RemoteQueue", "RemoteTx", "connect"]

T = TypeVar("T")

_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The child shares the socket with its parent: replies would go to whichever reads
    # first.  Inherited clients are closed for the child only (the parent's stays open).
    for c in list(_CLIENTS):
        c._closed = True
        c._why = "it was inherited across fork(); call armdb.connect again in the child"
    _CLIENTS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


_POLL = 0.25  # seconds: a reading caller looks at its deadline at least this often


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class _Call:
    """One request in flight: its reply's value or error, once ``done``."""

    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def fail(self, e: BaseException) -> None:
        if not self.done:
            self.error = e
            self.done = True


def connect(dir_or_socket: str | os.PathLike[str], *, timeout: float = 30.0) -> Client:
    """Connect to the process that serves a database (``db.serve()`` or
    ``python -m armdb serve DIR``).

    Parameters
    ----------
    dir_or_socket : str or os.PathLike
        The database directory (its ``armdb.sock`` is used) or a socket path.
    timeout : float
        Seconds any call waits for the owner before raising ``ServerGone``.

    Raises
    ------
    ServerGone
        Nobody serves there (no socket, or no process listening on it).
    ConfigError
        A timeout that is not a positive number.
    """
    return Client(dir_or_socket, timeout=timeout)


class Client:
    """A connection to a serving owner; see :func:`connect`.  Safe to share between
    threads; a context manager."""

    def __init__(self, dir_or_socket: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        t = to_seconds(timeout, "timeout")
        if t <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = t
        path = os.path.abspath(os.fspath(dir_or_socket))
        if os.path.isdir(path):
            path = os.path.join(path, wire.SOCKET_NAME)
        self.path = path
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._wlock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._why = ""
        self._reading = False  # a caller thread holds the reader role
        self._waiting = 0  # threads asleep on ``_cv`` (notified only when there are some)
        self._queues: dict[str, RemoteQueue[Any]] = {}
        self._maps: dict[str, RemoteMap] = {}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        frames = wire.FrameReader(sock)
        try:
            sock.settimeout(t)
            give_up = time.monotonic() + t
            while True:
                try:
                    sock.connect(path)
                    break
                except BlockingIOError:  # the server's backlog is full: it is accepting, try again
                    if time.monotonic() > give_up:
                        raise
                    time.sleep(0.01)
            sock.sendall(wire.frame({"armdb": wire.MAGIC, "versions": [wire.VERSION]}))
            got: list[Any] = []
            while not got:
                more = frames.read()
                if more is None:
                    raise ConnectionResetError("the server closed the connection")
                got = more
            hello = got[0]
        except (OSError, BadFrame) as e:
            sock.close()
            raise ServerGone(
                f"no armdb server answers at {path} ({e}); start one in the owning process with db.serve() "
                f"or `python -m armdb serve DIR`"
            ) from None
        if not isinstance(hello, dict) or hello.get("armdb") != wire.MAGIC or hello.get("version") != wire.VERSION:
            sock.close()
            why = hello.get("error") if isinstance(hello, dict) else None
            raise ServerGone(f"the server at {path} does not speak this client's protocol: "
                             f"{why or repr(hello)}; use the same armdb version on both sides")
        # Blocking, with a kernel receive timeout (one system call per recv, where a
        # socket timeout polls first): a reading caller wakes at least every _POLL
        # seconds to look at its deadline.  Sends time out after the client's timeout.
        sock.settimeout(None)
        self._poll = min(t / 4, _POLL)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self._poll))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(t))
        self.server_pid = int(hello.get("pid", 0))
        self._sock = sock
        self._frames = frames
        _CLIENTS.add(self)

    # -- frames --------------------------------------------------------------------------
    # No reader thread: a thread waiting for its reply reads the socket itself (the
    # reader role, one thread at a time), hands every reply it reads to its caller and
    # gives the role up once its own reply came; a thread waiting meanwhile sleeps on
    # ``_cv`` until its reply was handed to it or the role is free.  One request costs
    # one send and, usually, one recv, with no thread hop on the client.
    def _shut(self, why: str) -> None:
        with self._cv:
            if not self._why:
                self._why = why
            self._closed = True
            pending, self._pending = self._pending, {}
            err = self._gone()
            for call in pending.values():
                call.fail(err)
            self._cv.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _gone(self) -> ServerGone:
        return ServerGone(f"the armdb client of {self.path} is closed: {self._why}; connect again once the "
                          f"owner serves the database")

    def _submit(self, op: str, **args: Any) -> _Call:
        """Send one request; :meth:`_result` waits for its reply (many may be in flight)."""
        return self._send_many([(op, args)])[0]

    def _send_many(self, requests: list[tuple[str, dict[str, Any]]]) -> list[_Call]:
        """Send several requests in one write (a pipelined batch); their calls in order.
        The server runs them in this order."""
        calls = [_Call() for _ in requests]
        with self._lock:
            if self._closed:
                raise self._gone()
            rids = [next(self._ids) for _ in requests]
            for rid, call in zip(rids, calls):
                self._pending[rid] = call
        try:
            data = b"".join(wire.frame([rid, op, args]) for rid, (op, args) in zip(rids, requests))
        except BaseException:  # too large, or a value msgpack cannot carry: nothing was sent
            self._unregister(rids)
            raise
        self._send_bytes(data)
        return calls

    def _unregister(self, rids: list[int]) -> None:
        """Forget requests whose frames could not be built (nothing was sent)."""
        with self._lock:
            for rid in rids:
                self._pending.pop(rid, None)

    def _send_bytes(self, data: bytes) -> None:
        """Send framed requests; a broken connection shuts the client (``DbClosed``)."""
        try:
            with self._wlock:
                self._sock.sendall(data)
        except OSError as e:
            self._shut(f"the connection to the server broke ({e})")
            raise self._gone() from None

    def _result(self, call: _Call, extra: float = 0.0) -> Any:
        """Wait for ``call``'s reply (at most the client's timeout, plus ``extra``)."""
        if not call.done:
            self._wait(call, time.monotonic() + self.timeout + extra)
        if call.error is not None:
            raise call.error
        return call.value

    def _wait(self, call: _Call, deadline: float) -> None:
        late = False
        with self._cv:
            while not call.done:
                if self._closed:
                    call.fail(self._gone())
                    return
                if not self._reading:
                    self._reading = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    late = True
                    break
                self._waiting += 1
                try:
                    self._cv.wait(left)
                finally:
                    self._waiting -= 1
            else:
                return
        if late:
            self._shut(f"the server did not answer within {self.timeout:g} s")
            return
        try:
            why = self._read_until(call, deadline)
        finally:
            self._stop_reading()
        if why:
            self._shut(why)

    def _stop_reading(self) -> None:
        """Give up the reader role; a waiting thread takes it over."""
        with self._cv:
            self._reading = False
            if self._waiting:
                self._cv.notify_all()

    def _read_until(self, call: _Call, deadline: float) -> str:
        """Read replies until ``call``'s came; why the client must shut, if it must."""
        frames = self._frames
        while not call.done:
            try:
                replies = frames.read()
            except (BlockingIOError, TimeoutError):  # the kernel's receive timeout: no byte came
                if time.monotonic() >= deadline:
                    return f"the server did not answer within {self.timeout:g} s"
                continue
            except (OSError, BadFrame) as e:
                return self._why or f"the connection to the server broke ({e})"
            if replies is None:
                return "the server closed the connection (the owner exited, crashed or closed the database)"
            if not replies:
                continue
            with self._cv:
                for reply in replies:
                    if not (isinstance(reply, list) and len(reply) == 3 and type(reply[0]) is int):
                        return "the server sent a malformed reply"
                    c = self._pending.pop(reply[0], None)
                    if c is None:
                        continue  # a reply to a request that timed out, or was abandoned
                    if reply[1] == wire.OK:
                        c.value = reply[2]
                    else:
                        c.error = wire.error_from_wire(reply[2])
                    c.done = True
                if self._waiting:
                    self._cv.notify_all()  # another thread's reply may be among them
        return ""

    def _call(self, op: str, **args: Any) -> Any:
        """One request and its reply: :meth:`_send_many` and :meth:`_result` for one.

        A request alone in flight takes the reader role before it is sent, so its reply
        is read right after the send (a thread that sends while another reads waits as
        :meth:`_wait` says).  Holding the role across the send holds back no one: with
        nothing else in flight the server has nothing else to send."""
        call = _Call()
        with self._lock:
            if self._closed:
                raise self._gone()
            rid = next(self._ids)
            early = not self._pending and not self._reading
            if early:
                self._reading = True
            self._pending[rid] = call
        try:
            try:
                data = wire.frame([rid, op, args])
            except BaseException:  # too large, or a value msgpack cannot carry: nothing was sent
                self._unregister([rid])
                raise
            self._send_bytes(data)
            why = self._read_until(call, time.monotonic() + self.timeout) if early else ""
        finally:
            if early:
                self._stop_reading()
        if why:
            self._shut(why)
        if not call.done:
            self._wait(call, time.monotonic() + self.timeout)
        if call.error is not None:
            raise call.error
        return call.value

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the connection; the server releases every lease it still holds."""
        self._shut("close() was called")
        with self._cv:  # a thread reading the socket sees it shut; let it leave first
            self._waiting += 1
            try:
                self._cv.wait_for(lambda: not self._reading, 5.0)
            finally:
                self._waiting -= 1
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise ConfigError("a Client cannot be pickled or sent to another process; call armdb.connect there")

    # -- what a Db offers ---------------------------------------------------------------
    def open_queue(self, spec: QueueSpec[T], config: QueueConfig | None = None) -> RemoteQueue[T]:
        """A handle on the owner's queue ``spec`` (opened there with ``config`` if the owner
        has not opened it; ``ConfigError`` if the owner's config differs)."""
        if not isinstance(spec, QueueSpec):
            raise ConfigError("open_queue takes the QueueSpec returned by armdb.queue(...)")
        if config is not None and not isinstance(config, QueueConfig):
            raise ConfigError("open_queue takes a built QueueConfig: QueueConfig.balanced()...build()")
        got = self._call("open_queue", name=spec.name, var=spec.var, fingerprint=spec.fingerprint,
                        dtype=None if spec.var else wire.dtype_to_wire(spec.dtype),
                        config=None if config is None else wire.config_to_wire(config))
        q: RemoteQueue[T] = RemoteQueue(self, spec, wire.config_from_wire(got["config"]))
        self._queues[spec.name] = q
        return q

    def open_map(self, name: str) -> RemoteMap:
        """A handle on the owner's map ``name`` (``get``, ``put``, ``delete``, ``in``, ``len``)."""
        if not isinstance(name, str):
            raise ConfigError("a map name is a str")
        self._call("open_map", name=name)
        m = RemoteMap(self, name)
        self._maps[name] = m
        return m

    def tx(self) -> RemoteTx:
        """A transaction builder (T1) whose steps are sent as one request at ``commit()``."""
        if self._closed:
            raise self._gone()
        return RemoteTx(self)

    def stats(self) -> dict[str, Any]:
        """The stats of every collection the owner has open, by name (a ``QueueStats``
        for a queue, a dict for a map)."""
        out: dict[str, Any] = {}
        for name, (kind, s) in self._call("db_stats").items():
            out[name] = QueueStats(**s) if kind == "queue" else s
        return out


def _secs(value: timedelta | float | None, name: str) -> float | None:
    return None if value is None else to_seconds(value, name)


class RemoteQueue(Generic[T]):
    """A queue of a served database, with the operations of :class:`armdb.Queue`."""

    def __init__(self, client: Client, spec: QueueSpec[T], config: QueueConfig) -> None:
        self._client = client
        self.spec = spec
        self.name = spec.name
        self.config = config
        if spec.var:
            codec = VarCodec(spec.payload)
            self._codec = codec
            self._encode = codec.encode
            self._decode = codec.decode
            self._from_plain = codec.from_plain
        else:
            fcodec = FixedCodec(spec.dtype)
            dtype = spec.dtype
            self._encode = fcodec.encode
            self._decode = lambda raw: np.frombuffer(raw, dtype=dtype)[0]

    def __repr__(self) -> str:
        return f"<armdb.RemoteQueue {self.name!r} via {self._client.path}>"

    def _call(self, op: str, **args: Any) -> Any:
        return self._client._call(op, q=self.name, **args)

    def push(self, payload: T, *, delay: timedelta | float | None = None) -> int:
        return int(self._call("push", p=self._encode(payload), delay=_secs(delay, "delay")))

    def push_many(self, payloads: Any, *, delay: timedelta | float | None = None) -> Any:
        """Push every payload in one request and one commit, all or nothing (as
        ``Queue.push_many``); their ids in order.  A fixed queue also takes a 1-D array of
        its dtype (sent as one block of records; the ids come back as a ``uint64`` array)."""
        d = _secs(delay, "delay")
        if isinstance(payloads, np.ndarray) and not self.spec.var:
            if payloads.dtype != self.spec.dtype or payloads.ndim != 1:
                raise PayloadTypeError(f"push_many takes a 1-D array of the queue's dtype {self.spec.dtype}, "
                                       f"got {payloads.dtype} of shape {payloads.shape}")
            raw = self._call("push_many", blob=np.ascontiguousarray(payloads).tobytes(), delay=d)
            return np.frombuffer(raw, dtype="<u8").astype(np.uint64)
        if not self.spec.var:
            return list(self._call("push_many", ps=[self._encode(p) for p in payloads], delay=d))
        payloads = self._checked_list(payloads)
        try:
            return list(self._call("push_many", ps=self._encode_batch(payloads), delay=d))
        except PayloadTypeError as e:
            if "not one complete msgpack value" not in str(e):
                raise
            self._name_unreadable(payloads)  # raises encode's own words for the first that cannot be read back
            raise

    @staticmethod
    def _checked_list(payloads: Any) -> list[Any]:
        if isinstance(payloads, (str, bytes, bytearray, memoryview, dict)) or not hasattr(payloads, "__iter__"):
            raise PayloadTypeError(f"push_many takes a sequence of payloads (e.g. a list), not "
                                   f"{type(payloads).__name__}; push one payload with push()")
        return list(payloads)

    def _encode_batch(self, payloads: list[Any]) -> list[bytes]:
        """A var batch's bodies, each checked as ``encode`` checks its type.  Whether each
        reads back is checked once, by the server (``Queue._push_many_encoded``), which
        stores the bodies as they are; a payload class that rebuilds itself is encoded
        here as ``encode`` does, with every check."""
        codec = self._codec
        if not codec.rebuild_at_push and not codec.relayout:
            objs = self._plain_fast(payloads)
            if objs is not None:
                raws = pack_plain(objs)  # plain values (the common payload): one compiled loop
                if raws is not None:
                    return raws
                try:
                    return list(map(packer().pack, objs))
                except (TypeError, ValueError, OverflowError):
                    pass  # one by one below: the payload's index and what cannot be packed
        plain = codec.plain
        enc: Callable[[Any], bytes] = self._encode if codec.rebuild_at_push else lambda p: packb(plain(p))
        out = []
        for i, p in enumerate(payloads):
            try:
                try:
                    out.append(enc(p))
                except (TypeError, ValueError, OverflowError):
                    self._encode(p)  # raises the PayloadTypeError saying which field cannot be packed
                    raise
            except PayloadTypeError as e:
                raise type(e)(f"payload {i} of the batch: {e}; nothing was pushed") from None
        return out

    def _plain_fast(self, payloads: list[Any]) -> list[Any] | None:
        """The plain values of a batch whose payloads are all exactly of the declared type
        (a dataclass: its field lists; dicts, lists, ...: themselves), checked in one
        pass; None for anything else (each payload then goes through ``plain``, which
        says which one is refused, and converts what it converts)."""
        codec = self._codec
        tp = codec.payload
        if codec.is_dataclass:
            if not all(type(p) is tp for p in payloads):
                return None
            fields = codec.fields
            return [[getattr(p, f) for f in fields] for p in payloads]
        if codec.any:
            return payloads
        if tp in (dict, list, str) and set(map(type, payloads)) <= {tp}:
            return payloads
        return None

    def _name_unreadable(self, payloads: list[Any]) -> None:
        """Encode each payload alone; raise the first one's ``PayloadTypeError`` (by its
        index in the batch)."""
        for i, p in enumerate(payloads):
            try:
                self._encode(p)
            except PayloadTypeError as e:
                raise type(e)(f"payload {i} of the batch: {e}; nothing was pushed") from None

    def lease_batch(self, n: int = 1, *, lease_timeout: timedelta | float | None = None,
                    ack: Any = None) -> LeaseBatch[T]:
        """Lease like :meth:`lease`, in one reply of arrays: a :class:`armdb.LeaseBatch`.
        ``ack``: leases to ack first with :meth:`ack_many` (as ``Queue.lease_batch``); if
        that raises, nothing is leased."""
        if type(n) is not int or n < 1:
            raise ConfigError(f"lease_batch(n) needs an int n >= 1, got {n!r}")
        secs = _secs(lease_timeout, "lease_timeout")
        if ack is not None and not (isinstance(ack, LeaseBatch) and not len(ack)):
            # The acks travel in the lease request: one round trip; the owner checks the
            # lease's arguments, acks, and leases only if the acks went through.
            tb, ts = _lease_list_arg(ack, "ack")
            got = self._call("lease_batch", n=n, lease_timeout=secs, ack_tb=tb, ack_ts=ts)
        else:
            got = self._call("lease_batch", n=n, lease_timeout=secs)
        if got is None:
            e = np.empty(0, dtype=np.uint64)
            payloads: Any = [] if self.spec.var else np.empty(0, dtype=self.spec.dtype)
            return LeaseBatch(self.name, 0, e.astype(np.uint32), e, e, e.astype(np.uint16), e.astype(np.uint32),
                              (0, ms_to_datetime(0)), payloads)
        handle, shards, dues, ids, attempts, epochs, deadline, raw = got
        if self.spec.var:
            payloads = self._payloads_of(raw)
        else:
            payloads = np.frombuffer(raw, dtype=self.spec.dtype).copy()
        return LeaseBatch(self.name, int.from_bytes(handle, "big"), np.frombuffer(shards, "<u4").astype(np.uint32),
                          np.frombuffer(dues, "<u8").astype(np.uint64), np.frombuffer(ids, "<u8").astype(np.uint64),
                          np.frombuffer(attempts, "<u2").astype(np.uint16),
                          np.frombuffer(epochs, "<u4").astype(np.uint32), (deadline, ms_to_datetime(deadline)),
                          payloads)

    def _payloads_of(self, raw: Any) -> list[Any]:
        """A var lease batch's payloads: the stored bodies, which the server sent as one
        msgpack array, decoded once here."""
        try:
            if type(raw) is not bytes:
                raise ValueError(f"a {type(raw).__name__} where one msgpack array of bodies was expected")
            got = unpack_plain([raw])  # bodies of plain values: one compiled loop
            objs = got[0] if got is not None else wire.unpack_value(raw)
        except ValueError as e:
            raise CorruptionError(f"queue {self.name!r}: the leased bodies do not decode ({e}); run armdb.check "
                                  f"on the database") from None
        return objs if self._from_plain_is_identity() else [self._from_plain(p) for p in objs]  # type: ignore[no-any-return]

    def _leases(self, rows: list[Any]) -> list[Lease[T]]:
        out: list[Lease[T]] = []
        dl: tuple[int, datetime] | None = None
        decode = self._from_plain if self.spec.var else self._decode
        for rid, raw, attempt, deadline, tok in rows:
            if dl is None or dl[0] != deadline:
                dl = (deadline, ms_to_datetime(deadline))
            out.append(Lease(rid, decode(raw), attempt, dl[1], LeaseToken(*wire.token_fields(tok))))
        return out

    def _from_plain_is_identity(self) -> bool:
        c = self._codec
        return not c.is_dataclass and c.payload is not tuple

    def lease(self, n: int = 1, *, lease_timeout: timedelta | float | None = None) -> list[Lease[T]]:
        if type(n) is not int or n < 1:
            raise ConfigError(f"lease(n) needs an int n >= 1, got {n!r}")
        return self._leases(self._call("lease", n=n, lease_timeout=_secs(lease_timeout, "lease_timeout")))

    def ack(self, token: Lease[T] | LeaseToken) -> None:
        self._call("ack", t=wire.token_to_wire(as_token(token)))

    def ack_many(self, leases: Any) -> int:
        """Ack a :class:`armdb.LeaseBatch`, or a sequence of Leases or tokens, in one request
        and one commit, all or nothing (as ``Queue.ack_many``); how many were acked."""
        tb, ts = _lease_list_arg(leases, "ack_many")
        return int(self._call("ack_many", tb=tb, ts=ts))

    def release_many(self, leases: Any) -> int:
        """Give back leases whose work has not started, as ``Queue.release_many``: ready
        again at once, their attempt not counted; how many were released.  A token this
        client does not hold raises ``StaleToken`` and nothing is released."""
        tb, ts = _lease_list_arg(leases, "release_many")
        return int(self._call("release_many", tb=tb, ts=ts))

    def _ack_many_and_lease(self, acks: list[Lease[T]], n: int) -> tuple[BaseException | None, list[Lease[T]]]:
        """``ack_many(acks)`` then ``lease(n)``, pipelined: both requests in one write, one
        round trip (armdb.Worker).  The ``StaleToken`` that refused the acks, if any (none
        was acked then), and the leases."""
        return self._ack_many_and_lease_wait(self._ack_many_and_lease_send(acks, n))

    def _ack_many_and_lease_send(self, acks: list[Lease[T]], n: int) -> list[Any]:
        """Send what :meth:`_ack_many_and_lease` sends, without waiting: a worker leases
        its next batch while its last handler runs.  :meth:`_ack_many_and_lease_wait`
        takes the replies."""
        reqs: list[tuple[str, dict[str, Any]]] = []
        if acks:
            reqs.append(("ack_many", {"q": self.name, **_tokens_arg(acks)}))
        reqs.append(("lease_batch", {"q": self.name, "n": n}))
        return self._client._send_many(reqs)

    def _ack_many_and_lease_wait(self, calls: list[Any]) -> tuple[BaseException | None, list[Lease[T]]]:
        c = self._client
        stale: BaseException | None = None
        if len(calls) == 2:
            try:
                c._result(calls[0])
            except StaleToken as e:
                stale = e
        return stale, self._batch_leases(c._result(calls[-1]))

    def _calls_done(self, calls: list[Any]) -> bool:
        """Whether every reply of ``calls`` is in (a worker's heartbeat: no wait)."""
        return all(c.done for c in calls)

    def _batch_leases(self, got: Any) -> list[Lease[T]]:
        """A ``lease_batch`` reply as a list of ``Lease`` objects (what ``lease`` returns),
        made from its arrays in one pass (armdb.Worker)."""
        if got is None:
            return []
        handle, shards, dues, ids, attempts, epochs, deadline, raw = got
        h = int.from_bytes(handle, "big")
        payloads: Any = (self._payloads_of(raw) if self.spec.var
                         else np.frombuffer(raw, dtype=self.spec.dtype).copy())
        dl = ms_to_datetime(deadline)
        new = tuple.__new__  # the NamedTuples without their Python-level __new__
        return [new(Lease, (i, p, a, dl, new(LeaseToken, (h, k, d, i, e))))
                for i, p, a, k, d, e in zip(np.frombuffer(ids, "<u8").tolist(), payloads,
                                            np.frombuffer(attempts, "<u2").tolist(),
                                            np.frombuffer(shards, "<u4").tolist(),
                                            np.frombuffer(dues, "<u8").tolist(),
                                            np.frombuffer(epochs, "<u4").tolist(), strict=True)]

    def _extend_many(self, leases: list[Lease[T]], by: timedelta | None) -> None:
        """Extend each lease by ``by`` (None: the lease timeout), pipelined (a worker's
        heartbeat and release); a lease lost meanwhile is skipped."""
        c = self._client
        b = _secs(by, "by")
        calls = c._send_many([("extend", {"q": self.name, "t": wire.token_to_wire(as_token(t)), "by": b})
                              for t in leases])
        for call in calls:
            try:
                c._result(call)
            except StaleToken:
                pass

    def nack(self, token: Lease[T] | LeaseToken, *, delay: timedelta | float | None = None,
             dead: bool = False) -> None:
        if not isinstance(dead, bool):
            raise ConfigError("dead must be True or False")
        self._call("nack", t=wire.token_to_wire(as_token(token)), delay=_secs(delay, "delay"), dead=dead)

    def extend(self, lease: Lease[T] | LeaseToken, *, by: timedelta | float | None = None) -> datetime:
        return ms_to_datetime(self._call("extend", t=wire.token_to_wire(as_token(lease)), by=_secs(by, "by")))

    def len(self) -> int:
        return int(self._call("len"))

    def __len__(self) -> int:
        return self.len()

    def dead_len(self) -> int:
        return int(self._call("dead_len"))

    def next_delay(self) -> timedelta | None:
        ms = self._call("next_delay")
        return None if ms is None else timedelta(milliseconds=ms)

    def wait_due_timeout(self, timeout: timedelta | float) -> bool:
        """Block until a row is due or ``timeout`` passes (advisory, as ``Queue``'s)."""
        t = max(0.0, to_seconds(timeout, "timeout"))
        c = self._client
        return bool(c._result(c._submit("wait_due", q=self.name, timeout=t), extra=t))

    async def due(self) -> None:
        """Resolve when a row is due (advisory); ``ServerGone`` when the owner goes.

        Each wait (at most ``wakeup_recheck``) is one request, waited for on a thread of
        its own, so the event loop never blocks; a cancelled ``due()`` leaves that thread
        to finish its short wait."""
        c = self._client
        step = min(self.config.wakeup_recheck, c.timeout)
        loop = asyncio.get_running_loop()
        while True:
            call = c._submit("wait_due", q=self.name, timeout=step)
            fut: asyncio.Future[Any] = loop.create_future()
            threading.Thread(target=_await_call, args=(c, call, step, loop, fut), daemon=True,
                             name="armdb-due").start()
            if await fut:
                return

    def peek(self, n: int = 10, *, dead: bool = False) -> list[Job[T]]:
        if type(n) is not int or n < 0:
            raise ConfigError(f"peek(n) needs an int n >= 0, got {n!r}")
        out: list[Job[T]] = []
        for rid, state, attempts, due, raw, poisoned in self._call("peek", n=n, dead=bool(dead)):
            out.append(Job(rid, State(state), attempts, ms_to_datetime(due), raw if poisoned else self._decode(raw)))
        return out

    def redrive(self, ids: Any = None, *, delay: timedelta | float | None = None) -> int:
        return int(self._call("redrive", ids=_ids(ids), delay=_secs(delay, "delay")))

    def purge_dead(self, ids: Any = None) -> int:
        return int(self._call("purge_dead", ids=_ids(ids)))

    def stats(self) -> QueueStats:
        return QueueStats(**self._call("stats"))

    def snapshot(self) -> np.ndarray:
        descr, raw = self._call("snapshot")
        return np.frombuffer(raw, dtype=wire.dtype_from_wire(descr)).copy()


def _await_call(c: Client, call: _Call, extra: float, loop: asyncio.AbstractEventLoop,
                fut: asyncio.Future[Any]) -> None:
    try:
        got, err = c._result(call, extra), None
    except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
        got, err = None, e

    def settle() -> None:
        if fut.done():
            return  # the task was cancelled
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(got)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the event loop was closed meanwhile


def _tokens_arg(leases: list[Any]) -> dict[str, Any]:
    """The tokens of ``leases`` as ``ack_many`` takes them: a token batch (``tb``) when
    they share one handle, as a worker's do, else a list (``ts``)."""
    toks = [as_token(t) for t in leases]
    h = toks[0].handle
    n = len(toks)
    if any(t.handle != h for t in toks):
        return {"ts": [wire.token_to_wire(t) for t in toks]}
    shards, dues, ids, epochs = zip(*[t[1:] for t in toks], strict=True)
    return {"tb": [h.to_bytes(16, "big"), struct.pack(f"<{n}I", *shards), struct.pack(f"<{n}Q", *dues),
                   struct.pack(f"<{n}Q", *ids), struct.pack(f"<{n}I", *epochs)]}


def _lease_list_arg(leases: Any, call: str) -> tuple[list[bytes] | None, list[Any] | None]:
    """A LeaseBatch, or a sequence of Leases or tokens, as a request carries it: a token
    batch, or a list of tokens (the other None); ``NotALease`` for anything else."""
    if isinstance(leases, LeaseBatch):
        return _token_batch(leases), None
    if isinstance(leases, (Lease, LeaseToken)) or not hasattr(leases, "__iter__"):
        raise NotALease(f"{call} takes a LeaseBatch or a sequence of Leases or tokens, not {type(leases).__name__}")
    return None, [wire.token_to_wire(as_token(t)) for t in leases]


def _token_batch(b: LeaseBatch[Any]) -> list[bytes]:
    """A batch's tokens as the server takes them: [handle, shards u4, dues u8, ids u8, epochs u4]."""
    return [b._handle.to_bytes(16, "big"), b._shards.astype("<u4").tobytes(), b._dues.astype("<u8").tobytes(),
            b.ids.astype("<u8").tobytes(), b._epochs.astype("<u4").tobytes()]


def _ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ConfigError(f"ids must be an iterable of row ids (ints) or None, not {type(ids).__name__}")
    return [int(i) if isinstance(i, (int, np.integer)) and not isinstance(i, bool) else _bad_id(i) for i in ids]


def _bad_id(i: object) -> int:
    raise ConfigError(f"ids must be row ids (positive ints), got {i!r}")


class RemoteMap:
    """A map of a served database: ``get``, ``put``, ``delete``, ``in``, ``len``."""

    def __init__(self, client: Client, name: str) -> None:
        self._client = client
        self.name = name

    def get(self, key: Any, default: Any = None) -> Any:
        found, value = self._client._call("map_get", m=self.name, k=key)
        return value if found else default

    def put(self, key: Any, value: Any) -> None:
        self._client._call("map_put", m=self.name, k=key, v=value)

    def delete(self, key: Any) -> bool:
        return bool(self._client._call("map_delete", m=self.name, k=key))

    def __contains__(self, key: Any) -> bool:
        found, _ = self._client._call("map_get", m=self.name, k=key)
        return bool(found)

    def __len__(self) -> int:
        return int(self._client._call("map_len", m=self.name))


class RemoteTx:
    """``client.tx()``: the steps of T1, sent to the owner as one transaction at ``commit``."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._steps: list[list[Any]] = []
        self._durable = False
        self._finished = False

    def _step(self, step: list[Any]) -> RemoteTx:
        if self._finished:
            raise ConfigError("this transaction was already committed or aborted; start a new client.tx()")
        self._steps.append(step)
        return self

    @staticmethod
    def _queue(q: object) -> RemoteQueue[Any]:
        if not isinstance(q, RemoteQueue):
            raise ConfigError("tx steps take a queue handle of this client (client.open_queue)")
        return q

    @staticmethod
    def _map(m: object) -> RemoteMap:
        if not isinstance(m, RemoteMap):
            raise ConfigError("tx steps take a map handle of this client (client.open_map)")
        return m

    def push(self, queue: RemoteQueue[Any], payload: Any, *, delay: timedelta | float | None = None) -> RemoteTx:
        q = self._queue(queue)
        return self._step(["push", q.name, q._encode(payload), _secs(delay, "delay")])

    def ack(self, queue: RemoteQueue[Any], token: Any) -> RemoteTx:
        return self._step(["ack", self._queue(queue).name, wire.token_to_wire(as_token(token))])

    def nack(self, queue: RemoteQueue[Any], token: Any, *, delay: timedelta | float | None = None,
             dead: bool = False) -> RemoteTx:
        if not isinstance(dead, bool):
            raise ConfigError("dead must be True or False")
        return self._step(["nack", self._queue(queue).name, wire.token_to_wire(as_token(token)), _secs(delay, "delay"), dead])

    def put(self, map: RemoteMap, key: Any, value: Any) -> RemoteTx:
        return self._step(["put", self._map(map).name, key, value])

    def delete(self, map: RemoteMap, key: Any) -> RemoteTx:
        return self._step(["delete", self._map(map).name, key])

    def durable(self) -> RemoteTx:
        self._durable = True
        return self

    def abort(self) -> None:
        self._steps.clear()
        self._finished = True

    def commit(self) -> list[int]:
        """Apply every step atomically at the owner; the ids of the pushes in order."""
        if self._finished:
            raise ConfigError("this transaction was already committed or aborted; start a new client.tx()")
        self._finished = True
        return list(self._client._call("tx", steps=self._steps, durable=self._durable))

    def __enter__(self) -> RemoteTx:
        return self

    def __exit__(self, et: Any, e: Any, tb: Any) -> None:
        if et is None:
            if not self._finished:
                self.commit()
        else:
            self.abort()

