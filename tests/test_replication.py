"""Replication (R1, R3, T8): a follower converges to its primary, resumes after a restart,
copies a snapshot when new, and promotes into a writable database.  docs/replication.md."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import QueueConfig

from .conftest import FakeClock, child_env, kill_and_read, spawn_child

Fixed = armdb.queue("fixedq", payload=np.dtype("<u8"))
Var = armdb.queue("varq", payload=dict, var=True)
Events = armdb.queue("events", payload=dict, var=True)
LOCAL = ("127.0.0.1", 0)


def cfg() -> Any:
    return QueueConfig.balanced().lease_timeout(60).build()


def schema() -> armdb.SchemaRegistry:
    return armdb.SchemaRegistry().change_stream("src", Events, lambda ch: {"key": ch.key, "new": ch.new})


class Primary:
    """An open primary with one of each collection kind."""

    def __init__(self, path: Path, clock: FakeClock) -> None:
        self.db = armdb.Db.open(path, clock=clock, schema=schema())
        self.address = self.db.replicate(listen=LOCAL)
        self.fixed = self.db.open_queue(Fixed, cfg())
        self.var = self.db.open_queue(Var, cfg())
        self.events = self.db.open_queue(Events, cfg())
        self.plain = self.db.open_map("plain")
        self.src = self.db.open_map("src")

    @property
    def seq(self) -> int:
        return int(self.db.replication_status()["seq"])

    def load(self, start: int, n: int) -> None:
        """Every kind of write: pushes, leases, acks, nacks, map puts and deletes, a stream commit."""
        for i in range(start, start + n):
            self.fixed.push(i)
            self.var.push({"i": i, "pad": "x" * (i % 97)})
            self.plain.put(i, {"v": i})
            if i % 3 == 0:
                self.plain.delete(i - 1)
            with self.db.tx() as tx:
                tx.put(self.src, f"k{i}", i)
        for lz in self.fixed.lease(n // 2):
            if lz.id % 2:
                self.fixed.ack(lz)
            else:
                self.fixed.nack(lz, delay=5)
        for lz in self.var.lease(n // 2):
            self.var.ack(lz)
        self.events.lease(3)


@pytest.fixture
def primary(tmp_path: Path, clock: FakeClock) -> Iterator[Primary]:
    p = Primary(tmp_path / "primary", clock)
    try:
        yield p
    finally:
        p.db.shutdown()


def files(root: Path) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel not in ("LOCK", "replica.state", "replica.state.tmp"):
                out[rel] = Path(d, n).read_bytes()
    return out


def contents(db: armdb.Db) -> dict[str, Any]:
    """Every queue row and every map value, to compare two databases."""
    out: dict[str, Any] = {}
    for spec in (Fixed, Var, Events):
        q = db.open_queue(spec, cfg())
        out[spec.name] = q.snapshot().tolist()
    for name in ("plain", "src"):
        out[name] = sorted(db.open_map(name).items(), key=repr)
    return out


def settle(p: Primary, follower: Any) -> None:
    assert follower.wait_applied(p.seq, timeout=20), follower.status()


# SPEC R1
def test_r1_new_follower_copies_then_streams_and_converges(primary: Primary, tmp_path: Path, clock: FakeClock) -> None:
    primary.load(0, 40)  # before the follower exists: it copies a snapshot
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    try:
        primary.load(40, 40)  # while it copies and streams
        settle(primary, follower)
        st = follower.status()
        assert st["snapshot_complete"] and st["connected"] and st["last_error"] is None
        primary.db.close()  # its last writes (checkpoint, close) reach the follower too
        settle(primary, follower)
        # The follower's files are byte copies of the primary's.
        d = _diff(files(tmp_path / "f"), files(tmp_path / "primary"))
        assert not d, "\n".join(d)
    finally:
        follower.close()
    db = follower.promote(clock=clock, schema=schema())
    db.close()
    assert armdb.check(tmp_path / "f").ok


# SPEC R1, R3
def test_r3_promote_gives_the_primarys_rows_and_map_values(primary: Primary, tmp_path: Path, clock: FakeClock) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    primary.load(0, 30)
    settle(primary, follower)
    primary.db.close()
    settle(primary, follower)
    db = follower.promote(clock=clock, schema=schema())
    try:
        got = contents(db)
    finally:
        db.close()
    want = armdb.Db.open(tmp_path / "primary", clock=clock, schema=schema())
    try:
        assert got == contents(want)
    finally:
        want.close()
    assert armdb.check(tmp_path / "f").ok
    # After promotion it is a normal database: Db.open works, following it again does not.
    with pytest.raises(armdb.ReplicationError, match="database of its own"):
        armdb.Db.follow(tmp_path / "f", primary=primary.address)


# SPEC R1
def test_r1_follower_restart_resumes_from_its_position(primary: Primary, tmp_path: Path, clock: FakeClock) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    primary.load(0, 20)
    settle(primary, follower)
    follower.close()
    seq_at_close = follower.status()["applied_seq"]
    primary.load(20, 20)  # written while the follower is down
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    try:
        assert follower._mode == "resume"  # no second copy: it asked for the next frame
        assert follower.status()["applied_seq"] >= seq_at_close
        settle(primary, follower)
        primary.db.close()
        settle(primary, follower)
        d = _diff(files(tmp_path / "f"), files(tmp_path / "primary"))
        assert not d, "\n".join(d)
    finally:
        follower.close()


# SPEC R1
def test_r1_primary_restart_copies_only_what_differs(tmp_path: Path, clock: FakeClock) -> None:
    p = Primary(tmp_path / "primary", clock)
    follower = armdb.Db.follow(tmp_path / "f", primary=p.address)
    try:
        p.load(0, 10)
        settle(p, follower)
        p.db.close()
        settle(p, follower)
        port = p.address[1]
        follower.close()
        p2 = armdb.Db.open(tmp_path / "primary", clock=clock, schema=schema())
        try:
            p2.replicate(listen=("127.0.0.1", port))
            p2.open_queue(Fixed, cfg()).push(12345)
            follower = armdb.Db.follow(tmp_path / "f", primary=("127.0.0.1", port))
            # Another stream, the same database: the follower keeps its copy and gets only
            # what differs (R5: slots compared by version and CRC, other files by block).
            assert follower._mode == "delta"
            assert follower.wait_applied(int(p2.replication_status()["seq"]), timeout=20)
            last = follower.status()["last_copy"]
            assert last["mode"] == "delta", last
            total = sum(len(b) for b in files(tmp_path / "primary").values())
            assert 0 < last["bytes"] < total // 2, (last, total)
        finally:
            p2.close()
        assert follower.wait_applied(int(p2.replication_status()["seq"]), timeout=20)
        follower.close()
        d = _diff(files(tmp_path / "f"), files(tmp_path / "primary"))
        assert not d, "\n".join(d)
    finally:
        follower.close()


# SPEC R3
def test_r3_leases_keep_their_deadlines_across_promotion(primary: Primary, tmp_path: Path, clock: FakeClock) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    primary.fixed.push(7)
    (lz,) = primary.fixed.lease(1, lease_timeout=60)
    settle(primary, follower)
    primary.db.close()
    settle(primary, follower)
    db = follower.promote(clock=clock, schema=schema())
    try:
        q = db.open_queue(Fixed, cfg())
        assert q.lease(1) == []  # the lease taken on the old primary still holds
        clock.advance(61)
        (again,) = q.lease(1)  # overdue: visible again, at least once
        assert again.id == lz.id and again.attempt == 2
        q.ack(again)
    finally:
        db.close()


# SPEC T8
def test_t8_replicated_stream_writes_emit_nothing_on_the_follower(primary: Primary, tmp_path: Path,
                                                                  clock: FakeClock) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    with primary.db.tx() as tx:
        for i in range(5):
            tx.put(primary.src, f"k{i}", i)
    settle(primary, follower)
    primary.db.close()
    settle(primary, follower)
    db = follower.promote(clock=clock, schema=schema())
    try:
        assert len(db.open_queue(Events, cfg())) == 5  # the primary's five, none added by the follower
    finally:
        db.close()


# SPEC R2
def test_r2_a_follower_directory_does_not_open_as_a_database(primary: Primary, tmp_path: Path) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    follower.close()
    with pytest.raises(armdb.ReplicationError, match="promote"):
        armdb.Db.open(tmp_path / "f")


def test_r1_replicate_after_opening_a_collection_is_refused(tmp_path: Path) -> None:
    with armdb.Db.open(tmp_path / "db") as db:
        db.open_map("m")
        with pytest.raises(armdb.ConfigError, match="before opening any queue or map"):
            db.replicate(listen=LOCAL)
    with armdb.Db.open(tmp_path / "db2") as db2, pytest.raises(armdb.ConfigError, match="listen must be"):
        db2.replicate(listen="localhost:7070")  # type: ignore[arg-type]


def _diff(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            out.append(f"{k}: only in {'primary' if x is None else 'follower'}")
        elif x != y:
            diffs = [i for i in range(min(len(x), len(y))) if x[i] != y[i]]
            out.append(f"{k}: len {len(x)} vs {len(y)}, first diffs {diffs[:5]} last {diffs[-3:]}")
    return out


# SPEC R2
def returned_then_killed(script: str, tag: str, want: int, follow: Path) -> tuple[Any, list[int]]:
    """Run ``script`` (a primary that prints ``PORT n`` and then ``<tag> i`` each time a
    durable write returned) in a child, follow it into ``follow``, SIGKILL it once it
    reported ``want`` writes; returns the follower and every ``i`` the child reported."""
    proc = spawn_child(script, env=child_env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT"), line + (proc.stderr.read() if proc.stderr else "")
    follower = armdb.Db.follow(follow, primary=("127.0.0.1", int(line.split()[1])))
    returned: list[int] = []
    try:
        while len(returned) < want:
            got = proc.stdout.readline()
            assert got.startswith(tag), got
            returned.append(int(got.split()[1]))
    finally:
        out, _ = kill_and_read(proc)
    returned += [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith(tag + " ")]
    time.sleep(0.05)
    return follower, returned


def test_r2_reader_reads_and_refuses_every_write(primary: Primary, tmp_path: Path, clock: FakeClock) -> None:
    follower = armdb.Db.follow(tmp_path / "f", primary=primary.address)
    try:
        primary.load(0, 12)
        settle(primary, follower)
        with follower.reader(clock=clock, schema=schema()) as r:
            fixed = r.open_queue(Fixed, cfg())
            assert len(fixed) == len(primary.fixed)
            assert [j.id for j in fixed.peek(5)] == [j.id for j in primary.fixed.peek(5)]
            assert fixed.snapshot().tolist() == primary.fixed.snapshot().tolist()
            assert fixed.stats().ready == primary.fixed.stats().ready
            plain = r.open_map("plain")
            assert plain.get(11) == {"v": 11} and 11 in plain and len(plain) == len(primary.plain)
            assert set(r.stats()) >= {"fixedq", "plain"}
            for write in (lambda: fixed.push(1), lambda: fixed.lease(1), lambda: plain.put(1, 2),
                          lambda: plain.delete(11), lambda: r.tx(), lambda: r.sweep_expired_now(),
                          lambda: r.open_map("not_on_primary")):
                with pytest.raises(armdb.ReadOnly, match="read-only view of the follower"):
                    write()
            assert isinstance(armdb.ReadOnly("x"), armdb.ArmdbError)
        # copy_to: a consistent, closed copy that armdb.check accepts (SPEC D6 on a follower)
        follower.copy_to(tmp_path / "copy")
        report = armdb.check(tmp_path / "copy")
        assert report.ok, report.findings
        with pytest.raises(armdb.ConfigError, match="exists"):
            follower.copy_to(tmp_path / "copy")
    finally:
        follower.close()


# SPEC R1: a primary opened through a symbolic link streams every file too
def test_r1_primary_opened_through_a_symlink(tmp_path: Path, clock: FakeClock) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    p = Primary(tmp_path / "link" / "primary", clock)
    follower = armdb.Db.follow(tmp_path / "f", primary=p.address)
    try:
        p.load(0, 10)
        settle(p, follower)
        p.db.close()
        settle(p, follower)
        d = _diff(files(tmp_path / "f"), files(tmp_path / "real" / "primary"))
        assert not d, "\n".join(d)
    finally:
        follower.close()
        p.db.shutdown()


# SPEC R4: with no follower a durable commit waits; a follower that catches up releases it,
# and closing the primary releases a waiting commit instead of hanging
def test_r4_a_durable_commit_waits_for_a_follower(tmp_path: Path) -> None:
    db = armdb.Db.open(tmp_path / "p", tx_config=armdb.TxConfig(durable=True).sync_replicas(1))
    address = db.replicate(listen=LOCAL)
    m = db.open_map("m")
    done = threading.Event()

    def commit() -> None:
        with db.tx() as tx:
            tx.put(m, "k", 1)
        done.set()

    t = threading.Thread(target=commit)
    t.start()
    assert not done.wait(0.5)  # no follower yet: the commit waits
    follower = armdb.Db.follow(tmp_path / "f", primary=address)
    try:
        assert done.wait(10), follower.status()
        t.join()
        t2 = threading.Thread(target=commit)
        follower.close()  # the only follower goes away: the next durable commit waits ...
        t2.start()
        done.clear()
        assert not done.wait(0.3)
        db.close()  # ... until the primary closes
        t2.join(10)
        assert not t2.is_alive()
    finally:
        follower.close()
        db.close()
    with pytest.raises(armdb.ConfigError, match="replicas must be at least 0"):
        armdb.TxConfig().sync_replicas(-1)
