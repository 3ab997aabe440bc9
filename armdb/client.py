"""``armdb.connect``: use a database that another process owns and serves (SPEC P2-P5).

A :class:`Client` holds one Unix socket to the owner's server (armdb.server) and one
reader thread that matches replies to requests by id, so any number of threads may share
a client and have requests in flight at once (pipelining).  A call waits at most the
client's ``timeout`` for its reply (a wait for a due row: its own timeout plus that); when
the server is gone (the socket closed, or no reply in time) every call in flight and
every later one raises :class:`armdb.errors.ServerGone`, a ``DbClosed``, and the
connection is closed, which releases its leases at the server.

Payloads are encoded here, with the codec of the client's own ``QueueSpec``, and decoded
here from the bytes the server sends; errors come back as their own ``armdb.errors``
class with the server's message.

Lock policy: ``Client._wlock`` serialises frames written to the socket; ``Client._lock``
guards the table of pending requests and the closed flag.  Neither is held while waiting
for a reply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import socket
import threading
import time
import weakref
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import numpy as np

from . import wire
from ._clock import ms_to_datetime, to_seconds
from .config import QueueConfig
from .errors import ConfigError, NotALease, PayloadTypeError, ServerGone
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
        self._wlock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._why = ""
        self._queues: dict[str, RemoteQueue[Any]] = {}
        self._maps: dict[str, RemoteMap] = {}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
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
            hello = self._read_frame(sock)
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
        sock.settimeout(None)
        self.server_pid = int(hello.get("pid", 0))
        self._sock = sock
        self._reader = threading.Thread(target=self._read_loop, name="armdb-client", daemon=True)
        self._reader.start()
        _CLIENTS.add(self)

    # -- frames --------------------------------------------------------------------------
    @staticmethod
    def _read_exact(sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionResetError("the server closed the connection")
            got += k
        return bytes(buf)

    def _read_frame(self, sock: socket.socket) -> Any:
        n = wire.length_of(self._read_exact(sock, 4))
        return wire.unpack(self._read_exact(sock, n) if n else b"")

    def _read_loop(self) -> None:
        why = "the server closed the connection (the owner exited, crashed or closed the database)"
        try:
            while True:
                reply = self._read_frame(self._sock)
                if not (isinstance(reply, list) and len(reply) == 3 and type(reply[0]) is int):
                    why = "the server sent a malformed reply"
                    return
                with self._lock:
                    fut = self._pending.pop(reply[0], None)
                if fut is None:
                    continue  # a reply to a request that timed out
                try:
                    if reply[1] == wire.OK:
                        fut.set_result(reply[2])
                    else:
                        fut.set_exception(wire.error_from_wire(reply[2]))
                except concurrent.futures.InvalidStateError:
                    pass  # cancelled by its caller (an asyncio task awaiting due() was cancelled)
        except (OSError, BadFrame) as e:
            if not self._closed:
                why = f"the connection to the server broke ({e})"
        finally:
            self._shut(why)

    def _shut(self, why: str) -> None:
        with self._lock:
            if not self._why:
                self._why = why
            self._closed = True
            pending, self._pending = self._pending, {}
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for fut in pending.values():
            try:
                fut.set_exception(self._gone())
            except concurrent.futures.InvalidStateError:
                pass  # cancelled by its caller

    def _gone(self) -> ServerGone:
        return ServerGone(f"the armdb client of {self.path} is closed: {self._why}; connect again once the "
                          f"owner serves the database")

    def _submit(self, op: str, **args: Any) -> concurrent.futures.Future[Any]:
        """Send one request; its reply resolves the returned future (pipelining)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise self._gone()
            rid = next(self._ids)
            self._pending[rid] = fut
        try:
            data = wire.frame([rid, op, args])
        except BaseException:  # too large, or a value msgpack cannot carry: nothing was sent
            with self._lock:
                self._pending.pop(rid, None)
            raise
        try:
            with self._wlock:
                self._sock.sendall(data)
        except OSError as e:
            self._shut(f"the connection to the server broke ({e})")
            raise self._gone() from None
        return fut

    def _result(self, fut: concurrent.futures.Future[Any], extra: float = 0.0) -> Any:
        try:
            return fut.result(self.timeout + extra)
        except concurrent.futures.TimeoutError:
            self._shut(f"the server did not answer within {self.timeout:g} s")
            raise self._gone() from None

    def _call(self, op: str, **args: Any) -> Any:
        return self._result(self._submit(op, **args))

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the connection; the server releases every lease it still holds."""
        self._shut("close() was called")
        if self._reader is not threading.current_thread():
            self._reader.join(5.0)
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
            self._encode = codec.encode
            self._decode = codec.decode
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
        return list(self._call("push_many", ps=[self._encode(p) for p in payloads], delay=d))

    def lease_batch(self, n: int = 1, *, lease_timeout: timedelta | float | None = None) -> LeaseBatch[T]:
        """Lease like :meth:`lease`, in one reply of arrays: a :class:`armdb.LeaseBatch`."""
        if type(n) is not int or n < 1:
            raise ConfigError(f"lease_batch(n) needs an int n >= 1, got {n!r}")
        got = self._call("lease_batch", n=n, lease_timeout=_secs(lease_timeout, "lease_timeout"))
        if got is None:
            e = np.empty(0, dtype=np.uint64)
            payloads: Any = [] if self.spec.var else np.empty(0, dtype=self.spec.dtype)
            return LeaseBatch(self.name, 0, e.astype(np.uint32), e, e, e.astype(np.uint16), e.astype(np.uint32),
                              (0, ms_to_datetime(0)), payloads)
        handle, shards, dues, ids, attempts, epochs, deadline, raw = got
        if self.spec.var:
            payloads = [self._decode(p) for p in raw]
        else:
            payloads = np.frombuffer(raw, dtype=self.spec.dtype).copy()
        return LeaseBatch(self.name, int.from_bytes(handle, "big"), np.frombuffer(shards, "<u4").astype(np.uint32),
                          np.frombuffer(dues, "<u8").astype(np.uint64), np.frombuffer(ids, "<u8").astype(np.uint64),
                          np.frombuffer(attempts, "<u2").astype(np.uint16),
                          np.frombuffer(epochs, "<u4").astype(np.uint32), (deadline, ms_to_datetime(deadline)),
                          payloads)

    def _leases(self, rows: list[Any]) -> list[Lease[T]]:
        out: list[Lease[T]] = []
        dl: tuple[int, datetime] | None = None
        for rid, raw, attempt, deadline, tok in rows:
            if dl is None or dl[0] != deadline:
                dl = (deadline, ms_to_datetime(deadline))
            out.append(Lease(rid, self._decode(raw), attempt, dl[1], LeaseToken(*wire.token_fields(tok))))
        return out

    def lease(self, n: int = 1, *, lease_timeout: timedelta | float | None = None) -> list[Lease[T]]:
        if type(n) is not int or n < 1:
            raise ConfigError(f"lease(n) needs an int n >= 1, got {n!r}")
        return self._leases(self._call("lease", n=n, lease_timeout=_secs(lease_timeout, "lease_timeout")))

    def ack(self, token: Lease[T] | LeaseToken) -> None:
        self._call("ack", t=wire.token_to_wire(as_token(token)))

    def ack_many(self, leases: Any) -> int:
        """Ack a :class:`armdb.LeaseBatch`, or a sequence of Leases or tokens, in one request
        and one commit, all or nothing (as ``Queue.ack_many``); how many were acked."""
        if isinstance(leases, LeaseBatch):
            return int(self._call("ack_many", tb=[
                leases._handle.to_bytes(16, "big"), leases._shards.astype("<u4").tobytes(),
                leases._dues.astype("<u8").tobytes(), leases.ids.astype("<u8").tobytes(),
                leases._epochs.astype("<u4").tobytes()]))
        if isinstance(leases, (Lease, LeaseToken)) or not hasattr(leases, "__iter__"):
            raise NotALease(f"ack_many takes a LeaseBatch or a sequence of Leases or tokens, "
                            f"not {type(leases).__name__}")
        return int(self._call("ack_many", ts=[wire.token_to_wire(as_token(t)) for t in leases]))

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
        """Resolve when a row is due (advisory); ``ServerGone`` when the owner goes."""
        c = self._client
        step = min(self.config.wakeup_recheck, c.timeout)
        while True:
            fut = c._submit("wait_due", q=self.name, timeout=step)
            try:
                got = await asyncio.wait_for(asyncio.wrap_future(fut), step + c.timeout)
            except TimeoutError:
                c._shut(f"the server did not answer within {c.timeout:g} s")
                raise c._gone() from None
            if got:
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

