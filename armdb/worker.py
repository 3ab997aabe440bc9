"""``armdb.Worker``: a worker loop over a queue, in threads or in child processes (SPEC P6).

The loop leases in batches, calls the handler for each lease, acks on return and nacks on
an exception (logged with its traceback).  A heartbeat thread extends every lease the
worker holds (running or waiting in its batch) every ``lease_timeout / 3``, so a handler
that runs longer than the lease timeout is not delivered twice while its worker lives.
``stop()`` (or SIGTERM/SIGINT while ``run()`` runs in the main thread) stops leasing, lets
running handlers finish, and releases the leases not yet started at once
(``release_many``): ready again at once, their attempt not counted, since no handler saw
them.

With ``processes=N`` the handlers run in N child processes started with the ``spawn``
method (never ``fork``: a forked child would inherit the owner's database and sockets),
each connected to the owner as a :class:`armdb.client.Client` and running this loop with
``threads`` threads.  A source ``Db`` is served for them (``db.serve()``) if it is not
served already.  The handler must be importable by name (a module-level function).

Through a client a thread asks for its next batch as a batch starts.  The leases of that
batch are held (extended by the heartbeat) as soon as their reply is in, whether the
heartbeat or the thread that asked reads it first: a long batch does not let them expire.

Lock policy: ``Worker._lock`` guards the held leases, the batches asked for ahead and the
counters; it is never held while calling the queue.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import signal
import threading
import time
import typing
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._clock import to_seconds
from .client import Client
from .errors import ArmdbError, ConfigError, DbClosed, QueueAlreadyOpen, StaleToken
from .qspec import QueueSpec
from .queue import Lease, LeaseToken

__all__ = ["Worker"]

log = logging.getLogger("armdb")

IDLE_WAIT = 0.25  # seconds a thread waits for a due row before it looks at the stop flag again
ACK_WITHIN = 0.02  # seconds a returned handler's ack may wait to go out with the next lease


class _Ahead:
    """A lease batch asked for ahead through a client (the calls in flight) and the acks
    its request carries; ``held`` once the heartbeat has taken its leases in."""

    __slots__ = ("calls", "acks", "held")

    def __init__(self, calls: list[Any], acks: list[Lease[Any]]) -> None:
        self.calls = calls
        self.acks = acks
        self.held = False


def _takes_lease(handler: Callable[..., Any]) -> bool:
    """Whether the handler's first parameter is annotated ``armdb.Lease`` (or ``Lease[T]``)."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    try:
        hints = typing.get_type_hints(handler)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: not a Lease
        hints = {}
    ann = hints.get(params[0].name, params[0].annotation)
    return ann is Lease or typing.get_origin(ann) is Lease or ann == "Lease" or (
        isinstance(ann, str) and ann.split("[")[0] in ("Lease", "armdb.Lease"))


class Worker:
    """Run ``handler`` over the queue ``spec`` of ``source`` (a ``Db`` or a ``Client``).

    Parameters
    ----------
    source : Db or Client
        Where the queue is: an open ``Db`` (its owner) or ``armdb.connect(...)``.
    spec : QueueSpec
        The queue, as declared with ``armdb.queue``.
    handler : callable
        Called with the payload, or with the ``Lease`` when its first parameter is
        annotated ``armdb.Lease``.  Returning acks; raising nacks (with backoff).
    processes : int
        0: run the handlers in this process.  N: in N child processes.
    threads : int
        Handler threads (per process).
    batch : int
        Rows leased at once by each thread.
    heartbeat : float or timedelta, optional
        Seconds between lease extensions; default ``lease_timeout / 3``.
    """

    def __init__(self, source: Any, spec: QueueSpec[Any], handler: Callable[..., Any], *, processes: int = 0,
                 threads: int = 1, batch: int = 16, heartbeat: timedelta | float | None = None) -> None:
        if not isinstance(spec, QueueSpec):
            raise ConfigError("Worker takes the QueueSpec returned by armdb.queue(...)")
        if not callable(handler):
            raise ConfigError("handler must be callable: handler(payload) or handler(lease: armdb.Lease)")
        for name, v, low in (("processes", processes, 0), ("threads", threads, 1), ("batch", batch, 1)):
            if type(v) is not int or v < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {v!r}")
        if not hasattr(source, "open_queue"):
            raise ConfigError("source must be an open armdb.Db or an armdb.connect(...) client")
        self.source = source
        self.spec = spec
        self.handler = handler
        self.processes = processes
        self.threads = threads
        self.batch = batch
        self._heartbeat = None if heartbeat is None else to_seconds(heartbeat, "heartbeat")
        if self._heartbeat is not None and self._heartbeat <= 0:
            raise ConfigError(f"heartbeat must be positive, got {heartbeat!r}")
        self._pass_lease = _takes_lease(handler)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._held: dict[LeaseToken, Lease[Any]] = {}
        self._aheads: list[_Ahead] = []
        self.done = 0  # handlers that returned (acked)
        self.failed = 0  # handlers that raised (nacked)
        self._thread: threading.Thread | None = None
        self._mp_stop: Any = None
        self._mp_counts: Any = None
        self.error: BaseException | None = None
        self._live: Any = None  # a child's share of the parent's counters

    # -- control ------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop leasing; running handlers finish, leases not yet started are released."""
        self._stop.set()
        if self._mp_stop is not None:
            self._mp_stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> Worker:
        """Run the loop in a background thread; :meth:`join` waits for it."""
        if self._thread is not None:
            raise ConfigError("this Worker was already started")
        self._thread = threading.Thread(target=self._run_catching, name="armdb-worker", daemon=True)
        self._thread.start()
        return self

    def _run_catching(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - kept for join()
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        """Wait for a started worker; re-raises what stopped it, if anything."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error

    def counts(self) -> tuple[int, int]:
        """(acked, nacked) so far, over every process."""
        if self._mp_counts is not None:
            return int(self._mp_counts[0]), int(self._mp_counts[1])
        with self._lock:
            return self.done, self.failed

    def run(self) -> None:
        """Run until :meth:`stop`, SIGTERM or SIGINT (the signals only when called in the
        main thread), then drain and return."""
        restore: list[tuple[signal.Signals, Any]] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                restore.append((sig, signal.signal(sig, lambda *_: self.stop())))
        try:
            if self.processes:
                self._run_processes()
            else:
                self._run_threads(_open(self.source, self.spec))
        finally:
            for sig, old in restore:
                signal.signal(sig, old)

    # -- in this process ----------------------------------------------------------------
    def _run_threads(self, q: Any) -> None:
        beat = self._heartbeat or max(0.001, q.config.lease_timeout / 3)
        hb = threading.Thread(target=self._heartbeat_loop, args=(q, beat), name="armdb-heartbeat", daemon=True)
        workers = [threading.Thread(target=self._loop, args=(q,), name=f"armdb-worker-{i}", daemon=True)
                   for i in range(self.threads)]
        hb.start()
        for t in workers:
            t.start()
        try:
            while any(t.is_alive() for t in workers):
                for t in workers:
                    t.join(0.2)
        finally:
            self._stop.set()
            hb.join()

    def _loop(self, q: Any) -> None:
        # The acks of handlers that returned wait for the next lease, which carries them
        # (through a client: ack_many and lease in one write, one round trip per batch),
        # but never longer than ACK_WITHIN: a slow handler's ack goes out before the next
        # handler starts.  Through a client the next batch is asked for as a batch starts,
        # so its round trip (a commit of the acks at the owner, under load a millisecond or
        # more: half a batch of 1 ms handlers was not always enough) is not waited for.
        acks: list[Lease[Any]] = []
        since = 0.0
        send_ahead = getattr(q, "_ack_many_and_lease_send", None)
        ahead: _Ahead | None = None
        try:
            while not self._stop.is_set():
                if ahead is not None:
                    leases = self._lease_ahead(q, ahead)
                    ahead = None
                else:
                    leases = self._ack_and_lease(q, acks)
                    acks = []
                if not leases:
                    # Nothing due: the acks still held go out now, not after the wait.
                    self._ack(q, acks)
                    acks = []
                    q.wait_due_timeout(IDLE_WAIT)
                    continue
                with self._lock:
                    for lz in leases:
                        self._held[lz.token] = lz
                for i, lz in enumerate(leases):
                    if self._stop.is_set():
                        self._release(q, leases[i:])
                        break
                    if acks and time.monotonic() - since >= ACK_WITHIN:
                        self._ack(q, acks)
                        acks = []
                    if i == 0 and send_ahead is not None:
                        ahead = _Ahead(send_ahead(acks, self.batch), acks)
                        with self._lock:
                            self._aheads.append(ahead)
                        acks = []
                    if self._handle(q, lz):
                        if not acks:
                            since = time.monotonic()
                        acks.append(lz)
            if ahead is not None:  # leased ahead, never started: given back
                self._release(q, self._lease_ahead(q, ahead))
            self._ack(q, acks)
        except DbClosed:
            if not self._stop.is_set():
                log.warning("armdb worker: the queue %s closed under the worker; stopping", self.spec.name)
            self._stop.set()
        except Exception:
            log.exception("armdb worker: the loop over queue %s failed; stopping", self.spec.name)
            self._stop.set()

    def _lease_ahead(self, q: Any, ahead: _Ahead) -> list[Lease[Any]]:
        try:
            stale, leases = q._ack_many_and_lease_wait(ahead.calls)
        finally:
            with self._lock:
                self._aheads.remove(ahead)
        if ahead.acks:
            self._acked(q, ahead.acks, stale)
        return leases  # type: ignore[no-any-return]

    def _hold_ahead(self, q: Any) -> list[Lease[Any]]:
        """Hold the leases of the batches asked for ahead whose replies are in (the
        heartbeat; the reply is read by whoever waits on the connection first)."""
        with self._lock:
            ready = [a for a in self._aheads if not a.held and q._calls_done(a.calls)]
        new: list[Lease[Any]] = []
        for a in ready:
            try:
                _, leases = q._ack_many_and_lease_wait(a.calls)  # replies in: no wait
            except ArmdbError:
                continue  # the thread that asked meets the error
            with self._lock:
                if a in self._aheads:  # else that thread holds them already
                    a.held = True
                    for lz in leases:
                        self._held[lz.token] = lz
                    new += leases
        return new

    def _ack_and_lease(self, q: Any, acks: list[Lease[Any]]) -> list[Lease[Any]]:
        """Ack ``acks`` and lease the next batch: through a client, both requests in one
        write; unless stopping (then only the acks)."""
        if self._stop.is_set():
            self._ack(q, acks)
            return []
        pipelined = getattr(q, "_ack_many_and_lease", None)
        if pipelined is None or not acks:
            self._ack(q, acks)
            return q.lease(self.batch)  # type: ignore[no-any-return]
        stale, leases = pipelined(acks, self.batch)
        self._acked(q, acks, stale)
        return leases  # type: ignore[no-any-return]

    def _handle(self, q: Any, lz: Lease[Any]) -> bool:
        """Run the handler on one lease: True when it returned (to be acked); an
        exception nacks the lease at once."""
        try:
            self.handler(lz if self._pass_lease else lz.payload)
        except Exception:
            log.exception("armdb worker: the handler failed on row %d of queue %s (attempt %d); nacked it",
                          lz.id, self.spec.name, lz.attempt)
            self._settle(q, lz, False)
            return False
        return True

    def _ack(self, q: Any, acks: list[Lease[Any]]) -> None:
        if not acks:
            return
        try:
            q.ack_many(acks)
        except StaleToken as e:
            self._acked(q, acks, e)
            return
        self._acked(q, acks, None)

    def _acked(self, q: Any, acks: list[Lease[Any]], stale: BaseException | None) -> None:
        """Count a batch's acks; when ``ack_many`` refused it (all or nothing: a lease in
        it was lost), ack each alone, so only the lost ones are not acked."""
        if stale is not None:
            for lz in acks:
                self._settle(q, lz, True)
            return
        with self._lock:
            for lz in acks:
                self._held.pop(lz.token, None)
            self.done += len(acks)
        live = self._live
        if live is not None:
            with live.get_lock():
                live[0] += len(acks)

    def _settle(self, q: Any, lz: Lease[Any], ack: bool) -> None:
        with self._lock:
            self._held.pop(lz.token, None)
        try:
            if ack:
                q.ack(lz)
            else:
                q.nack(lz)
        except StaleToken as e:
            log.warning("armdb worker: row %d of queue %s was no longer leased to this worker when it was "
                        "%s (%s)", lz.id, self.spec.name, "acked" if ack else "nacked", e)
            return
        with self._lock:
            if ack:
                self.done += 1
            else:
                self.failed += 1
        live = self._live
        if live is not None:
            with live.get_lock():
                live[0 if ack else 1] += 1

    def _release(self, q: Any, leases: list[Lease[Any]]) -> None:
        """Give back leases not started: ready again at once, the attempt not counted."""
        with self._lock:
            for lz in leases:
                self._held.pop(lz.token, None)
        if not leases:
            return
        try:
            q.release_many(leases)  # one request through a client
        except StaleToken:
            # Through a client, one lease this connection no longer holds (lost to another
            # worker) refuses the batch: the others are released one by one.
            for lz in leases:
                try:
                    q.release_many([lz])
                except (StaleToken, DbClosed):
                    pass
        except DbClosed:
            pass  # the owner went: its leases are released with the connection

    def _heartbeat_loop(self, q: Any, beat: float) -> None:
        while not self._stop.wait(beat):
            if self._aheads:
                self._hold_ahead(q)
            with self._lock:
                held = list(self._held.values())
            if not self._extend(q, held):
                return
            # The extends read the replies of batches asked for ahead meanwhile: hold and
            # extend those now rather than a beat later.
            if self._aheads and not self._extend(q, self._hold_ahead(q)):
                return

    def _extend(self, q: Any, leases: list[Lease[Any]]) -> bool:
        """Extend ``leases`` (a lease settled or lost meanwhile is skipped); False when the
        queue can no longer be used."""
        many = getattr(q, "_extend_many", None)
        if many is not None and leases:  # through a client: every extend in one write
            try:
                many(leases, None)
            except ArmdbError:
                return False
            return True
        for lz in leases:
            try:
                q.extend(lz)
            except StaleToken:
                pass  # settled meanwhile (or lost: its ack will say so)
            except ArmdbError:
                return False
        return True

    # -- child processes ------------------------------------------------------------------
    def _socket_path(self) -> tuple[str, Any]:
        src = self.source
        if isinstance(src, Client):
            return src.path, None
        servers = [s for s in getattr(src, "_servers", []) if not s.closed]
        if servers:
            return servers[0].path, None
        srv = src.serve()
        return srv.path, srv

    def _run_processes(self) -> None:
        path, own = self._socket_path()
        ctx = multiprocessing.get_context("spawn")
        self._mp_stop = ctx.Event()
        self._mp_counts = ctx.Array("q", 2, lock=True)
        if self._stop.is_set():
            self._mp_stop.set()
        procs = [ctx.Process(target=_child, name=f"armdb-worker-{i}", daemon=True,
                             args=(path, self.spec, self.handler, self.threads, self.batch, self._heartbeat,
                                   self._mp_stop, self._mp_counts))
                 for i in range(self.processes)]
        try:
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):
                if self._stop.is_set():
                    self._mp_stop.set()
                for p in procs:
                    p.join(0.1)
        finally:
            self._mp_stop.set()
            for p in procs:
                p.join()
            if own is not None:
                own.close()
        bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
        if bad and not self._stop.is_set():
            raise ArmdbError(f"{len(bad)} worker process(es) exited with status {bad}; see their log above")


def _open(source: Any, spec: QueueSpec[Any]) -> Any:
    """The queue ``spec`` of ``source``: opened, or the handle its owner already has."""
    try:
        return source.open_queue(spec)
    except QueueAlreadyOpen:
        q = source._queues.get(spec.name)  # the Db's table of open queues: share its handle
        if q is None or q.spec.fingerprint != spec.fingerprint:
            raise
        return q


def _child(path: str, spec: QueueSpec[Any], handler: Callable[..., Any], threads: int, batch: int,
           heartbeat: float | None, stop: Any, counts: Any) -> None:
    """A worker process: connect, run the loop until the parent says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop (a Ctrl-C reaches both)
    with Client(path) as client:
        w = Worker(client, spec, handler, threads=threads, batch=batch, heartbeat=heartbeat)
        signal.signal(signal.SIGTERM, lambda *_: w.stop())
        def watch() -> None:
            stop.wait()
            w.stop()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        w._live = counts
        w._run_threads(client.open_queue(spec))
