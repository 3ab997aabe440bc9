"""The database: a locked directory of named collections (SPEC D1-D7).

Directory layout (docs/format.md)::

    <db>/LOCK                      owner's pid; fcntl.flock'ed while open
    <db>/db.meta                   magic, format version, CRC
    <db>/seqmap                    reserved id blocks (armdb.seqmap)
    <db>/txlog/                    transaction log (armdb.txlog)
    <db>/collections/<name>/       one folder per collection, one subfolder per shard

Lock policy: ``Db._lock`` (an ``RLock``) guards the table of open collections and
the closed flag.  It is never held while a collection does I/O, except in
``close``, which first stops the background threads.  Collections have their own
per-shard locks (see their modules).

Background threads: the flusher syncs the idle tail of every collection; the TTL
sweeper runs queue retention; the wake worker serves queue waiters.  They hold
only a weak reference to the Db so that dropping the last reference closes it.
``close`` stops them; ``shutdown`` also joins them.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _fs, replication
from ._clock import Clock, checked_clock, system_clock
from ._objdict import install_own_dict
from .bitcask import BitcaskStore
from .config import Config, TxConfig
from .errors import ConfigError, DbClosed, ProcessBound, ReplicationError, as_storage_error

# The directory's names, db.meta and the lock moved to armdb.layout; these names stay
# importable from here for the modules and tests that still import them from armdb.db.
from .layout import (  # noqa: F401
    COLLECTIONS,
    LOCK_FILE,
    META_FILE,
    NAME_RE,
    QUEUE_META,
    QUEUE_NAME_MAX,
    DbMeta,
    DirLock,
    check_meta,
    encode_meta,
    validate_name,
)
from .maps import Map
from .queue import Commits, Queue, QueueSpec, open_queue, start_queue_workers
from .seqmap import SeqMap
from .server import Server
from .tx import Tx, _fence_after_log, commit_ack_many, commit_batch, commit_dead_rows, commit_settle
from .txlog import TxLog

if TYPE_CHECKING:
    from .streams import SchemaRegistry

log = logging.getLogger("armdb")

T = TypeVar("T")

FLUSH_PERIOD = 0.05


class _Worker(threading.Thread):
    """A daemon thread calling ``tick(db)`` every ``period`` seconds until stopped."""

    def __init__(self, name: str, db: Db, period: float, tick: Callable[[Db], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._db = weakref.ref(db)
        self.period = period
        self._tick = tick
        self.stop_event = threading.Event()
        self._wake = threading.Event()

    def stop(self) -> None:
        self.stop_event.set()
        self._wake.set()

    def kick(self) -> bool:
        """Run the next tick now rather than at the end of the period; False once stopped."""
        if self.stop_event.is_set() or not self.is_alive():
            return False
        self._wake.set()
        return True

    def run(self) -> None:
        wake = self._wake
        while True:
            wake.wait(self.period)
            wake.clear()
            if self.stop_event.is_set():
                return
            db = self._db()
            if db is None or db._closed:
                return
            try:
                self._tick(db)
            except Exception:  # a background failure must not kill the thread
                log.exception("armdb: background %s failed", self.name)
            del db


_OPEN: weakref.WeakSet[Db] = weakref.WeakSet()  # every open Db of this process


def _after_fork_in_child() -> None:
    """Retire the Dbs a forked child inherited (docs/operations.md, "Processes").

    The child shares their files, mappings and directory lock with the parent but has
    none of their threads (flusher, id write ahead, a group commit's sync leader), and
    another thread may have held one of their locks at the fork.  Used, they could hang
    or overwrite the parent's pages; closed, they would release the parent's lock.  So
    they are marked closed and nothing else is touched: every call raises ``DbClosed``,
    ``close()`` is a no-op, and the parent goes on undisturbed.
    """
    for db in list(_OPEN):
        if not db._closed:
            db._closed = True
            db._closed_why = (
                f" (inherited across fork() from process {os.getppid()}: a Db belongs to the process "
                f"that opened it, and a database has one owner at a time. Let the owner serve it with "
                f"db.serve() and call armdb.connect(path) in this process, or run armdb.Worker(db, spec, "
                f"handler, processes=N) in the owner (docs/processes.md); do not Db.open the same "
                f"directory in the workers, that fails with DbLocked while the owner runs)"
            )
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Db:
    """An open armdb database directory.  Use :meth:`Db.open`."""

    def __init__(self, path: str, tx_config: TxConfig | None, schema: SchemaRegistry | None, clock: Clock | None) -> None:
        self.path = os.path.abspath(path)
        self.tx_config = tx_config or TxConfig()
        self.schema = schema
        # A user's clock is checked at every reading (a bad one raises ConfigError before
        # its value is used); the system clock is trusted.
        self.clock: Clock = system_clock if clock is None else checked_clock(clock)
        self._lock = threading.RLock()
        self._closed = True
        self._maps: dict[str, Map] = {}
        self._queues: dict[str, Queue] = {}
        self._stores: dict[str, Any] = {}
        self._workers: list[_Worker] = []
        self._dirlock: DirLock | None = None
        self._waker: Any = None
        self._closed_why = ""  # why an operation finds the Db closed, when not close()
        self._primary: replication.Primary | None = None  # db.replicate(): the stream's server
        self._servers: list[Server] = []  # db.serve(): stopped first by close()
        install_own_dict(self)  # compiled queues read and write its attributes in place

    # -- lifecycle ------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        tx_config: TxConfig | None = None,
        schema: SchemaRegistry | None = None,
        clock: Clock | None = None,
    ) -> Db:
        """Open or create the database at ``path``.

        Parameters
        ----------
        path : str or os.PathLike
            The database directory; created if missing (private to its owner, see
            docs/operations.md).  An existing directory must be empty or a database.
        tx_config : TxConfig, optional
            Transaction defaults (durability, log encryption key).
        schema : SchemaRegistry, optional
            Change streams and queue registrations.
        clock : callable, optional
            Returns wall-clock milliseconds since the Unix epoch as an ``int`` from
            2000-01-01 up to 2200-01-01; every persisted time comes from it.  It is
            called once here, and a reading of another type (a float included) or
            out of that range raises ``ConfigError`` at the call that read it.

        Raises
        ------
        DbLocked
            Another open ``Db`` (this or another process) holds the directory.
        FormatError
            The directory holds files of another kind or a newer format.
        ConfigError
            An empty path; a file, or a non-empty directory that holds no database
            (nothing is created there); a lock file that is not a regular file of
            its own; a clock that does not return plausible milliseconds.
        """
        if tx_config is not None and not isinstance(tx_config, TxConfig):
            raise ConfigError("tx_config must be an armdb.TxConfig")
        if clock is not None and not callable(clock):
            raise ConfigError("clock must be a callable returning wall-clock milliseconds")
        fspath = os.fspath(path)
        if not isinstance(fspath, str):
            raise ConfigError(f"the database path must be a str or an os.PathLike of str, not {type(fspath).__name__}")
        if not fspath:
            raise ConfigError("the database path is empty; give the directory of the database")
        db = cls(fspath, tx_config, schema, clock)
        db.clock()  # a clock that is not plausible milliseconds is refused before anything is created
        try:
            db._open()
        except OSError as e:
            raise as_storage_error(e, f"opening database {db.path!r}")
        return db

    def _open(self) -> None:
        fs = _fs.FS
        if fs.exists(self.path) and not fs.isdir(self.path):
            raise ConfigError(f"{self.path} exists and is not a directory; give armdb a directory path")
        if fs.isdir(self.path):
            if replication.is_follower(self.path):
                raise ReplicationError(
                    f"{self.path} follows a primary; promote it (Db.follow(...).promote()) before opening it"
                )
            self._refuse_foreign_directory()
        fs.makedirs(self.path)
        self._dirlock = DirLock(self.path)
        try:
            for name in (META_FILE, "seqmap"):
                tmp = os.path.join(self.path, name + ".tmp")
                if fs.exists(tmp):  # a crash between tmp write and rename
                    fs.unlink(tmp)
            meta = os.path.join(self.path, META_FILE)
            if fs.exists(meta):
                check_meta(fs.read_file(meta), meta)
            else:
                fs.write_file_atomic(meta, encode_meta())
            fs.makedirs(os.path.join(self.path, COLLECTIONS))
            self.seqmap = SeqMap(self.path)
            self.txlog = TxLog(self)
            try:
                self.txlog._open()
            except BaseException:
                self.txlog.close_file()
                raise
            self._closed = False
        except BaseException:
            self._dirlock.release()
            self._dirlock = None
            raise
        self._start_workers()
        _OPEN.add(self)

    def _refuse_foreign_directory(self) -> None:
        """D9: an existing directory becomes a database only when it is empty.  A database
        whose creation was cut short (only ``LOCK`` or ``db.meta.tmp`` written) counts as
        empty; anything else without ``db.meta`` belongs to someone else."""
        fs = _fs.FS
        if fs.exists(os.path.join(self.path, META_FILE)):
            return
        foreign = [n for n in fs.listdir(self.path) if n not in (LOCK_FILE, META_FILE + ".tmp")]
        if foreign:
            shown = ", ".join(repr(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigError(
                f"{self.path} is not empty ({shown}) and holds no armdb database (no {META_FILE}); "
                f"give armdb a new or empty directory, or the directory of an existing database"
            )

    def _start_workers(self) -> None:
        self._workers = [_Worker("armdb-flusher", self, FLUSH_PERIOD, Db._flush_tick)]
        self._workers += start_queue_workers(self, _Worker)
        for w in self._workers:
            w.start()

    def _flush_tick(self) -> None:
        with self._lock:
            stores = list(self._stores.values())
        for s in stores:
            try:
                s.sync()
            except Exception as e:  # poisoned stores refuse later writes themselves (S12)
                log.warning("armdb: background sync of %s failed: %s", getattr(s, "directory", s), e)

    def __reduce__(self) -> Any:
        raise ProcessBound(
            "a Db cannot be pickled or sent to another process: a handle belongs to the process that "
            "opened the database. Serve it (db.serve()) and call armdb.connect(path) in the other process, "
            "or send payloads and let the owning process lease and settle (docs/processes.md)"
        )

    def __enter__(self) -> Db:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:  # interpreter teardown: nothing sensible to report
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise DbClosed(f"database {self.path!r}{self._closed_why}")

    def close(self) -> None:
        """Flush every collection and release the directory lock.

        A second call is a no-op.  Background threads are told to stop; ``shutdown``
        also waits for them.  Other threads may still be using the database: each of
        their calls either completes before the close reaches its collection or raises
        ``DbClosed``.  Every store is closed under its own locks (the ones each
        operation holds while it touches the store's files and mappings) and marked
        closed, so nothing ever touches a file or mapping after it was closed.
        """
        with self._lock:
            servers, self._servers = self._servers, []
            if self._primary is not None and not self._closed:
                self._primary.release()  # commits waiting for followers (R4) return: we close
        for srv in servers:  # the calls in flight finish before the collections close (P1)
            srv.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                w.stop()
            queues = list(self._queues.values())
            stores = list(self._stores.values())
        errors: list[BaseException] = []
        for q in queues:
            try:
                q._on_db_close()
            except BaseException as e:
                errors.append(e)
        try:
            self.txlog.checkpoint()  # syncs every store, then trims the applied log
        except BaseException as e:
            errors.append(e)
        for s in stores:
            try:
                s.close()
            except BaseException as e:  # close every store even if one fails
                errors.append(e)
        # Commits that raced the checkpoint keep their records in the log (the next open
        # replays them, skipping rows the stores hold), and no commit appends once every
        # store is closed, so the log is closed without a second checkpoint.
        try:
            self.txlog.close_file()
        except BaseException as e:
            errors.append(e)
        try:
            self.seqmap.close()  # its write ahead ends before the directory lock is released
        except BaseException as e:
            errors.append(e)
        if self._primary is not None:  # after the stores: their last writes reach the followers
            try:
                self._primary.stop()
            except BaseException as e:
                errors.append(e)
        if self._dirlock is not None:
            self._dirlock.release()
            self._dirlock = None
        if errors:
            first = errors[0]
            if isinstance(first, OSError):
                raise as_storage_error(first, f"closing database {self.path!r}")
            raise first

    # -- replication (docs/replication.md) ------------------------------------------------
    def replicate(self, listen: tuple[str, int]) -> tuple[str, int]:
        """Serve this database's writes to followers (``Db.follow``) on ``listen``.

        Call it right after ``Db.open``, before opening any queue or map: from here on
        every write of every store is recorded, in order, for the followers.

        Parameters
        ----------
        listen : (str, int)
            The address to listen on, e.g. ``("127.0.0.1", 7070)``; port 0 picks a free one.

        Returns
        -------
        (str, int)
            The address listened on.

        Raises
        ------
        ConfigError
            A collection is already open, the database already replicates, or the
            address cannot be listened on.
        """
        with self._lock:
            self.check_open()
            if self._primary is not None:
                raise ConfigError(f"{self.path} already replicates on {self._primary.address}")
            if self._maps or self._queues or self._stores:
                raise ConfigError("call db.replicate() right after Db.open, before opening any queue or map")
            self._primary = replication.start_primary(self.path, self.txlog.db_id, listen,
                                                      self.tx_config.replicas)
            return self._primary.address

    def replication_status(self) -> dict[str, Any]:
        """The primary's side of replication; ``{}`` when the database does not replicate.

        ``seq`` (the last recorded operation), ``address``, ``sync_replicas``,
        ``stream_bytes`` (sent so far), ``backlog_bytes`` (kept for followers to resume
        from), and ``followers``: one dict per connected follower with its ``address``,
        ``phase`` (``snapshot`` or ``delta`` while it copies, then ``streaming``),
        ``acked_seq`` (what it has on disk), ``lag_frames``, ``lag_bytes`` (stream bytes it
        does not have on disk yet) and ``lag_seconds`` (the age of the oldest operation it
        does not have on disk; 0 when caught up).  After ``close`` it still says where the
        stream ended.  docs/replication.md, "Monitoring"."""
        primary = self._primary
        return {} if primary is None else primary.status()

    @classmethod
    def follow(cls, path: str | os.PathLike[str], *, primary: tuple[str, int]) -> replication.Follower:
        """Make ``path`` a follower of the primary at ``primary`` (``db.replicate``).

        A new directory first copies the primary's files; an existing follower resumes
        from its persisted position.  ``follower.promote()`` turns it into a writable
        ``Db``.

        Raises
        ------
        ReplicationError
            The address does not answer as an armdb primary, or ``path`` is a database
            of its own.
        ReplicaMismatch
            The primary is another database than the one ``path`` follows.
        ReplicationFrameError
            The primary speaks another replication version, or sent a damaged frame.
        """
        return replication.Follower(os.fspath(path), primary, cls.open)

    def shutdown(self) -> None:
        """Close, then join the background threads (flusher, TTL sweeper, wake worker)."""
        self.close()
        current = threading.current_thread()
        for w in self._workers:
            if w is not current and w.is_alive():
                w.join()

    # -- collections --------------------------------------------------------------------
    def collection_dir(self, name: str) -> str:
        return os.path.join(self.path, COLLECTIONS, name)

    def is_queue_dir(self, name: str) -> bool:
        return _fs.FS.exists(os.path.join(self.collection_dir(name), QUEUE_META))

    def gsn(self) -> int:
        """Next global sequence number for a Bitcask record."""
        return self.seqmap.next("gsn")

    def open_bitcask(self, name: str, config: Config, *, register: bool = True) -> BitcaskStore:
        """Open the Bitcask store behind a map or a var queue's payload (internal).

        Logged rows still owed to this collection (it is encrypted, so replay at
        open had to wait for its key) are applied before it is returned.
        """
        # Every gsn on disk is below the block reserved in seqmap (T5): refuse anything else.
        # The gsn source: what gsn() returns, without its frame (every Bitcask write draws one).
        gsn = self.seqmap.drawer("gsn")
        store = BitcaskStore.open(self.collection_dir(name), config, gsn, gsn_limit=self.seqmap.reserved("gsn"))
        try:
            self.seqmap.advance("gsn", store.max_gsn)
            txlog = getattr(self, "txlog", None)
            if register and txlog is not None:
                for key, value, gsn in txlog.take_pending(name):
                    store.apply(key, value, gsn)
        except BaseException:
            store.close()
            raise
        if register:
            self.register_store(name, store)
        return store

    def sync_all_stores(self) -> None:
        """fsync/msync every open collection (log checkpoint)."""
        with self._lock:
            stores = list(self._stores.values())
        for s in stores:
            s.sync_now()

    def register_store(self, name: str, store: Any) -> None:
        store.set_kick(self._kick_flusher)
        with self._lock:
            self._stores[name] = store

    def _kick_flusher(self) -> bool:
        """Wake the flusher: a store found a timed sync due and leaves it to the flusher's
        thread.  False when no flusher runs (opening, closed): the store syncs itself."""
        workers = self._workers
        return bool(workers) and workers[0].kick()

    def open_map(self, name: str, config: Config | None = None) -> Map:
        """Open (or create) the Bitcask map ``name`` (D3).

        Opening a name that is already open returns the same handle.

        Raises
        ------
        ConfigError
            Invalid name, a name used by a queue, or a config that is not a built ``Config``.
        """
        self.check_open()
        validate_name(name)
        if config is not None and not isinstance(config, Config):
            raise ConfigError("open_map takes a built Config: Config.balanced()...build()")
        with self._lock:
            self.check_open()
            if name in self._maps:
                return self._maps[name]
            if name in self._queues or self.is_queue_dir(name):
                raise ConfigError(f"{name!r} is a queue; a queue's collections cannot be opened as maps")
            try:
                store = self.open_bitcask(name, config or Config())
            except OSError as e:
                raise as_storage_error(e, f"opening map {name!r}")
            stream = self.schema is not None and self.schema.is_source(name)
            m = Map(store, self.check_open, name=name, stream_source=stream)
            self._maps[name] = m
            return m

    def open_queue(self, spec: QueueSpec[T], config: Any = None) -> Queue[T]:
        """Open (or create) the queue declared by ``spec`` (Q2).  See :class:`armdb.Queue`."""
        # A var queue's ack and nack are logged commits (Q14): the queue gets them from
        # here, the one module that knows both the queue and the transaction.
        return open_queue(self, spec, config, Commits(commit_settle, commit_dead_rows, commit_batch, _fence_after_log,
                                                     commit_ack_many))

    def serve(self, path: str | os.PathLike[str] | None = None) -> Server:
        """Serve this database to other processes of the same user (P1).

        Starts a :class:`armdb.server.Server` on a Unix socket, by default
        ``DIR/armdb.sock`` (mode 0600); clients use ``armdb.connect(DIR)``.  The server
        calls this Db's own queues, maps and transactions.  ``server.close()`` stops it;
        closing the Db stops it too.

        Raises
        ------
        ConfigError
            The socket cannot be created there, or another process serves that path.
        DbClosed
            The database is closed.
        """
        self.check_open()
        srv = Server(self, None if path is None else os.fspath(path))
        with self._lock:
            if self._closed:
                srv.close()
                self.check_open()
            self._servers.append(srv)
        return srv

    def tx(self) -> Any:
        """Start a transaction builder (T1)."""
        if self._closed:
            self.check_open()  # raises DbClosed
        return Tx(self)

    def stats(self) -> dict[str, Any]:
        """Stats of every open collection, by name (D4)."""
        self.check_open()
        with self._lock:
            maps = dict(self._maps)
            queues = dict(self._queues)
        out: dict[str, Any] = {name: m.stats() for name, m in maps.items()}
        out.update({name: q.stats() for name, q in queues.items()})
        return out

    def sweep_expired_now(self) -> None:
        """Run one retention pass over every open queue; raises what it hit (D4, Q24)."""
        self.check_open()
        with self._lock:
            queues = list(self._queues.values())
        for q in queues:
            q._sweep(raise_errors=True)
