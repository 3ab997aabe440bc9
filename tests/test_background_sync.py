"""Timed syncs on the flusher's thread (S5, S12): a writer that finds a sync due wakes the
Db's flusher, which syncs with the store's lock released; writes go on meanwhile and stay
dirty for the next sync; a failed background sync poisons the store; a process killed
while such a sync runs loses nothing that returned."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import numpy as np
import pytest

import armdb
from armdb import _fs
from armdb.errors import StorageError

from .conftest import kill_and_read, spawn_child

Fixed = armdb.queue("bg_fixed", payload=np.dtype([("a", "<u8"), ("b", "<u8")]))
Var = armdb.queue("bg_var", payload=dict, var=True)


class _Gate:
    """Stands in for a sync call: records the calling thread, then waits to be let go."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.go = threading.Event()
        self.threads: list[str] = []

    def __call__(self, *args):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.go.wait(10)
        return self.real(*args)


def _stop_flusher(db: armdb.Db) -> None:
    """The test runs the flusher's sync itself, when it wants (the writers then find no
    flusher to wake and sync themselves, which these tests do not reach)."""
    flusher = db._workers[0]
    flusher.stop()
    flusher.join()


def _background_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, name="test-flusher")
    t.start()
    return t


def test_s5_fixed_flush_runs_outside_the_lock(db_path, monkeypatch):
    # SPEC S5: the timed msync does not hold the shard's lock; a write made meanwhile
    # stays in the dirty range and is flushed by the next sync.
    gate = _Gate(_fs.msync_range)
    with armdb.Db.open(db_path) as db:
        _stop_flusher(db)
        # A timed sync an hour apart: with the 50 ms default, a host slow enough to take
        # 50 ms between the background flush and the second push made that push sync the
        # shard itself, into the held gate.
        header = armdb.FixedConfig.balanced().sync_interval(3600).build()
        q = db.open_queue(Fixed, armdb.QueueConfig.balanced().header_config(header).build())
        q.push((1, 1))
        shard = q._shards[0].fixed
        monkeypatch.setattr(_fs, "msync_range", gate)
        t = _background_thread(shard.sync)
        assert gate.entered.wait(10)
        mark = shard.sf.hwm
        q.push((2, 2))  # the lock is free while the flush waits
        assert shard.lock.acquire(timeout=5)
        shard.lock.release()
        gate.go.set()
        t.join(10)
        assert not t.is_alive()
        assert shard._hwm_synced >= mark
        assert shard.sf.dirty_lo >= 0  # the second push was not covered: still dirty
        monkeypatch.setattr(_fs, "msync_range", gate.real)
        shard.sync()
        assert shard.sf.dirty_lo < 0
        assert shard._hwm_synced == shard.sf.hwm
    assert armdb.check(db_path).ok


def test_s5_bitcask_sync_runs_outside_the_lock(db_path, monkeypatch):
    # SPEC S5: the timed fdatasync of a Bitcask shard does not hold its lock.
    real = os.fdatasync
    gate = _Gate(real)
    with armdb.Db.open(db_path) as db:
        _stop_flusher(db)
        m = db.open_map("bg_map")
        m.put(b"k1", {"v": 1})
        store = m.store
        (sh,) = [s for s in store._shards if s.dirty]
        size = sh.active.size
        monkeypatch.setattr(os, "fdatasync", gate)
        t = _background_thread(store.sync)
        assert gate.entered.wait(10)
        monkeypatch.setattr(os, "fdatasync", real)
        for i in range(50):  # every shard's lock is free meanwhile
            m.put(f"k{i + 2}".encode(), {"v": i})
        gate.go.set()
        t.join(10)
        assert not t.is_alive()
        assert sh.synced >= size
        assert sh.dirty  # appends after the sync began are not covered
        store.sync()
        assert not any(s.dirty for s in store._shards)
    with armdb.Db.open(db_path) as db:
        m = db.open_map("bg_map")
        assert m.get(b"k1") == {"v": 1} and m.get(b"k51") == {"v": 49}
    assert armdb.check(db_path).ok


def test_s5_due_sync_runs_on_the_flusher_not_the_writer(db_path, monkeypatch):
    # SPEC S5: with the default 50 ms interval the writing thread never msyncs itself.
    seen: list[str] = []
    real = _fs.msync_range

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(_fs, "msync_range", spy)
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(Fixed)
        end = time.monotonic() + 0.4
        n = 0
        while time.monotonic() < end and n < 50_000:  # below the grow step: a grow flushes inline
            q.push((n, n))
            n += 1
            if n % 100 == 0:
                time.sleep(0.001)
        time.sleep(0.15)  # at least two flusher periods
        assert seen, "no timed sync ran"
        assert set(seen) == {"armdb-flusher"}, seen


@pytest.mark.parametrize("what", ["fixed", "bitcask"])
def test_s12_failed_background_sync_poisons(db_path, monkeypatch, what):
    # SPEC S12: a sync that fails on the flusher's thread is never retried; the store
    # refuses writes until reopened, and what was written before is intact.
    with armdb.Db.open(db_path) as db:
        _stop_flusher(db)
        q = db.open_queue(Fixed if what == "fixed" else Var)
        # No timed sync in the push either: with the flusher stopped, a push that found
        # one due (50 ms after the open, on a slow host) would sync inline and leave
        # nothing for store.sync() below to fail on.
        later = time.monotonic() + 3600
        for hs in q._shards:
            hs.fixed.sf.last_sync = later
        if q._payload is not None:
            for bs in q._payload._shards:
                bs.last_sync = later
        payload = (7, 7) if what == "fixed" else {"n": 7}
        jid = q.push(payload)

        def fail(*_):
            raise OSError(errno.EIO, "injected")

        if what == "fixed":
            monkeypatch.setattr(_fs, "msync_range", fail)
            store = q._shards[0].fixed
        else:
            monkeypatch.setattr(os, "fdatasync", fail)
            store = q._payload
        with pytest.raises(StorageError):
            store.sync()
        monkeypatch.undo()
        with pytest.raises(StorageError, match="reopen"):
            q.push(payload)
        db.close()
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(Fixed if what == "fixed" else Var)
        (lz,) = q.lease()
        assert lz.id == jid and (tuple(lz.payload) if what == "fixed" else lz.payload) == payload
    assert armdb.check(db_path).ok


SLOW_SYNC_PRODUCER = """
import time, armdb
import numpy as np
from armdb import _fs
import os
real_msync, real_fdatasync = _fs.msync_range, os.fdatasync
def slow_msync(*a):
    time.sleep(0.01)
    return real_msync(*a)
def slow_fdatasync(fd):
    time.sleep(0.01)
    return real_fdatasync(fd)
_fs.msync_range = slow_msync      # the flusher's syncs take a while: kills land inside them
os.fdatasync = slow_fdatasync
db = armdb.Db.open({path!r})
fq = db.open_queue(armdb.queue("bg_fixed", payload=np.dtype([("a", "<u8"), ("b", "<u8")])))
vq = db.open_queue(armdb.queue("bg_var", payload=dict, var=True))
n = {base}
while True:
    a = fq.push((n, n))
    b = vq.push({{"n": n, "pad": "x" * (n % 200)}})
    if n % 3 == 0:
        for lz in vq.lease(1):
            print("leased", lz.id, flush=True)
            vq.ack(lz)
            print("acked", lz.id, flush=True)
    print("pushed", a, b, n, flush=True)
    n += 1
"""


@pytest.mark.crash
def test_s5_sigkill_during_background_sync_loses_nothing(tmp_path):
    # SPEC S5/S12 with D-level crash safety: SIGKILL while the flusher syncs outside the
    # locks; every push that returned is there with its payload, no acked job returns,
    # and check() is clean.
    path = str(tmp_path / "db")
    rng = random.Random(11)
    fixed: dict[int, int] = {}
    var: dict[int, int] = {}
    acked: set[int] = set()
    leased: set[int] = set()
    rounds = int(os.environ.get("ARMDB_KILLS_BGSYNC", "6"))
    for r in range(rounds):
        p = spawn_child(SLOW_SYNC_PRODUCER.format(path=path, base=r * 1_000_000))
        first = p.stdout.readline()  # type: ignore[union-attr]  # open and pushing
        time.sleep(rng.uniform(0.05, 0.3))
        out, _ = kill_and_read(p)
        for line in [first, *out.splitlines()]:
            parts = line.split()
            if parts[:1] == ["pushed"] and len(parts) == 4:
                fixed[int(parts[1])] = int(parts[3])
                var[int(parts[2])] = int(parts[3])
            elif parts[:1] == ["acked"] and len(parts) == 2:
                acked.add(int(parts[1]))
            elif parts[:1] == ["leased"] and len(parts) == 2:
                leased.add(int(parts[1]))  # acked or not: the kill may fall in between
        with armdb.Db.open(path) as db:  # recovery runs on open; check() judges what it left
            db.open_queue(Fixed)
            db.open_queue(Var)
        rep = armdb.check(path)
        assert rep.ok, rep.findings
    hour_later = int(time.time() * 1000) + 3_600_000  # every lease a kill left has expired
    with armdb.Db.open(path, clock=lambda: hour_later) as db:
        fq = db.open_queue(Fixed)
        vq = db.open_queue(Var)
        got_fixed = {lz.id: int(lz.payload[0]) for lz in fq.lease(1_000_000)}
        got_var = {lz.id: lz.payload["n"] for lz in vq.lease(1_000_000)}
    for jid, n in fixed.items():
        assert got_fixed.get(jid) == n, (jid, n)
    for jid, n in var.items():
        if jid not in leased:
            assert got_var.get(jid) == n, (jid, n)
    assert not acked & set(got_var), "an acked job came back"
    assert len(fixed) > 50
    assert armdb.check(path).ok
