"""The PostgreSQL layout of armdb (SPEC G6) and every SQL statement ``armdb.pg`` runs.

Everything lives in one PostgreSQL schema, the *namespace* (``armdb`` by default):

``armdb_meta(key, value)``
    ``format_version``: the layout version below.  A namespace of a higher version is
    refused with ``FormatError``.
``armdb_collections(id, name, kind, var, fingerprint, layouts, layout, key_check)``
    One row per queue or map ever opened: its name as the user wrote it (up to 128
    characters), its kind, the queue's payload fingerprint and layouts (Q2, Q36), and the
    key check value of an encrypted collection (G5).  ``id`` is a serial.

Per queue with collection id ``N`` (tables named by :func:`table_name`):

``q<N>_<slug>``   live rows (ready, delayed, leased): ``id`` (primary key), ``due_ms``,
                  ``visible_ms`` (when the row can be leased: ``due_ms`` for a ready row,
                  the lease deadline for a leased one; indexed with ``id``), ``state``,
                  ``flags``, ``attempts``, ``epoch``, ``deadline_ms``, ``pushed_ms``,
                  ``payload`` (bytea: the fixed record or the msgpack body, sealed when the
                  queue is encrypted).
``d<N>_<slug>``   dead rows: the same columns with ``dead_ms`` (when it was
                  dead-lettered, indexed with ``id``) instead of ``due_ms``/``visible_ms``.
``s<N>_<slug>``   the sequence of row ids.

Per map: ``m<N>_<slug>(k bytea primary key, v bytea)``, keys and values encoded by
armdb.mapcodec (values sealed when the map is encrypted).

Identifier scheme: a name maps to ``<kind letter><N>_<slug>``, where ``N`` is the
collection's serial id and ``slug`` its name with ``.`` and ``-`` turned into ``_``, cut
so that the whole identifier has at most 63 bytes.  The serial id makes it unique
whatever the cut removed, so two names never share a table.  Names are only ever
written into SQL through ``psycopg.sql.Identifier`` (quoted) and values only as
parameters.  Times are milliseconds since the Unix epoch from the server's clock.
"""

from __future__ import annotations

import zlib
from typing import Any

import psycopg
from psycopg import sql

from ..errors import FormatError

Query = sql.SQL | sql.Composed  # what Connection.execute takes

FORMAT_VERSION = 1
MAX_IDENT = 63

# now() in ms: the server's clock, fixed for one transaction.
NOW_MS = sql.SQL("(floor(extract(epoch from now()) * 1000))::bigint")


def table_name(kind: str, coll_id: int, name: str) -> str:
    """The table (or sequence) of collection ``coll_id`` named ``name``: see the module
    docstring.  ``kind`` is one letter: q (live rows), d (dead rows), s (sequence), m (map)."""
    prefix = f"{kind}{coll_id}_"
    slug = name.replace(".", "_").replace("-", "_")
    return prefix + slug[: MAX_IDENT - len(prefix)]


def channel_name(namespace: str, coll_id: int) -> str:
    """The LISTEN/NOTIFY channel of a queue (at most 63 bytes)."""
    ns = namespace.encode()[:40].decode("ascii", "ignore")
    return f"armdb_{ns}_{coll_id}"


def listen_key(namespace: str, coll_id: int) -> int:
    """The advisory-lock key that says "a process listens on this queue's channel".

    A listening connection holds it shared (a session lock) from before its ``LISTEN``;
    a commit that makes rows due checks whether it could take it exclusively and sends a
    notification only when it could not (see :data:`NOTIFY_IF_LISTENED`).  The key is a
    bigint above the int4 range of the namespace lock's ``hashtext`` keys."""
    return ((zlib.crc32(namespace.encode()) & 0x7FFFFFFF) << 32 | 1 << 31) | (coll_id & 0x7FFFFFFF)


def gate_key(namespace: str, coll_id: int) -> tuple[int, int]:
    """The advisory-lock key (two int4s, so it meets no bigint key) that a listener holds
    exclusively while it registers, and a commit that makes rows due holds shared until
    it ends (see :data:`NOTIFY_IF_LISTENED`).  Its first half is negative, unlike the
    collection ids of the per-key locks of change streams (:func:`key_lock`)."""
    crc = zlib.crc32(namespace.encode())
    return -1 - (coll_id & 0x7FFFFFFF), crc - (1 << 32) if crc >= 1 << 31 else crc


# A notification only when somebody may be listening.  pg_notify makes a writing commit
# take a cluster-wide lock, held until the commit has flushed, and write the notification
# queue: notifying commits are serialised, which cost as much as the commit itself in the
# bench and kept concurrent producers from sharing WAL flushes (docs/postgres.md,
# "Notifications").  Two keys make it race-free without making producers meet each other:
#
# * a listener takes the gate key exclusively (waiting for the commits that hold it
#   shared to end), then the listen key shared for as long as it listens, LISTENs, and
#   lets the gate go; only then do its waiters look at the table;
# * a writing statement takes the gate key shared for its transaction (producers share
#   it), then checks the listen key: it tries to take it exclusively and lets it go at
#   once.  When the try fails, somebody listens: notify.
#
# A commit that took the gate before a listener did ended before that listener's waiters
# looked at the table (they see its rows); one that took it after finds the listen key
# held (it notifies, and the listener LISTENs already).  When the gate cannot be had (a
# listener registers at that moment) the commit notifies.  Two producers checking the
# listen key at the same instant: one may see the other's brief hold and notify, a
# wakeup too many, never one too few.
NOTIFY_IF_LISTENED = (
    "(SELECT pg_notify(%(chan)s, '') WHERE CASE WHEN pg_try_advisory_xact_lock_shared(%(g1)s, %(g2)s) "
    "THEN CASE WHEN pg_try_advisory_lock(%(lk)s) THEN NOT pg_advisory_unlock(%(lk)s) ELSE true END "
    "ELSE true END)"
)


def quote(name: str) -> str:
    """A double-quoted identifier (for a ``regclass`` parameter, never for SQL text)."""
    return '"' + name.replace('"', '""') + '"'


def ident(namespace: str, table: str) -> sql.Identifier:
    return sql.Identifier(namespace, table)


# -- the namespace ------------------------------------------------------------------------

def bootstrap(ns: str) -> list[Query]:
    """Statements that create the namespace and its two tables (idempotent)."""
    n = sql.Identifier(ns)
    return [
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(n),
        sql.SQL("CREATE TABLE IF NOT EXISTS {}.armdb_meta (key text PRIMARY KEY, value text NOT NULL)").format(n),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.armdb_collections ("
            " id serial PRIMARY KEY, name text UNIQUE NOT NULL, kind text NOT NULL,"
            " var boolean, fingerprint text, layouts text, layout integer NOT NULL DEFAULT 0,"
            " key_check bytea, created timestamptz NOT NULL DEFAULT now())"
        ).format(n),
        sql.SQL("INSERT INTO {}.armdb_meta (key, value) VALUES ('format_version', %s) "
                "ON CONFLICT (key) DO NOTHING").format(n),
    ]


def lock_namespace(ns: str) -> tuple[Query, tuple[str]]:
    """Serialise the DDL of concurrent first opens (a transaction-level advisory lock)."""
    return sql.SQL("SELECT pg_advisory_xact_lock(hashtext(%s))"), ("armdb.ns:" + ns,)


def read_version(ns: str) -> Query:
    return sql.SQL("SELECT value FROM {}.armdb_meta WHERE key = 'format_version'").format(sql.Identifier(ns))


def find_collection(ns: str) -> Query:
    return sql.SQL("SELECT id, kind, var, fingerprint, layouts, layout, key_check FROM {}.armdb_collections "
                   "WHERE name = %s").format(sql.Identifier(ns))


def insert_collection(ns: str) -> Query:
    return sql.SQL("INSERT INTO {}.armdb_collections (name, kind, var, fingerprint, key_check) "
                   "VALUES (%s, %s, %s, %s, %s) RETURNING id").format(sql.Identifier(ns))


def update_layouts(ns: str) -> Query:
    return sql.SQL("UPDATE {}.armdb_collections SET fingerprint = %s, layouts = %s, layout = %s "
                   "WHERE id = %s").format(sql.Identifier(ns))


def set_key_check(ns: str) -> Query:
    return sql.SQL("UPDATE {}.armdb_collections SET key_check = %s WHERE id = %s").format(sql.Identifier(ns))


# Columns of each table as (name, type as format_type() prints it): open checks them, so a
# table altered by hand is refused with FormatError rather than failing later.
LIVE_COLUMNS = [("id", "bigint"), ("due_ms", "bigint"), ("visible_ms", "bigint"), ("state", "smallint"),
                ("flags", "smallint"), ("attempts", "integer"), ("epoch", "bigint"), ("deadline_ms", "bigint"),
                ("pushed_ms", "bigint"), ("payload", "bytea")]
DEAD_COLUMNS = [("id", "bigint"), ("dead_ms", "bigint"), ("flags", "smallint"), ("attempts", "integer"),
                ("epoch", "bigint"), ("deadline_ms", "bigint"), ("pushed_ms", "bigint"), ("payload", "bytea")]
MAP_COLUMNS = [("k", "bytea"), ("v", "bytea")]


def columns_of() -> Query:
    return sql.SQL(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
        "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace s ON s.oid = c.relnamespace "
        "WHERE s.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum"
    )


def _cols(cols: list[tuple[str, str]], pk: str) -> Query:
    return sql.SQL(", ").join(
        sql.SQL("{} {} NOT NULL{}").format(sql.Identifier(c), sql.SQL(t), sql.SQL(" PRIMARY KEY" if c == pk else ""))
        for c, t in cols
    )


def create_queue(ns: str, live: str, dead: str, seq: str) -> list[Query]:
    """The tables, indexes and sequence of one queue.  Autovacuum runs on the live table
    after 1% of its rows changed (not the default 20%): leases and acks churn it."""
    vac = sql.SQL(" WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01, "
                  "autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.02)")
    return [
        sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(ident(ns, seq)),
        sql.SQL("CREATE TABLE IF NOT EXISTS {} (").format(ident(ns, live)) + _cols(LIVE_COLUMNS, "id")
        + sql.SQL(")") + vac,
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (visible_ms, id)").format(
            sql.Identifier(live[: MAX_IDENT - 4] + "_vis"), ident(ns, live)),
        sql.SQL("CREATE TABLE IF NOT EXISTS {} (").format(ident(ns, dead)) + _cols(DEAD_COLUMNS, "id")
        + sql.SQL(")"),
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (dead_ms, id)").format(
            sql.Identifier(dead[: MAX_IDENT - 4] + "_at"), ident(ns, dead)),
    ]


def create_map(ns: str, table: str) -> list[Query]:
    return [sql.SQL("CREATE TABLE IF NOT EXISTS {} (").format(ident(ns, table)) + _cols(MAP_COLUMNS, "k")
            + sql.SQL(")")]


# -- queue statements -----------------------------------------------------------------------

_LIVE_SELECT = "id, due_ms, state, flags, attempts, epoch, deadline_ms, pushed_ms"


class QueueSQL:
    """The statements of one queue, composed once at open.  Payloads and their arrays go
    in binary (``%b``): psycopg's text format escapes every element of a ``bytea[]`` with
    a regular expression, which cost more client time than the rest of a batch.  The
    integer arrays of the hot statements (lease, ack, push) come as one array literal
    (``armdb.pg.queue.int_array``), cheaper still than a binary dump element by element."""

    def __init__(self, ns: str, live: str, dead: str, seq: str) -> None:
        L, D, S = ident(ns, live), ident(ns, dead), ident(ns, seq)
        f = {"L": L, "D": D, "S": S, "now": NOW_MS}
        self.now = sql.SQL("SELECT {now}").format(**f)
        self.seq = f"{quote(ns)}.{quote(seq)}"  # the sequence, as a regclass parameter
        self.next_ids = sql.SQL("SELECT nextval(%s::regclass) FROM generate_series(1, %s)")
        # push: one row, or many from arrays (ids drawn in input order), with a notify if
        # somebody listens.
        self.push = sql.SQL(
            "INSERT INTO {L} (id, due_ms, visible_ms, state, flags, attempts, epoch, deadline_ms, pushed_ms, payload) "
            "SELECT COALESCE(%(id)s, nextval(%(seq)s::regclass)), n + %(delay)s, n + %(delay)s, %(state)s, %(flags)s, "
            "%(attempts)s, %(epoch)s, %(deadline)s, n, %(payload)b FROM (SELECT {now} AS n) t "
            "RETURNING id, " + NOTIFY_IF_LISTENED
        ).format(**f)
        # Many rows in one statement (atomic by itself), ids drawn in input order, and at
        # most one notification (an uncorrelated subquery runs once).
        self.push_many = sql.SQL(
            "WITH ins AS (INSERT INTO {L} (id, due_ms, visible_ms, state, flags, attempts, epoch, deadline_ms, "
            "pushed_ms, payload) "
            "SELECT COALESCE(u.id, nextval(%(seq)s::regclass)), t.n + %(delay)s, t.n + %(delay)s, %(state)s, "
            "%(flags)s, %(attempts)s, %(epoch)s, %(deadline)s, t.n, u.p "
            "FROM (SELECT {now} AS n) t, unnest(%(payloads)b::bytea[], %(ids)s::bigint[]) WITH ORDINALITY AS u(p, id, o) "
            "ORDER BY u.o RETURNING id) "
            "SELECT id, " + NOTIFY_IF_LISTENED + " FROM ins"
        ).format(**f)
        self.notify = sql.SQL("SELECT " + NOTIFY_IF_LISTENED)
        self.count_live = sql.SQL("SELECT count(*) FROM {L}").format(**f)
        self.count_dead = sql.SQL("SELECT count(*) FROM {D}").format(**f)
        # lease: the due rows by visibility, locked, skipping rows another caller holds.
        self.lease_pick = sql.SQL(
            "SELECT l.id, l.due_ms, l.state, l.flags, l.attempts, l.epoch, l.deadline_ms, l.pushed_ms, l.payload, t.n "
            "FROM {L} l, (SELECT {now} AS n) t WHERE l.visible_ms <= t.n "
            "ORDER BY l.visible_ms, l.id LIMIT %s FOR UPDATE OF l SKIP LOCKED"
        ).format(**f)
        self.update_leased = sql.SQL(
            "UPDATE {L} AS t SET state = u.state, attempts = u.attempts, epoch = u.epoch, "
            "deadline_ms = u.deadline, visible_ms = u.deadline "
            "FROM unnest(%s::bigint[], %s::smallint[], %s::integer[], %s::bigint[], %s::bigint[]) "
            "AS u(id, state, attempts, epoch, deadline) WHERE t.id = u.id"
        ).format(**f)
        self.delete_live = sql.SQL("DELETE FROM {L} WHERE id = ANY(%b::bigint[])").format(**f)
        self.insert_dead = sql.SQL(
            "INSERT INTO {D} (id, dead_ms, flags, attempts, epoch, deadline_ms, pushed_ms, payload) "
            "SELECT * FROM unnest(%b::bigint[], %b::bigint[], %b::smallint[], %b::integer[], %b::bigint[], "
            "%b::bigint[], %b::bigint[], %b::bytea[])"
        ).format(**f)
        # a settle: the row, if the token still holds its lease
        self.settle_pick = sql.SQL(
            "SELECT " + _LIVE_SELECT + ", payload, {now} FROM {L} WHERE id = %s AND state = 1 AND epoch = %s "
            "FOR UPDATE"
        ).format(**f)
        self.ack = sql.SQL("DELETE FROM {L} WHERE id = %s AND state = 1 AND epoch = %s").format(**f)
        # Every token or none, in one statement: the rows are locked and rechecked (a row
        # leased again meanwhile drops out), and the delete runs only if all still match.
        self.ack_many = sql.SQL(
            "WITH ok AS (SELECT t.id FROM {L} t JOIN unnest(%s::bigint[], %s::bigint[]) AS u(id, epoch) "
            "ON t.id = u.id AND t.state = 1 AND t.epoch = u.epoch FOR UPDATE OF t) "
            "DELETE FROM {L} WHERE id IN (SELECT id FROM ok) AND (SELECT count(*) FROM ok) = %s"
        ).format(**f)
        # The acks of lease_batch(ack=), in the lease's transaction: a plain delete of the
        # rows whose token still holds its lease; the caller compares the count and rolls
        # the transaction back if one is missing (nothing to lock first, unlike ack_many).
        self.ack_in_tx = sql.SQL(
            "DELETE FROM {L} t USING unnest(%s::bigint[], %s::bigint[]) AS u(id, epoch) "
            "WHERE t.id = u.id AND t.state = 1 AND t.epoch = u.epoch"
        ).format(**f)
        self.update_row = sql.SQL(
            "UPDATE {L} SET due_ms = %s, visible_ms = %s, state = %s, flags = %s, attempts = %s, epoch = %s, "
            "deadline_ms = %s WHERE id = %s"
        ).format(**f)
        self.insert_live_rows = sql.SQL(
            "INSERT INTO {L} (id, due_ms, visible_ms, state, flags, attempts, epoch, deadline_ms, pushed_ms, payload) "
            "SELECT u.id, u.due, u.due, u.state, u.flags, u.attempts, u.epoch, u.deadline, u.pushed, u.payload "
            "FROM unnest(%b::bigint[], %b::bigint[], %b::smallint[], %b::smallint[], %b::integer[], %b::bigint[], "
            "%b::bigint[], %b::bigint[], %b::bytea[]) AS u(id, due, state, flags, attempts, epoch, deadline, "
            "pushed, payload)"
        ).format(**f)
        self.next_visible = sql.SQL("SELECT min(visible_ms), {now} FROM {L}").format(**f)
        self.stats = sql.SQL(
            "SELECT count(*) FILTER (WHERE visible_ms <= n), count(*) FILTER (WHERE visible_ms > n AND state = 1), "
            "count(*) FILTER (WHERE visible_ms > n AND state = 0), (SELECT count(*) FROM {D}) "
            "FROM {L}, (SELECT {now} AS n) t"
        ).format(**f)
        self.peek_live = sql.SQL(
            "SELECT id, state, attempts, due_ms, payload FROM {L} ORDER BY due_ms, id LIMIT %s").format(**f)
        self.peek_dead = sql.SQL(
            "SELECT id, 2, attempts, dead_ms, payload FROM {D} ORDER BY dead_ms, id LIMIT %s").format(**f)
        self.snapshot_live = sql.SQL(
            "SELECT id, state, due_ms, attempts, epoch, deadline_ms FROM {L} ORDER BY due_ms, id").format(**f)
        self.snapshot_dead = sql.SQL(
            "SELECT id, 2, dead_ms, attempts, epoch, deadline_ms FROM {D} ORDER BY dead_ms, id").format(**f)
        self.dead_pick = sql.SQL(
            "SELECT id, dead_ms, flags, attempts, epoch, deadline_ms, pushed_ms, payload FROM {D} "
            "WHERE %s::bigint[] IS NULL OR id = ANY(%s) ORDER BY dead_ms, id FOR UPDATE"
        ).format(**f)
        self.delete_dead = sql.SQL("DELETE FROM {D} WHERE id = ANY(%s)").format(**f)
        self.purge = sql.SQL("DELETE FROM {D} WHERE %s::bigint[] IS NULL OR id = ANY(%s)").format(**f)
        self.retention = sql.SQL("DELETE FROM {D} WHERE dead_ms <= {now} - %s").format(**f)
        self.first_dead = sql.SQL("SELECT min(dead_ms) FROM {D}").format(**f)


class MapSQL:
    def __init__(self, ns: str, table: str) -> None:
        f = {"M": ident(ns, table)}
        self.get = sql.SQL("SELECT v FROM {M} WHERE k = %s").format(**f)
        self.get_for_update = sql.SQL("SELECT v FROM {M} WHERE k = %s FOR UPDATE").format(**f)
        self.put = sql.SQL("INSERT INTO {M} (k, v) VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v"
                           ).format(**f)
        self.delete = sql.SQL("DELETE FROM {M} WHERE k = %s").format(**f)
        self.count = sql.SQL("SELECT count(*) FROM {M}").format(**f)
        self.items = sql.SQL("SELECT k, v FROM {M} ORDER BY k").format(**f)


def key_lock() -> Query:
    """A transaction-level advisory lock on one key of a stream source map, so that two
    commits writing the key see each other's value as ``old`` (T6)."""
    return sql.SQL("SELECT pg_advisory_xact_lock(%s, hashtext(encode(%s::bytea, 'hex')))")


def one(cur: psycopg.Cursor[Any]) -> tuple[Any, ...]:
    """The one row a statement returns (an aggregate, a RETURNING of one row)."""
    row = cur.fetchone()
    if row is None:
        raise FormatError("a statement that always returns a row returned none; the armdb tables were changed "
                          "by hand: restore them from a backup")
    return tuple(row)
