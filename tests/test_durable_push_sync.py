"""A durable store's one-frame sync (``FixedShard._durable_flush``): the same flushes as the
general path, every write's page flushed before the call returns, and SIGKILL safety.

The power-loss harness (tests/reliability/test_powerloss.py) runs on a recording file
system, whose maps report every store, so it always takes the general path
(``FixedShard._sync_locked``).  The one-frame path runs only on maps that report
nothing; these tests pin it to the general path instead: same msync calls, in the same
order, over the same ranges, leaving the same high-water marks.
"""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import Db, FixedConfig, QueueConfig, _fs
from armdb.fixed import FixedShard

from .conftest import FakeClock, kill_and_read, spawn_child

PAYLOAD = np.dtype([("doc", "<u8"), ("flags", "<u4")])
Pings = armdb.queue("pings", payload=PAYLOAD)


def durable_config(grow_step: int = 4096) -> QueueConfig:
    header = FixedConfig.balanced().grow_step(grow_step).sync_interval(0).build()
    return QueueConfig.balanced().header_config(header).build()


class MsyncLog(_fs.RealFS):
    """The real file system, recording each msync as ``(file name, offset, length)``.

    Overrides only ``_msync``: the maps stay plain, so durable stores keep their
    one-frame sync."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def _msync(self, mf: _fs.MappedFile, offset: int, length: int) -> None:
        self.calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{mf.fd}")), offset, length))
        super()._msync(mf, offset, length)


def _shard(q: Any) -> FixedShard:
    (shard,) = q._headers.shards
    return shard


@contextmanager
def _quiet_db(path: Path, fs: _fs.FS) -> Iterator[Db]:
    """A database on ``fs`` with a fake clock and no background sync (only the writes'
    own syncs reach ``fs``), shut at the end."""
    with _fs.use(fs):
        db = Db.open(path, clock=FakeClock())
        try:
            for w in db._workers:
                w.stop()
                w.join()
            yield db
        finally:
            db.shutdown()


def _run(path: Path, *, lean: bool) -> tuple[list[tuple[str, int, int]], list[list[tuple[str, int, int]]], tuple[int, ...]]:
    """Durable pushes, leases and acks; returns every msync, the msyncs of each push, and
    the shard's marks at the end."""
    fs = MsyncLog()
    per_push: list[list[tuple[str, int, int]]] = []
    with _quiet_db(path, fs) as db:
        q = db.open_queue(Pings, durable_config())
        shard = _shard(q)
        assert shard._lean  # a plain map: the one-frame sync
        shard._lean = lean
        for i in range(150):
            before = len(fs.calls)
            q.push((i, 0))
            per_push.append(fs.calls[before:])
            if i % 3 == 2:
                (lease,) = q.lease(1)
                q.ack(lease.token)  # an overwrite of a live row: redo record first
        marks = (shard._hwm_a, shard._hwm_b, shard._hwm_synced, shard._hwm_gen, int(shard.sf.hwm))
    return fs.calls, per_push, marks


def test_s5_one_frame_durable_sync_flushes_exactly_as_the_general_path(tmp_path: Path) -> None:
    # SPEC S5 (sync_interval 0: every write synced before it returns), S4 (redo first)
    lean_calls, lean_pushes, lean_marks = _run(tmp_path / "lean", lean=True)
    general_calls, _, general_marks = _run(tmp_path / "general", lean=False)
    assert lean_calls == general_calls
    assert lean_marks == general_marks
    # Every push flushed the page of its own slot before it returned.
    slot_size = 128
    for i, calls in enumerate(lean_pushes):
        data = [(off, n) for name, off, n in calls if name == "fixed.data"]
        assert data, f"push {i} returned without a flush of fixed.data"
    # The copy of the mark in the data file's header page was rewritten along the way.
    assert any(name == "fixed.data" and off == 0 for name, off, _ in lean_calls)
    assert slot_size * 150 > 4096  # the pushes crossed pages: more than one page was flushed
    assert len({off for name, off, _ in lean_calls if name == "fixed.data"}) > 2


def test_s12_one_frame_durable_sync_failure_poisons_the_store(tmp_path: Path) -> None:
    # SPEC S12: a failed msync is never retried, the store refuses writes until reopen
    class Fails(MsyncLog):
        fail = False

        def _msync(self, mf: _fs.MappedFile, offset: int, length: int) -> None:
            if self.fail:
                raise OSError(5, "injected msync failure")
            super()._msync(mf, offset, length)

    fs = Fails()
    with _quiet_db(tmp_path / "db", fs) as db:
        q = db.open_queue(Pings, durable_config())
        assert _shard(q)._lean
        ids = [q.push((i, 0)) for i in range(3)]
        fs.fail = True
        try:
            q.push((9, 0))
        except armdb.StorageError as e:
            assert "injected msync failure" in str(e)
            assert isinstance(e.__cause__, OSError)
        else:
            raise AssertionError("a push whose sync failed returned")
        fs.fail = False
        try:
            q.push((10, 0))
        except armdb.StorageError as e:
            assert "refused" in str(e)
        else:
            raise AssertionError("a poisoned store took a write")
    with Db.open(tmp_path / "db") as db:
        q = db.open_queue(Pings, durable_config())
        assert set(ids) <= set(q.snapshot()["id"].tolist())


PUSHER = """
import armdb, numpy as np
from armdb import FixedConfig, QueueConfig
db = armdb.Db.open({path!r})
header = FixedConfig.balanced().grow_step(256).sync_interval(0).build()
q = db.open_queue(armdb.queue("pings", payload=np.dtype([("doc", "<u8"), ("flags", "<u4")])),
                  QueueConfig.balanced().header_config(header).build())
(shard,) = q._headers.shards
print("D", int(shard.sf.wfd == shard._fd >= 0), flush=True)  # the writes go by pwrite
n = {base}
while True:
    jid = q.push((n, 1))
    print("P", jid, n, flush=True)
    if n % 4 == 3:
        for lz in q.lease(2):
            print("L", lz.id, flush=True)  # an ack in flight: the row may be there or gone
            q.ack(lz.token)
            print("A", lz.id, flush=True)
    n += 1
"""


def test_s5_durable_pushes_survive_sigkill(tmp_path: Path) -> None:
    # SPEC S5, Q12: every push that returned is there after a SIGKILL, no acked row returns,
    # and check() finds nothing half-written (the child's store writes by pwrite)
    path = tmp_path / "db"
    rng = random.Random(17)
    pushed: dict[int, int] = {}
    leased: set[int] = set()
    acked: set[int] = set()
    rounds = int(os.environ.get("ARMDB_KILLS_DURABLE_PUSH", "4"))
    for r in range(rounds):
        p = spawn_child(PUSHER.format(path=str(path), base=r * 1_000_000))
        assert p.stdout is not None
        assert p.stdout.readline().split() == ["D", "1"]  # the writes killed are direct writes
        first = p.stdout.readline()  # the queue is open and pushing
        time.sleep(rng.uniform(0.05, 0.4))
        out, _ = kill_and_read(p)
        for line in (first + out).splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "P":
                pushed[int(parts[1])] = int(parts[2])
            elif len(parts) == 2 and parts[0] == "L":
                leased.add(int(parts[1]))
            elif len(parts) == 2 and parts[0] == "A":
                acked.add(int(parts[1]))
        rep = armdb.check(path)
        assert rep.ok, rep.findings
        with Db.open(path) as db:
            q = db.open_queue(Pings, durable_config(256))
            present = set(q.snapshot()["id"].tolist())
        missing = [jid for jid in pushed if jid not in leased and jid not in present]
        assert not missing, missing[:5]
        assert not (acked & present), sorted(acked & present)[:5]
    assert len(pushed) > 50
    with Db.open(path) as db:
        q = db.open_queue(Pings, durable_config(256))
        got = {lz.id: int(lz.payload["doc"]) for lz in q.lease(1_000_000)}
    # A row whose lease the kill cut short stays leased for now (its "L" line may not
    # have been printed yet) and an acked row is gone; each row the lease hands out
    # carries the payload its push was given (rows are checked present above).
    seen = [jid for jid in got if jid in pushed]
    assert len(seen) > 50
    for jid in seen:
        assert got[jid] == pushed[jid], (jid, pushed[jid])
    assert armdb.check(path).ok


def test_s5_background_tick_leaves_a_busy_durable_store_and_refreshes_an_idle_one(tmp_path: Path) -> None:
    # SPEC S5 (durable writes sync themselves); the mark's copy A is refreshed once idle
    fs = MsyncLog()
    with _quiet_db(tmp_path / "db", fs) as db:
        q = db.open_queue(Pings, durable_config())
        shard = _shard(q)
        for i in range(10):
            q.push((i, 0))
        before = len(fs.calls)
        shard.sync()  # the flusher's tick right after a write: nothing to do
        assert fs.calls[before:] == []
        assert shard._hwm_a < shard._hwm_synced  # copy A lags (fewer than HWM_STEP slots)
        shard.sf.last_sync -= 1.0  # no write for a second: the store is idle
        shard.sync()
        assert ("fixed.data", 0, 4096) in fs.calls[before:]  # the header page, copy A
        assert shard._hwm_a == shard._hwm_synced


# -- direct writes: a lean durable store writes by pwrite(2), not through the mapping --------------


def _slot_bytes(shard: FixedShard, slot: int) -> tuple[bytes, bytes]:
    """Slot ``slot`` as the file holds it (pread) and as the mapping shows it."""
    size = shard.slot_size
    on_file = os.pread(shard._fd, size, 4096 + slot * size)
    return on_file, bytes(shard.slots[slot])


def test_s5_a_lean_durable_store_writes_slots_and_redo_records_by_pwrite(tmp_path: Path) -> None:
    # SPEC S5, S4: the slot and the redo record reach the files by pwrite, and the mapping
    # the reads use shows what the file holds
    with _quiet_db(tmp_path / "db", _fs.RealFS()) as db:
        q = db.open_queue(Pings, durable_config())
        shard = _shard(q)
        assert (shard.sf.wfd, shard.sf.rfd) == (shard._fd, shard._redo_fd)
        jid = q.push((7, 3))
        slot = int(np.flatnonzero(shard.status == 1)[0])
        on_file, mapped = _slot_bytes(shard, slot)
        assert on_file == mapped and any(on_file)
        (lease,) = q.lease(1)  # an overwrite of the live row: its redo record first
        assert lease.id == jid and int(lease.payload["doc"]) == 7
        on_file, mapped = _slot_bytes(shard, slot)
        assert on_file == mapped
        record = os.pread(shard._redo_fd, 16 + shard.slot_size, 64)
        assert record[16:] == on_file  # the redo record holds the image copied into the slot
        q.ack(lease.token)
        assert q.len() == 0
        # A store that is not durable, or whose map reports its stores, writes through the map.
        plain = db.open_queue(armdb.queue("plain", payload=PAYLOAD), QueueConfig.balanced().build())
        assert _shard(plain).sf.wfd == -1 and _shard(plain).sf.rfd == -1

    class Reporting(_fs.RealFS):
        def mmap(self, fd: int, length: int) -> _fs.MappedFile:
            class Map(_fs.MappedFile):
                def wrote(self, offset: int, length: int) -> None:
                    pass
            return Map(self, fd, length)

    with _quiet_db(tmp_path / "db2", Reporting()) as db:
        q = db.open_queue(Pings, durable_config())
        assert _shard(q).sf.wfd == -1


@contextmanager
def _failing_writes(shard: FixedShard, *, redo: bool) -> Iterator[None]:
    """Direct writes to the shard's data (or redo) file fail while the block runs: its
    ``SlotFile`` is bound to a read-only descriptor of the file, through which a pwrite
    fails (EBADF) as a write the disk refuses would."""
    fd = shard._redo_fd if redo else shard._fd
    ro = os.open(os.readlink(f"/proc/self/fd/{fd}"), os.O_RDONLY)
    fds = (shard._fd, ro) if redo else (ro, shard._redo_fd)
    try:
        shard.sf.bind(shard.slots, shard.versions, shard.status, shard.redo, *fds)
        yield
    finally:
        shard.sf.bind(shard.slots, shard.versions, shard.status, shard.redo, shard._fd, shard._redo_fd)
        os.close(ro)


def test_s12_a_failed_direct_slot_write_poisons_the_store_and_the_file_keeps_the_rows(tmp_path: Path) -> None:
    # SPEC S12: a failed write is reported by the push, the store refuses writes until it is
    # reopened, and nothing of the failed push is in the file
    path = tmp_path / "db"
    with _quiet_db(path, _fs.RealFS()) as db:
        q = db.open_queue(Pings, durable_config())
        shard = _shard(q)
        ids = [q.push((i, 0)) for i in range(5)]
        with _failing_writes(shard, redo=False):
            with pytest.raises(armdb.StorageError, match="writing a slot failed") as ei:
                q.push((99, 0))
            assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.EBADF
            assert "reopened" in str(ei.value)
            with pytest.raises(armdb.StorageError, match="refused"):
                q.push((100, 0))
    assert armdb.check(path).ok
    with Db.open(path) as db:
        q = db.open_queue(Pings, durable_config())
        got = sorted((lz.id, int(lz.payload["doc"])) for lz in q.lease(100))
        assert got == [(jid, i) for i, jid in enumerate(ids)]  # nothing of the failed push


def test_s4_a_failed_redo_write_leaves_the_live_row_untouched(tmp_path: Path) -> None:
    # SPEC S4, S12: an overwrite whose redo record could not be written copies nothing into
    # the slot; after the reopen the row is still ready with its payload
    path = tmp_path / "db"
    with _quiet_db(path, _fs.RealFS()) as db:
        q = db.open_queue(Pings, durable_config())
        shard = _shard(q)
        jid = q.push((42, 1))
        slot = int(np.flatnonzero(shard.status == 1)[0])
        before, _ = _slot_bytes(shard, slot)
        with _failing_writes(shard, redo=True):
            with pytest.raises(armdb.StorageError, match="writing a slot failed"):
                q.lease(1)
            after, mapped = _slot_bytes(shard, slot)
            assert after == before == mapped  # the slot was not touched
    assert armdb.check(path).ok
    with Db.open(path) as db:
        q = db.open_queue(Pings, durable_config())
        (lease,) = q.lease(1)
        assert lease.id == jid and int(lease.payload["doc"]) == 42 and lease.attempt == 1
