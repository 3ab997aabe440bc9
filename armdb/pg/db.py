"""``armdb.pg.connect``: a database of queues and maps on PostgreSQL (SPEC G1-G7).

:class:`PgDb` holds a psycopg connection pool, the namespace's collections and one
listener thread (started at the first wait) that LISTENs on the channels of the queues
that have waiters and wakes them when a push or a nack from any process commits.
:class:`PgTx` is ``db.tx()``: queue pushes, acks and nacks and map writes in one SQL
transaction, with the change streams of the ``SchemaRegistry`` run inside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any, Self, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from .._crypto import Sealer
from ..config import Config, QueueConfig, TxConfig
from ..errors import (
    ArmdbError,
    ConfigError,
    DbClosed,
    EncryptionKeyRequired,
    FormatError,
    QueueAlreadyOpen,
    QueueFull,
    SchemaMismatch,
    StaleToken,
    StorageError,
    StreamSourceRequiresTx,
)
from ..layout import validate_name
from ..mapcodec import decode_key, decode_value, encode_key, encode_value
from ..qspec import FixedCodec, QueueSpec, VarCodec, evolve
from ..queue import Lease, LeaseToken, as_token, nack_args, queue_args
from ..streams import Change, SchemaRegistry
from . import schema
from .queue import PgQueue
from .schema import one

log = logging.getLogger("armdb")

__all__ = ["PgDb", "PgMap", "PgTx", "connect"]

T = TypeVar("T")

DEFAULT_POOL_SIZE = 4
# A map key is a btree index entry, which PostgreSQL caps near 2,700 bytes.
MAX_MAP_KEY = 2000


def _storage_error(e: BaseException, what: str) -> StorageError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    err = StorageError(5, f"{what} failed: {msg}; check that the PostgreSQL server is running and reachable, "
                          f"then retry (a write in flight may or may not have committed)")
    err.__cause__ = e
    return err


def _describe(dsn: str) -> str:
    """Where a DSN points, for messages: host, port, database and user, never the password."""
    try:
        info = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "the DSN given"
    return " ".join(f"{k}={info[k]}" for k in ("host", "port", "dbname", "user") if info.get(k)) or "the default server"


def connect(dsn: str, *, namespace: str = "armdb", tx_config: TxConfig | None = None,
            schema: SchemaRegistry | None = None, pool_size: int = DEFAULT_POOL_SIZE) -> PgDb:
    """Open armdb's tables in PostgreSQL (SPEC G1), creating them on first use.

    Parameters
    ----------
    dsn : str
        A libpq connection string or URL, e.g. ``"host=/run/postgresql dbname=jobs"``
        or ``"postgresql://app@db.internal/jobs"``.
    namespace : str
        The PostgreSQL schema holding armdb's tables (created if missing).
    tx_config : TxConfig, optional
        ``durable=True`` makes every ``tx()`` commit with ``synchronous_commit = on``.
    schema : SchemaRegistry, optional
        Change streams, as for ``Db.open``.
    pool_size : int
        The most connections this ``PgDb`` opens at once (plus one for waiting).

    Raises
    ------
    ConfigError
        A malformed DSN or argument.
    StorageError
        The server cannot be reached or refuses the connection.
    FormatError
        The namespace was written by a newer armdb.
    """
    return PgDb(dsn, namespace=namespace, tx_config=tx_config, schema=schema, pool_size=pool_size)


class PgDb:
    """Queues and maps in one PostgreSQL namespace.  A context manager."""

    def __init__(self, dsn: str, *, namespace: str = "armdb", tx_config: TxConfig | None = None,
                 schema: SchemaRegistry | None = None, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        if not isinstance(dsn, str) or not dsn:
            raise ConfigError("dsn must be a non-empty libpq connection string, e.g. 'host=/run/postgresql dbname=x'")
        if not isinstance(namespace, str) or not 0 < len(namespace.encode()) <= schema_mod.MAX_IDENT \
                or "\0" in namespace or not namespace.isprintable():
            raise ConfigError(f"namespace must be a PostgreSQL schema name of 1 to 63 bytes, got {namespace!r}")
        if tx_config is not None and not isinstance(tx_config, TxConfig):
            raise ConfigError("tx_config takes a TxConfig(...)")
        if schema is not None and not isinstance(schema, SchemaRegistry):
            raise ConfigError("schema takes a SchemaRegistry()")
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
            raise ConfigError(f"pool_size must be an int >= 1, got {pool_size!r}")
        self.dsn = dsn
        self.namespace = namespace
        self.tx_config = tx_config or TxConfig()
        self.schema = schema
        self._closed = False
        self._lock = threading.Lock()
        self._queues: dict[str, PgQueue[Any]] = {}
        self._maps: dict[str, PgMap] = {}
        self._listener: _Listener | None = None
        try:
            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
        except psycopg.ProgrammingError as e:
            raise ConfigError(f"invalid PostgreSQL DSN: {e}; use 'key=value' pairs or a postgresql:// URL"
                              ) from None
        except psycopg.OperationalError as e:
            raise _storage_error(e, f"connecting to PostgreSQL ({_describe(dsn)})") from e
        try:
            with conn.transaction():
                conn.execute(*schema_mod.lock_namespace(namespace))
                for stmt in schema_mod.bootstrap(namespace)[:-1]:
                    conn.execute(stmt)
                conn.execute(schema_mod.bootstrap(namespace)[-1], (str(schema_mod.FORMAT_VERSION),))
                row = conn.execute(schema_mod.read_version(namespace)).fetchone()
                try:
                    version = int(row[0]) if row is not None else -1
                except (TypeError, ValueError):
                    raise FormatError(f"namespace {namespace!r}: armdb_meta.format_version is {row!r}, not a "
                                      f"number; the table was changed by hand: restore it") from None
                if version > schema_mod.FORMAT_VERSION:
                    raise FormatError(
                        f"namespace {namespace!r} has armdb format version {version}; this armdb reads up to "
                        f"{schema_mod.FORMAT_VERSION}: upgrade armdb"
                    )
        except psycopg.Error as e:
            raise _storage_error(e, f"preparing namespace {namespace!r}") from e
        finally:
            conn.close()
        self._pool = ConnectionPool(dsn, min_size=1, max_size=pool_size, kwargs={"autocommit": True}, open=False,
                                    timeout=10, name=f"armdb.pg:{namespace}")
        try:
            self._pool.open(wait=True, timeout=10)
        except PoolTimeout as e:
            self._pool.close()
            raise _storage_error(e, "opening the connection pool") from e

    # -- connections ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise DbClosed(f"this PgDb (namespace {self.namespace!r})")

    @contextlib.contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection (autocommit); psycopg's errors become ``StorageError``
        (``DbClosed`` after ``close``).  A broken connection leaves the pool and the pool's
        idle connections are checked, so the next call reconnects."""
        self.check_open()
        try:
            with self._pool.connection() as c:
                yield c
        except PoolClosed:
            raise DbClosed(f"this PgDb (namespace {self.namespace!r})") from None
        except PoolTimeout as e:
            if self._closed:
                raise DbClosed(f"this PgDb (namespace {self.namespace!r})") from None
            raise _storage_error(e, "getting a PostgreSQL connection") from e
        except psycopg.OperationalError as e:
            if self._closed:
                raise DbClosed(f"this PgDb (namespace {self.namespace!r})") from None
            with contextlib.suppress(Exception):
                self._pool.check()
            raise _storage_error(e, "a PostgreSQL call") from e
        except psycopg.errors.UndefinedTable as e:
            raise FormatError(f"an armdb table is missing in namespace {self.namespace!r} ({e}); it was dropped "
                              f"by hand: restore it from a backup") from None
        except psycopg.Error as e:
            raise _storage_error(e, "a PostgreSQL call") from e

    def _read(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run a read (no write, so safe to repeat) on a pooled connection.  A connection
        the server dropped while it sat idle in the pool (a restart) fails at its first
        use; the read is then run once more on a fresh one (G7)."""
        try:
            with self._conn() as c:
                return fn(c)
        except StorageError as e:
            cause = e.__cause__
            if not isinstance(cause, psycopg.OperationalError) or isinstance(cause, PoolTimeout):
                raise  # only a dropped connection is worth a second try, not a server that is away
        with self._conn() as c:
            return fn(c)

    # -- collections ---------------------------------------------------------------------------
    def _collection(self, c: psycopg.Connection[Any], name: str, kind: str, var: bool | None,
                    fingerprint: str | None, key: bytes | None) -> tuple[int, Any, Sealer | None, bool]:
        """Find or create the collection ``name`` (caller holds the namespace lock, in a
        transaction): its id, its stored row, its sealer, and whether it is new."""
        ns = self.namespace
        row = c.execute(schema_mod.find_collection(ns), (name,)).fetchone()
        sealer = Sealer(key) if key is not None else None
        if row is None:
            check = sealer.key_check() if sealer is not None else None
            cid = one(c.execute(schema_mod.insert_collection(ns), (name, kind, var, fingerprint, check)))[0]
            return int(cid), None, sealer, True
        cid, stored_kind, _var, _fp, _layouts, _layout, key_check = row
        if stored_kind != kind:
            raise ConfigError(f"{name!r} is already a {stored_kind} in namespace {ns!r}; a name holds one "
                              f"collection: choose another name")
        if key_check is not None and sealer is None:
            raise EncryptionKeyRequired(
                f"{kind} {name!r} is encrypted; open it with its key (Config.balanced().encryption_key(key))")
        if key_check is None and sealer is not None:
            raise ConfigError(f"{kind} {name!r} was created without encryption; it cannot be opened with a key "
                              f"(drain it into a new encrypted {kind})")
        if sealer is not None:
            sealer.verify(bytes(key_check))
        return int(cid), row, sealer, False

    def _check_columns(self, c: psycopg.Connection[Any], table: str, want: list[tuple[str, str]]) -> None:
        got = [tuple(r) for r in c.execute(schema_mod.columns_of(), (self.namespace, table)).fetchall()]
        if got != want:
            raise FormatError(
                f"table {self.namespace}.{table} has columns {got}, armdb expects {want}; it was altered by hand: "
                f"restore it from a backup"
            )

    def open_queue(self, spec: QueueSpec, config: QueueConfig | None = None) -> PgQueue[Any]:
        """Open (creating on first use) the queue ``spec`` (SPEC G1, G6).

        Raises ``ConfigError``, ``QueueAlreadyOpen``, ``SchemaMismatch``,
        ``EncryptionKeyRequired``, ``WrongKey``, ``FormatError``, ``StorageError``.
        """
        config = queue_args(spec, config)
        with self._lock:
            self.check_open()
            if spec.name in self._queues:
                raise QueueAlreadyOpen(f"queue {spec.name!r} is already open in this PgDb; share the handle you have")
            codec: FixedCodec | VarCodec = VarCodec(spec.payload) if spec.var else FixedCodec(spec.dtype)
            ns = self.namespace
            with self._conn() as c, c.transaction():
                c.execute(*schema_mod.lock_namespace(ns))
                cid, row, sealer, new = self._collection(c, spec.name, "queue", spec.var, spec.fingerprint,
                                                         config.payload_config.encryption_key)
                if row is not None:
                    stored_var, fingerprint, layouts_text, layout = row[2], row[3], row[4], int(row[5])
                    if bool(stored_var) != spec.var:
                        stored, given = ("var", "fixed") if stored_var else ("fixed", "var")
                        raise SchemaMismatch(f"queue {spec.name!r} was created as a {stored} queue and cannot be "
                                             f"opened as a {given} queue; declare it as it was created")
                    layouts = json.loads(layouts_text) if layouts_text else None
                    if fingerprint != spec.fingerprint:
                        layouts, layout = evolve(spec.name, fingerprint, layouts, spec.payload, spec.fingerprint)
                        c.execute(schema_mod.update_layouts(ns), (spec.fingerprint, json.dumps(layouts), layout, cid))
                    if layouts:
                        codec.use_layouts(layouts, layout)  # type: ignore[union-attr]
                live, dead, seq = (schema_mod.table_name(k, cid, spec.name) for k in "qds")
                if new:
                    for stmt in schema_mod.create_queue(ns, live, dead, seq):
                        c.execute(stmt)
                self._check_columns(c, live, schema_mod.LIVE_COLUMNS)
                self._check_columns(c, dead, schema_mod.DEAD_COLUMNS)
            q: PgQueue[Any] = PgQueue(self, spec, config, cid, live, dead, seq, sealer, codec)
            self._queues[spec.name] = q
            return q

    def open_map(self, name: str, config: Config | None = None) -> PgMap:
        """Open (creating on first use) the map ``name``; of ``config`` only the
        encryption key applies (the Bitcask sizing means nothing here)."""
        validate_name(name)
        if config is not None and not isinstance(config, Config):
            raise ConfigError("open_map takes a built Config: Config.balanced()...build()")
        with self._lock:
            self.check_open()
            if name in self._maps:
                return self._maps[name]
            if name in self._queues:
                raise ConfigError(f"{name!r} is open as a queue; a name holds one collection")
            ns = self.namespace
            with self._conn() as c, c.transaction():
                c.execute(*schema_mod.lock_namespace(ns))
                cid, _row, sealer, new = self._collection(c, name, "map", None, None,
                                                          config.encryption_key if config else None)
                table = schema_mod.table_name("m", cid, name)
                if new:
                    for stmt in schema_mod.create_map(ns, table):
                        c.execute(stmt)
                self._check_columns(c, table, schema_mod.MAP_COLUMNS)
            m = PgMap(self, name, cid, table, sealer)
            self._maps[name] = m
            return m

    def tx(self) -> PgTx:
        """A transaction builder (T1): one SQL transaction at ``commit()``."""
        self.check_open()
        return PgTx(self)

    def stats(self) -> dict[str, Any]:
        """Stats of every open collection, by name (queues: ``QueueStats``; maps: ``{"len": n}``)."""
        self.check_open()
        out: dict[str, Any] = {name: q.stats() for name, q in list(self._queues.items())}
        for name, m in list(self._maps.items()):
            out[name] = {"len": len(m)}
        return out

    def sweep_expired_now(self) -> None:
        """Run retention on every open queue now; raises what it hits (D4)."""
        self.check_open()
        for q in list(self._queues.values()):
            q.sweep_expired()

    # -- waiting (G4) --------------------------------------------------------------------------
    def _listen(self, q: PgQueue[Any]) -> None:
        """Make sure notifications of ``q``'s channel reach its waiters."""
        with self._lock:
            self.check_open()
            if self._listener is None:
                self._listener = _Listener(self)
                self._listener.start()
            listener = self._listener
        listener.ensure(q)

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the pool and wake every waiter with ``DbClosed``; a second close is a no-op."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
        for q in list(self._queues.values()):
            q._on_close()
        if listener is not None:
            listener.stop()
        self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and hasattr(self, "_pool"):
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        return f"<armdb.pg.PgDb namespace={self.namespace!r}{' closed' if self._closed else ''}>"


schema_mod = schema  # the module; ``schema`` is also the name of the SchemaRegistry argument


class _Listener(threading.Thread):
    """LISTENs on the channels of the queues that have waiters and wakes them when a
    notification arrives (a push, a nack or a redrive committed in any process).  Its
    connection is its own, not the pool's.  When the connection breaks it reconnects,
    LISTENs again and wakes every waiter (they recheck)."""

    def __init__(self, db: PgDb) -> None:
        super().__init__(name="armdb-pg-listen", daemon=True)
        self._dsn = db.dsn
        self._queues: dict[str, PgQueue[Any]] = {}
        self._active: set[str] = set()
        self._cv = threading.Condition()
        self._stopping = False
        # A socket pair, not a pipe: it wakes the select() below (file access goes through
        # armdb._fs, and this is no file).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)

    def ensure(self, q: PgQueue[Any], timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        with self._cv:
            self._queues[q._channel] = q
            if q._channel in self._active:
                return
            self._poke()
            while q._channel not in self._active and not self._stopping:
                left = end - time.monotonic()
                if left <= 0:
                    return  # the server is away: waits still recheck every wakeup_recheck
                self._cv.wait(left)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._poke()
        self.join(5)
        self._wake_r.close()
        self._wake_w.close()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a full buffer is a pending wakeup already
            self._wake_w.send(b"x")

    def _notified(self, n: Any) -> None:
        q = self._queues.get(n.channel if hasattr(n, "channel") else n.relname.decode())
        if q is not None:
            q._wake()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while True:
            with self._cv:
                if self._stopping:
                    break
                pending = [ch for ch in self._queues if ch not in self._active]
            try:
                reconnected = conn is None
                if conn is None:
                    conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)
                    conn.add_notify_handler(self._notified)
                    with self._cv:
                        self._active.clear()
                        pending = list(self._queues)
                for ch in pending:
                    # The gate (waiting for the commits in flight), the key that makes every
                    # later commit notify, LISTEN, and the gate let go: a commit that skipped
                    # its notification ended before this (schema.NOTIFY_IF_LISTENED).
                    q = self._queues[ch]
                    conn.execute("SELECT pg_advisory_lock(%s, %s)", q._gate_key)
                    conn.execute("SELECT pg_advisory_lock_shared(%s)", (q._listen_key,))
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(ch)))
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", q._gate_key)
                    with self._cv:
                        self._active.add(ch)
                        self._cv.notify_all()
                if reconnected:
                    # Listening again: a notification may have been missed while away, so
                    # every waiter looks again (after the LISTENs, so nothing falls between).
                    for q in list(self._queues.values()):
                        q._wake()
                wake = self._wake_r.fileno()
                ready, _, _ = select.select([conn.fileno(), wake], [], [], 1.0)
                if wake in ready:
                    self._wake_r.recv(4096)
                if conn.fileno() in ready:
                    conn.pgconn.consume_input()
                    if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
                        raise psycopg.OperationalError("the listening connection was lost")
                    while (n := conn.pgconn.notifies()) is not None:
                        self._notified(n)
            except (psycopg.Error, OSError, ValueError) as e:
                log.info("armdb.pg: the listening connection failed (%s); reconnecting", e)
                with contextlib.suppress(Exception):
                    if conn is not None:
                        conn.close()
                conn = None
                with self._cv:
                    self._active.clear()
                    if not self._stopping:
                        self._cv.wait(0.2)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


# -- maps ------------------------------------------------------------------------------------------


def _map_key(key: Any) -> bytes:
    raw = encode_key(key)
    if len(raw) > MAX_MAP_KEY:
        raise ConfigError(f"map key of {len(raw):,} bytes is longer than the {MAX_MAP_KEY:,} bytes a PostgreSQL "
                          f"map key may have; hash long keys (e.g. hashlib.sha256(key).digest())")
    return raw


class PgMap:
    """A map on PostgreSQL: ``get``, ``put``, ``delete``, ``in``, ``len``, ``items`` (D3);
    keys keep their type (armdb.mapcodec), values are msgpack (sealed when encrypted)."""

    def __init__(self, db: PgDb, name: str, coll_id: int, table: str, sealer: Sealer | None) -> None:
        self._db = db
        self.name = name
        self._sql = schema_mod.MapSQL(db.namespace, table)
        self._sealer = sealer
        self._coll_id = coll_id

    def _aad(self, raw_key: bytes) -> bytes:
        return b"armdb.pg.m\x00" + self.name.encode() + b"\x00" + raw_key

    def _seal(self, raw_key: bytes, raw_value: bytes) -> bytes:
        return raw_value if self._sealer is None else self._sealer.seal(raw_value, self._aad(raw_key))

    def _value(self, raw_key: bytes, stored: bytes) -> Any:
        raw = bytes(stored)
        if self._sealer is not None:
            raw = self._sealer.open(raw, self._aad(raw_key), what=f"map {self.name!r} value")
        return decode_value(raw)

    def _direct_write_check(self) -> None:
        schema = self._db.schema
        if schema is not None and schema.is_source(self.name):
            raise StreamSourceRequiresTx(
                f"map {self.name!r} is a change-stream source; write it inside db.tx() so its emitted jobs "
                f"commit with it")

    def get(self, key: Any, default: Any = None) -> Any:
        raw_key = _map_key(key)
        row = self._db._read(lambda c: c.execute(self._sql.get, (raw_key,)).fetchone())
        return default if row is None else self._value(raw_key, row[0])

    def put(self, key: Any, value: Any) -> None:
        self._direct_write_check()
        raw_key = _map_key(key)
        raw = self._seal(raw_key, encode_value(value))
        with self._db._conn() as c:
            c.execute(self._sql.put, (raw_key, raw))

    def delete(self, key: Any) -> bool:
        self._direct_write_check()
        raw_key = _map_key(key)
        with self._db._conn() as c:
            return c.execute(self._sql.delete, (raw_key,)).rowcount > 0

    def __contains__(self, key: object) -> bool:
        try:
            raw_key = _map_key(key)
        except ArmdbError:
            return False
        return self._db._read(lambda c: c.execute(self._sql.get, (raw_key,)).fetchone()) is not None

    def __len__(self) -> int:
        return int(self._db._read(lambda c: one(c.execute(self._sql.count))[0]))

    def items(self) -> Iterator[tuple[Any, Any]]:
        rows = self._db._read(lambda c: c.execute(self._sql.items).fetchall())
        for k, v in rows:
            yield decode_key(bytes(k)), self._value(bytes(k), v)

    def keys(self) -> Iterator[Any]:
        for k, _v in self.items():
            yield k

    def __iter__(self) -> Iterator[Any]:
        return self.keys()

    def __repr__(self) -> str:
        return f"<armdb.pg.PgMap {self.name!r}>"


# -- transactions ------------------------------------------------------------------------------------


class PgTx:
    """``db.tx()`` on PostgreSQL (T1, G2): every step recorded, then one SQL transaction at
    ``commit()``.  Change streams run inside it (T6), ``max_depth`` is judged on the net
    effect per queue (Q21), and ``durable()`` commits with ``synchronous_commit = on``."""

    __slots__ = ("_db", "_durable", "_finished", "_steps")

    def __init__(self, db: PgDb) -> None:
        self._db = db
        self._steps: list[tuple[Any, ...]] = []
        self._durable = db.tx_config.durable
        self._finished = False

    def _open_step(self) -> None:
        if self._finished:
            raise ConfigError("this transaction was already committed or aborted; start a new db.tx()")

    def _queue(self, q: object) -> PgQueue[Any]:
        if not isinstance(q, PgQueue) or q._db is not self._db:
            raise ConfigError("tx steps take a queue handle opened on this PgDb (db.open_queue)")
        return q

    def _map(self, m: object) -> PgMap:
        if not isinstance(m, PgMap) or self._db._maps.get(m.name) is not m:
            raise ConfigError("tx steps take a map handle opened on this PgDb (db.open_map)")
        return m

    def push(self, queue: PgQueue[Any], payload: Any, *, delay: timedelta | float | None = None) -> PgTx:
        self._open_step()
        q = self._queue(queue)
        self._steps.append(("push", q, q._encode(payload), q._delay_ms(delay), True))
        return self

    def ack(self, queue: PgQueue[Any], token: Lease[Any] | LeaseToken) -> PgTx:
        self._open_step()
        self._steps.append(("settle", self._queue(queue), as_token(token), True, None, False))
        return self

    def nack(self, queue: PgQueue[Any], token: Lease[Any] | LeaseToken, *, delay: timedelta | float | None = None,
             dead: bool = False) -> PgTx:
        self._open_step()
        tok = as_token(token)
        delay_ms = nack_args(delay, dead)
        self._steps.append(("settle", self._queue(queue), tok, False, delay_ms, dead))
        return self

    def put(self, map: PgMap, key: Any, value: Any) -> PgTx:
        self._open_step()
        m = self._map(map)
        self._steps.append(("map", m, key, _map_key(key), value, encode_value(value)))
        return self

    def delete(self, map: PgMap, key: Any) -> PgTx:
        self._open_step()
        m = self._map(map)
        self._steps.append(("map", m, key, _map_key(key), None, None))
        return self

    def durable(self) -> PgTx:
        """Commit with ``synchronous_commit = on`` (T3)."""
        self._open_step()
        self._durable = True
        return self

    def abort(self) -> None:
        self._steps.clear()
        self._finished = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            if not self._finished:
                self.commit()
        else:
            self.abort()

    def commit(self) -> list[int]:
        """Run every step in one SQL transaction; returns the ids of the explicit pushes
        in builder order.  ``QueueFull`` or ``StaleToken`` roll it back: nothing is written."""
        self._open_step()
        db = self._db
        db.check_open()
        self._finished = True
        steps = self._steps
        if not steps:
            return []
        for s in steps:
            if s[0] == "settle":
                s[1]._token(s[2])  # a token of another handle: StaleToken before anything runs
        registry = db.schema
        if registry is not None:
            for s in steps:
                if s[0] == "map":
                    for st in registry.streams_for(s[1].name):
                        if st.queue.name not in db._queues:
                            raise ConfigError(f"change stream {s[1].name!r} -> {st.queue.name!r}: open the queue "
                                              f"before committing writes to its source")
        settled: list[tuple[PgQueue[Any], bool, bool]] = []
        pushed: dict[PgQueue[Any], int] = {}
        with db._conn() as c, c.transaction():
            if self._durable:
                c.execute("SET LOCAL synchronous_commit = on")
            steps = self._expand_streams(c, steps, registry) if registry is not None else list(steps)
            self._judge_caps(c, steps)
            seen: set[LeaseToken] = set()
            # Settles first (in id order, so that concurrent commits lock rows in one order),
            # then pushes, then map writes: the order of builder calls does not matter (T1).
            for s in sorted((s for s in steps if s[0] == "settle"), key=lambda s: (s[1].name, s[2].seq)):
                q, tok = s[1], s[2]
                if tok in seen:
                    raise StaleToken(f"row {tok.seq} is settled twice in one transaction; nothing was written")
                seen.add(tok)
                outcome = q._tx_settle(c, tok, s[3], s[4], s[5])
                settled.append((q, s[3], outcome == "dead"))
            ids_by_step: dict[int, list[int]] = {}
            by_queue: dict[PgQueue[Any], list[int]] = {}
            for i, s in enumerate(steps):
                if s[0] == "push":
                    by_queue.setdefault(s[1], []).append(i)
            for q, idxs in by_queue.items():
                for delay in sorted({steps[i][3] for i in idxs}):
                    group = [i for i in idxs if steps[i][3] == delay]
                    ids = q._insert_many(c, [steps[i][2] for i in group], delay, judge_cap=False)
                    for i, rid in zip(group, ids, strict=True):
                        ids_by_step[i] = [rid]
                pushed[q] = len(idxs)
            # Map rows in one order (stable: a key written twice keeps its last value), so two
            # commits writing the same keys never wait on each other in a cycle.
            for s in sorted((s for s in steps if s[0] == "map"), key=lambda s: (s[1]._coll_id, s[3])):
                m, raw_key, raw_value = s[1], s[3], s[5]
                if raw_value is None:
                    c.execute(m._sql.delete, (raw_key,))
                else:
                    c.execute(m._sql.put, (raw_key, m._seal(raw_key, raw_value)))
        for q, ack, went_dead in settled:
            q._settled(ack, False, went_dead)
        for q, n in pushed.items():
            q._count("pushes", n)
            if q.spec.var:
                q._count("payload_writes", n)
        return [ids_by_step[i][0] for i, s in enumerate(steps) if s[0] == "push" and s[4]]

    def _expand_streams(self, c: psycopg.Connection[Any], steps: list[tuple[Any, ...]],
                        registry: SchemaRegistry) -> list[tuple[Any, ...]]:
        """Run the change-stream closures inside the transaction (T6): each change sees the
        state left by the steps before it; the keys written are locked (advisory locks,
        in one order) so that concurrent commits see each other's writes as ``old``."""
        sources = [s for s in steps if s[0] == "map" and registry.is_source(s[1].name)]
        for m_id, raw_key in sorted({(s[1]._coll_id, s[3]) for s in sources}):
            c.execute(schema_mod.key_lock(), (m_id, raw_key))
        view: dict[tuple[str, bytes], Any] = {}
        extra: list[tuple[Any, ...]] = []
        for s in sources:
            m, key, raw_key, value = s[1], s[2], s[3], s[4]
            k = (m.name, raw_key)
            if k in view:
                old = view[k]
            else:
                row = c.execute(m._sql.get, (raw_key,)).fetchone()
                old = None if row is None else m._value(raw_key, row[0])
            view[k] = value
            if old is None and value is None:
                continue
            for st in registry.streams_for(m.name):
                out = st.emit(Change(key, old, value))
                if out is None:
                    continue
                q = self._db._queues[st.queue.name]
                for payload in out if isinstance(out, list) else [out]:
                    extra.append(("push", q, q._encode(payload), 0, False))
        return list(steps) + extra

    @staticmethod
    def _judge_caps(c: psycopg.Connection[Any], steps: list[tuple[Any, ...]]) -> None:
        """Q21: each queue's ``max_depth`` once, on the net effect ``live - acks + pushes``."""
        net: dict[PgQueue[Any], list[int]] = {}
        for s in steps:
            q = s[1]
            if not isinstance(q, PgQueue) or q.config.max_depth is None:
                continue
            if s[0] == "push":
                net.setdefault(q, [0, 0])[0] += 1
            elif s[0] == "settle" and s[3]:
                net.setdefault(q, [0, 0])[1] += 1
        for q, (pushes, acks) in net.items():
            cap = q.config.max_depth
            if cap is not None and pushes > acks:
                live = one(c.execute(q._sql.count_live))[0]
                if live - acks + pushes > cap:
                    raise QueueFull(f"queue {q.name!r}: this transaction would leave {live - acks + pushes} live "
                                    f"rows, above max_depth={cap}; nothing was written")

