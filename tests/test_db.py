"""The database: lock, lifecycle, names, file formats, clock seam, failpoints (SPEC D1-D8).

Multi-process tests run a fresh interpreter through ``conftest.run_child`` /
``spawn_child``; the child prints what it saw and the parent asserts on it.
"""

from __future__ import annotations

import gc
import hashlib
import os
import struct
import threading
import time
import zlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import ConfigError, Db, DbClosed, DbLocked, FixedConfig, FormatError, QueueConfig
from armdb.check import check

from .conftest import FakeClock, child_env, run_child, spawn_child

PAYLOAD = np.dtype([("doc", "<u8"), ("flags", "<u4")])
Pings = armdb.queue("pings", payload=PAYLOAD)
SMALL = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build()


def tree(path: Path) -> dict[str, str]:
    """SHA-256 of every file under ``path`` (directories included as entries)."""
    out: dict[str, str] = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


def armdb_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("armdb-") and t.is_alive()}


# ---------------------------------------------------------------------- D1: the directory lock


def test_d1_second_open_in_process_raises_db_locked_naming_pid(db_path: Path) -> None:
    with Db.open(db_path):
        with pytest.raises(DbLocked, match=rf"already open by process {os.getpid()}\b") as ei:
            Db.open(db_path)
        assert ei.value.pid == os.getpid()
        assert (db_path / "LOCK").read_text().strip() == str(os.getpid())
    with Db.open(db_path):  # released by the first close
        pass


def test_d1_second_open_from_subprocess_names_parent_pid(db_path: Path) -> None:
    with Db.open(db_path):
        r = run_child(
            f"""
            import armdb
            try:
                armdb.Db.open({str(db_path)!r})
            except armdb.DbLocked as e:
                print("LOCKED", e.pid)
                print(e)
            else:
                print("OPENED")
            """
        )
    assert r.returncode == 0, r.stderr
    assert f"LOCKED {os.getpid()}\n" in r.stdout
    assert f"already open by process {os.getpid()}" in r.stdout


def test_d1_forked_child_can_neither_use_nor_release_the_parents_db(db_path: Path) -> None:
    # A child forked after the open inherits the Db without its threads and shares its
    # files and lock: every call there raises DbClosed (saying why), close() touches
    # nothing, and the parent keeps its lock and goes on, across id blocks.
    r = run_child(
        f"""
        import gc, os, armdb, numpy as np
        db = armdb.Db.open({str(db_path)!r})
        q = db.open_queue(armdb.queue("pings", payload=np.dtype([("a", "<u8")])))
        m = db.open_map("m")
        for i in range(700):
            q.push((i,))  # the id write ahead runs in its own thread now
        m.put("k", 1)
        pid = os.fork()
        if pid == 0:
            code = 0
            for n, op in enumerate((lambda: q.push((0,)), lambda: m.put("k", 2), db.tx, lambda: q.lease(1))):
                try:
                    op()
                    code = code or 10 + n
                except armdb.DbClosed as e:
                    if "fork()" not in str(e):
                        code = code or 20 + n
            db.close()
            db.shutdown()
            del db, q, m
            gc.collect()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        try:
            armdb.Db.open({str(db_path)!r})
            print("UNLOCKED")
        except armdb.DbLocked:
            print("LOCKED")
        ids = [q.push((i,)) for i in range(3000)]
        assert len(set(ids)) == 3000 and min(ids) == 701
        assert q.len() == 3700 and m.get("k") == 1
        db.close()
        print("CHECK", armdb.check({str(db_path)!r}).ok)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["CHILD", "0", "LOCKED", "CHECK", "True"], r.stdout


def test_d1_sigkilled_holder_releases_the_lock(db_path: Path) -> None:
    child = spawn_child(
        f"""
        import os, time, armdb
        db = armdb.Db.open({str(db_path)!r})
        print("HOLDING", os.getpid(), flush=True)
        time.sleep(120)
        """
    )
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.startswith("HOLDING"), (line, child.stderr.read() if child.stderr else "")
        child_pid = int(line.split()[1])
        assert child_pid == child.pid
        with pytest.raises(DbLocked, match=f"process {child_pid}") as ei:
            Db.open(db_path)
        assert ei.value.pid == child_pid
    finally:
        child.kill()  # SIGKILL: no atexit, no close
        child.communicate(timeout=30)
    assert child.returncode == -9
    with Db.open(db_path) as db:
        assert not db.closed
        assert (db_path / "LOCK").read_text().strip() == str(os.getpid())
    assert check(db_path).ok


def test_d1_path_that_is_a_file_raises_config_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is not a directory"):
        Db.open(f)
    assert f.read_bytes() == b"x"


# ---------------------------------------------------------------------- D2: lifecycle


def test_d2_context_manager_closes_and_releases(db_path: Path) -> None:
    with Db.open(db_path) as db:
        assert not db.closed
        db.open_queue(Pings, SMALL).push((1, 2))
    assert db.closed
    with Db.open(db_path) as db2:
        assert db2.open_queue(Pings, SMALL).len() == 1


def test_d2_close_twice_and_close_after_shutdown_are_noops(db_path: Path) -> None:
    db = Db.open(db_path)
    db.close()
    db.close()
    db.shutdown()
    db.close()
    assert db.closed
    db = Db.open(db_path)
    db.shutdown()
    db.shutdown()
    db.close()
    assert db.closed


def test_d2_shutdown_joins_the_worker_threads(db_path: Path) -> None:
    before = armdb_threads()
    db = Db.open(db_path)
    db.open_queue(Pings, SMALL)
    mine = armdb_threads() - before
    names = {t.name for t in mine}
    assert {"armdb-flusher", "armdb-ttl", "armdb-wake"} <= names, names
    db.shutdown()
    assert not any(t.is_alive() for t in mine)
    assert armdb_threads() - before == set()


def test_d2_close_stops_the_worker_threads(db_path: Path) -> None:
    before = armdb_threads()
    db = Db.open(db_path)
    mine = armdb_threads() - before
    db.close()
    for t in mine:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in mine)


CLOSED_DB_OPS = {
    "open_map": lambda db: db.open_map("m"),
    "open_queue": lambda db: db.open_queue(Pings, SMALL),
    "stats": lambda db: db.stats(),
    "sweep_expired_now": lambda db: db.sweep_expired_now(),
    "tx": lambda db: db.tx(),
}


@pytest.mark.parametrize("op", sorted(CLOSED_DB_OPS))
@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_d2_every_operation_on_a_closed_db_raises_db_closed(db_path: Path, op: str, how: str) -> None:
    db = Db.open(db_path)
    getattr(db, how)()
    with pytest.raises(DbClosed, match="is closed"):
        CLOSED_DB_OPS[op](db)


def test_d2_queue_handles_of_a_closed_db_raise_db_closed(db_path: Path) -> None:
    db = Db.open(db_path, clock=FakeClock())
    q = db.open_queue(Pings, SMALL)
    q.push((1, 1))
    (lease,) = q.lease(1)
    db.shutdown()
    ops = {
        "push": lambda: q.push((2, 2)),
        "lease": lambda: q.lease(1),
        "ack": lambda: q.ack(lease.token),
        "nack": lambda: q.nack(lease.token),
        "len": q.len,
        "dead_len": q.dead_len,
        "next_delay": q.next_delay,
        "stats": q.stats,
        "snapshot": q.snapshot,
        "wait_due_timeout": lambda: q.wait_due_timeout(0.01),
    }
    for name, op in ops.items():
        with pytest.raises(DbClosed, match="closed"):
            op()
            pytest.fail(f"{name} did not raise")


def test_d2_dropping_the_last_reference_closes(db_path: Path) -> None:
    db = Db.open(db_path, clock=FakeClock())
    q = db.open_queue(Pings, SMALL)
    q.push((5, 5))
    del q, db
    # A background tick may hold a strong reference for a moment; retry briefly.
    limit = time.monotonic() + 5
    while True:
        gc.collect()
        try:
            db2 = Db.open(db_path, clock=FakeClock())
            break
        except DbLocked:
            if time.monotonic() > limit:
                raise
            time.sleep(0.02)
    try:
        assert db2.open_queue(Pings, SMALL).len() == 1
    finally:
        db2.shutdown()
    assert check(db_path).ok


# ---------------------------------------------------------------------- D3: collection names


BAD_NAMES = ["", "Jobs", "-jobs", ".jobs", "a/b", "a b", "jobs\n", "é", "a" * 129, "a:b"]


@pytest.mark.parametrize("name", BAD_NAMES + [5, None, b"jobs"])
def test_d3_invalid_queue_names_raise_config_error(name: object) -> None:
    with pytest.raises(ConfigError, match="invalid collection name"):
        armdb.queue(name, payload=np.uint8)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="invalid collection name"):
        armdb.queue(name, payload=bytes, var=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", BAD_NAMES + [5, None, b"jobs"])
def test_d3_invalid_map_names_raise_config_error(db: Db, name: object) -> None:
    with pytest.raises(ConfigError, match="invalid collection name"):
        db.open_map(name)  # type: ignore[arg-type]
    assert list((Path(db.path) / "collections").iterdir()) == []


@pytest.mark.parametrize("name", ["a", "_", "0", "jobs_2.v1-x", "a" * 120])
def test_d3_valid_queue_names(db: Db, name: str) -> None:
    spec = armdb.queue(name, payload=np.uint8)
    assert spec.name == name and spec.payload_name == name + ".payload"
    q = db.open_queue(spec, SMALL)
    q.push(1)
    assert (Path(db.path) / "collections" / name / "shard-000" / "fixed.data").exists()


def test_d3_map_names_may_be_128_characters() -> None:
    from armdb.db import validate_name

    assert validate_name("m" * 128) == "m" * 128
    with pytest.raises(ConfigError, match="invalid collection name"):
        validate_name("m" * 129)


def test_d3_queue_name_longer_than_120_raises(db: Db) -> None:
    with pytest.raises(ConfigError, match="longer than 120 characters"):
        armdb.queue("q" * 121, payload=np.uint8)
    with pytest.raises(ConfigError, match="longer than 120 characters"):
        armdb.queue("q" * 121, payload=bytes, var=True)


def test_d3_payload_suffix_is_reserved_for_maps(db: Db) -> None:
    with pytest.raises(ConfigError, match="reserved for var queues"):
        db.open_map("jobs.payload")
    from armdb.db import validate_name

    with pytest.raises(ConfigError, match="reserved for var queues"):
        validate_name("jobs.payload")


def test_d3_payload_suffix_is_reserved_for_queues() -> None:
    with pytest.raises(ConfigError, match=r"must not end in '\.payload'"):
        armdb.queue("jobs.payload", payload=bytes, var=True)
    with pytest.raises(ConfigError, match=r"must not end in '\.payload'"):
        armdb.queue("jobs.payload", payload=np.uint8)


def test_d3_queue_name_colliding_with_a_map_raises(db: Db) -> None:
    m = db.open_map("shared")
    m.put("k", 1)
    with pytest.raises(ConfigError, match="is open as a map"):
        db.open_queue(armdb.queue("shared", payload=np.uint8), SMALL)


def test_d3_map_name_colliding_with_a_queue_raises(db: Db) -> None:
    db.open_queue(Pings, SMALL)
    with pytest.raises(ConfigError, match="is a queue"):
        db.open_map("pings")


def test_d3_collision_is_detected_on_disk_after_reopen(db_path: Path) -> None:
    with Db.open(db_path) as db:
        db.open_map("things").put("k", 1)
    with Db.open(db_path) as db, pytest.raises(ConfigError, match="already a collection of another kind"):
        db.open_queue(armdb.queue("things", payload=np.uint8), SMALL)
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL)
    with Db.open(db_path) as db, pytest.raises(ConfigError, match="is a queue"):
        db.open_map("pings")


# ---------------------------------------------------------------------- D5: magic and version


def meta_bytes(magic: bytes = b"ARMDBMT1", version: int = 1) -> bytes:
    body = struct.pack("<8sI", magic, version)
    return body + struct.pack("<I", zlib.crc32(body))


def test_d5_db_meta_is_magic_version_crc(db_path: Path) -> None:
    Db.open(db_path).shutdown()
    raw = (db_path / "db.meta").read_bytes()
    assert raw[:16] == meta_bytes(version=2)
    # Then the identity block (docs/format.md): magic, database id, an empty log key check value, CRC.
    ident = raw[16:-4]
    assert ident[:8] == b"ARMDBID1" and len(ident) == 8 + 16 + 4 and ident[-4:] == bytes(4)
    assert raw[-4:] == struct.pack("<I", zlib.crc32(ident))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (meta_bytes(magic=b"SQLite f"), "not an armdb database"),
        (meta_bytes(version=99), "format version 99 is not supported"),
        (meta_bytes()[:-1] + bytes([meta_bytes()[-1] ^ 1]), "fails its CRC"),
        (b"", "not an armdb database"),
        (meta_bytes()[:10], "not an armdb database"),
    ],
    ids=["wrong_magic", "version_99", "bad_crc", "empty", "truncated"],
)
def test_d5_bad_db_meta_raises_format_error_and_changes_nothing(
    db_path: Path, raw: bytes, message: str
) -> None:
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL).push((1, 1))
    (db_path / "db.meta").write_bytes(raw)
    before = tree(db_path)
    with pytest.raises(FormatError, match=message):
        Db.open(db_path)
    assert tree(db_path) == before
    # the failed open released the lock
    with pytest.raises(FormatError, match=message):
        Db.open(db_path)


def test_d5_bad_seqmap_raises_format_error_and_changes_nothing(db_path: Path) -> None:
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL).push((1, 1))
    raw = bytearray((db_path / "seqmap").read_bytes())
    assert raw[:8] == b"ARMSEQ01"
    raw[0:8] = b"ARMSEQ99"
    (db_path / "seqmap").write_bytes(bytes(raw))
    before = tree(db_path)
    with pytest.raises(FormatError, match="not an armdb sequence map"):
        Db.open(db_path)
    assert tree(db_path) == before


def test_d5_bad_queue_meta_raises_format_error_and_changes_nothing(db_path: Path) -> None:
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL).push((1, 1))
    meta = db_path / "collections" / "pings" / "queue.meta"
    raw = bytearray(meta.read_bytes())
    assert raw[:8] == b"ARMQUEU1"
    struct.pack_into("<I", raw, 8, 7)  # format version 7
    meta.write_bytes(bytes(raw))
    # Db.open and close legitimately rotate the transaction log; the queue's files must not change.
    before = tree(db_path / "collections")
    with Db.open(db_path) as db, pytest.raises(FormatError, match="queue meta format 7 is not supported"):
        db.open_queue(Pings, SMALL)
    assert tree(db_path / "collections") == before


def fixed_header(magic: bytes = b"ARMFIXD1", version: int = 1, slot: int = 128) -> bytes:
    body = struct.pack("<8sIIIII", magic, version, slot, 16, 44, 0)
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (fixed_header(magic=b"ARMFIXD9"), "not an armdb fixed.data file"),
        (fixed_header(version=2), "format version 2 is not supported"),
        (fixed_header()[:-1] + b"\0", "header page fails its CRC"),
    ],
    ids=["wrong_magic", "version_2", "bad_crc"],
)
def test_d5_bad_fixed_data_header_raises_format_error(db_path: Path, header: bytes, message: str) -> None:
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL).push((1, 1))
    path = db_path / "collections" / "pings" / "shard-000" / "fixed.data"
    raw = bytearray(path.read_bytes())
    assert raw[:32] == fixed_header()
    raw[:32] = header
    path.write_bytes(bytes(raw))
    before = tree(db_path / "collections")
    with Db.open(db_path) as db, pytest.raises(FormatError, match=message):
        db.open_queue(Pings, SMALL)
    assert tree(db_path / "collections") == before


# ---------------------------------------------------------------------- D7: the clock seam


def test_d7_fake_clock_time_is_what_gets_persisted(db_path: Path) -> None:
    clock = FakeClock(1_700_000_000_000)
    t0 = clock.ms
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, SMALL)
        a = q.push((1, 0))
        clock.advance(3600)
        b = q.push((2, 0), delay=timedelta(seconds=10))
        clock.ms -= 7_200_000  # jump back two hours: persisted as given
        c = q.push((3, 0))
        due = dict(zip(q.snapshot()["id"].tolist(), q.snapshot()["due"]))
        assert due[a] == np.datetime64(t0, "ms")
        assert due[b] == np.datetime64(t0 + 3_600_000 + 10_000, "ms")
        assert due[c] == np.datetime64(t0 - 3_600_000, "ms")
        (lease,) = q.lease(1)
        assert lease.id == c
        assert lease.deadline == datetime.fromtimestamp((clock.ms + 30_000) / 1000, tz=UTC)
        assert lease.deadline.tzinfo is not None
        assert q.snapshot()["deadline"][q.snapshot()["id"] == c][0] == np.datetime64(clock.ms + 30_000, "ms")
    # persisted, not recomputed: another clock sees the same times
    with Db.open(db_path, clock=FakeClock(1_000_000_000_000)) as db:
        snap = db.open_queue(Pings, SMALL).snapshot()
        due = dict(zip(snap["id"].tolist(), snap["due"]))
        assert due[a] == np.datetime64(t0, "ms")


def test_d7_default_clock_reads_wall_time(db_path: Path) -> None:
    with Db.open(db_path) as db:
        q = db.open_queue(Pings, SMALL)
        lo = time.time_ns() // 1_000_000
        rid = q.push((1, 1))
        hi = time.time_ns() // 1_000_000
        (due,) = q.snapshot()["due"][q.snapshot()["id"] == rid]
        assert np.datetime64(lo, "ms") <= due <= np.datetime64(hi, "ms")


def test_d7_clock_must_be_callable(db_path: Path) -> None:
    with pytest.raises(ConfigError, match="clock must be a callable"):
        Db.open(db_path, clock=1_700_000_000_000)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- D8: failpoints

SPEC_FAILPOINTS = {
    "bitcask.after_append",
    "fixed.after_slot_write",
    "queue.var_push.after_body",
    "txlog.after_append",
    "txlog.after_sync",
    "txlog.after_apply",
    "compaction.after_new_file",
    "compaction.before_unlink",
    "recovery.mid_replay",
}

PUSH_CHILD = """
import numpy as np, armdb
from armdb import FixedConfig, QueueConfig
db = armdb.Db.open({path!r})
q = db.open_queue(armdb.queue("fp", payload=np.dtype("<u8")),
                  QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build())
print("opened", flush=True)
for i in range(5):
    q.push(i)
    print("pushed", i, flush=True)
db.shutdown()
print("done", flush=True)
"""


def test_d8_failpoints_lists_every_spec_name() -> None:
    names = armdb.failpoints()
    assert SPEC_FAILPOINTS <= set(names)
    assert names == sorted(names) and len(set(names)) == len(names)
    from armdb import _fail

    assert set(names) == set(_fail.ALL)
    assert _fail.EXIT_CODE == 86


def test_d8_child_without_failpoint_runs_to_the_end(db_path: Path) -> None:
    r = run_child(PUSH_CHILD.format(path=str(db_path)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "done"


def test_d8_failpoint_exits_86_at_the_point(db_path: Path) -> None:
    r = run_child(
        PUSH_CHILD.format(path=str(db_path)), env=child_env(ARMDB_FAILPOINT="fixed.after_slot_write")
    )
    assert r.returncode == 86, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["opened"]
    with Db.open(db_path) as db:  # the lock died with the process; the slot write was complete
        q = db.open_queue(armdb.queue("fp", payload=np.dtype("<u8")), SMALL)
        assert q.len() == 1
    assert check(db_path).ok


def test_d8_failpoint_with_count_passes_n_times_first(db_path: Path) -> None:
    r = run_child(
        PUSH_CHILD.format(path=str(db_path)), env=child_env(ARMDB_FAILPOINT="fixed.after_slot_write:2")
    )
    assert r.returncode == 86, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["opened", "pushed 0", "pushed 1"]
    with Db.open(db_path) as db:
        q = db.open_queue(armdb.queue("fp", payload=np.dtype("<u8")), SMALL)
        assert sorted(int(x) for x in q.snapshot()["id"]) == [1, 2, 3]
    assert check(db_path).ok


def test_d8_unknown_failpoint_name_is_refused() -> None:
    r = run_child("import armdb", env=child_env(ARMDB_FAILPOINT="no.such.point"))
    assert r.returncode == 1
    assert "unknown failpoint 'no.such.point'" in r.stderr


INTERRUPTED_META_CHILD = """
import numpy as np, armdb
from armdb import FixedConfig, QueueConfig
db = armdb.Db.open({path!r})
print("db", flush=True)
q = db.open_queue(armdb.queue("fp", payload=np.dtype("<u8")),
                  QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build())
print("queue", flush=True)
q.push(1)
print("pushed", flush=True)
db.shutdown()
"""


@pytest.mark.parametrize(
    ("skip", "reached", "tmp"),
    [
        (0, [], "db.meta.tmp"),
        (1, ["db"], "collections/fp/queue.meta.tmp"),
        (2, ["db", "queue"], "seqmap.tmp"),
    ],
    ids=["db.meta", "queue.meta", "seqmap"],
)
def test_d8_crash_between_meta_tmp_write_and_rename_recovers(
    db_path: Path, skip: int, reached: list[str], tmp: str
) -> None:
    """``meta.after_tmp_write``: the old file is intact and the next open cleans up."""
    r = run_child(
        INTERRUPTED_META_CHILD.format(path=str(db_path)),
        env=child_env(ARMDB_FAILPOINT=f"meta.after_tmp_write:{skip}"),
    )
    assert r.returncode == 86, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == reached
    assert (db_path / tmp).exists()
    with Db.open(db_path) as db:  # recovery alone, with no write that would redo the file
        q = db.open_queue(armdb.queue("fp", payload=np.dtype("<u8")), SMALL)
        assert q.len() == 0
    report = check(db_path)
    assert report.ok, str(report)
    with Db.open(db_path) as db:
        q = db.open_queue(armdb.queue("fp", payload=np.dtype("<u8")), SMALL)
        q.push(2)
        assert q.len() == 1
    report = check(db_path)
    assert report.ok, str(report)


def test_d1_handles_cannot_be_pickled_and_say_why(tmp_path):
    # Pickling a handle (to send it to a pool worker) failed on an RLock; it now says that
    # a handle belongs to its process and what to do instead.
    import pickle

    import numpy as np

    with armdb.Db.open(tmp_path / "db") as db:
        q = db.open_queue(armdb.queue("jobs", payload=np.dtype("<u8")))
        m = db.open_map("m")
        for handle in (db, q, m):
            with pytest.raises(armdb.ProcessBound, match="belongs to the process that opened the database"):
                pickle.dumps(handle)
        q.push(1)
        (lz,) = q.lease()
        assert pickle.loads(pickle.dumps(lz.token)) == lz.token  # tokens and payloads travel


def test_d1_fork_message_points_at_the_owner_pattern(tmp_path):
    import os

    db = armdb.Db.open(tmp_path / "db")
    try:
        pid = os.fork()
        if pid == 0:
            try:
                db.open_map("m")
            except armdb.DbClosed as e:
                os._exit(0 if "owner" in str(e) and "DbLocked" in str(e) and "open one in each" not in str(e) else 3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        db.close()


def test_d4_stats_by_name_and_a_sweep_raises_what_it_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SPEC D4: db.stats() maps every open collection's name to its stats;
    # db.sweep_expired_now() runs one retention pass and raises the error it hit, and
    # the row it could not finish is finished by the next pass.
    notes = armdb.queue("notes", payload=dict, var=True)
    with Db.open(tmp_path / "db") as db:
        m = db.open_map("docs")
        m.put("a", 1)
        pings = db.open_queue(Pings)
        pings.push((1, 2.0))
        q = db.open_queue(notes, QueueConfig.balanced().dead_retention(0.05).build())
        q.push({"n": 1})
        q.nack(q.lease()[0], dead=True)
        stats = db.stats()
        assert set(stats) == {"docs", "pings", "notes"}
        assert stats["docs"]["keys"] == m.stats()["keys"] == 1
        assert stats["pings"].len == 1 and stats["notes"].dead_len == 1
        assert q._payload is not None and len(q._payload) == 1
        time.sleep(0.1)

        def failing_delete(key: bytes) -> None:
            raise armdb.StorageError("injected: the disk refused the delete")

        monkeypatch.setattr(q._payload, "delete", failing_delete)
        with pytest.raises(armdb.StorageError, match="injected"):
            db.sweep_expired_now()
        assert q.dead_len() == 0  # the header went; its body waits for the next pass
        assert q.stats().retention_retry_pending == 1
        monkeypatch.undo()
        db.sweep_expired_now()
        assert len(q._payload) == 0
    with pytest.raises(DbClosed):
        db.stats()
    with pytest.raises(DbClosed):
        db.sweep_expired_now()
