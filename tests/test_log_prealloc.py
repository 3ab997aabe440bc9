"""The transaction log's files are allocated ahead (SPEC T2, S7; docs/format.md, "Log
files").

At its first durable commit, a log file gets its blocks up to ``checkpoint_bytes`` and 1
MiB more, so that a durable commit's ``fdatasync`` does not also journal a larger file;
its records are then followed by zeros to the file's end.  These tests check that a zero tail reads as the
records' clean end (no torn tail, nothing dropped, nothing for check to report), that it
does not hide damage (zeros where a completed sync covered records), that a torn record
before it is still cut, that a clean close cuts the zeros off, and that a failed
allocation (a full disk, an I/O error) still takes commits.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from pathlib import Path

import pytest

import armdb
from armdb import TxConfig, _fs
from armdb.errors import CorruptionError
from armdb.logformat import RECORDS_START, _records_at, synced_mark

from . import marks
from .conftest import child_env, kill_and_read, spawn_child

MIB = 1 << 20


def _log_files(db_path: Path) -> list[Path]:
    return sorted((db_path / "txlog").glob("*.log"))


def _records_end(path: Path) -> int:
    return marks.log_records_end(path.read_bytes())


def _crash_after_durable_commits(db_path: Path, n: int, *, mid_write: bool = False) -> list[int]:
    """A child commits durable 2-row transactions, printing each key once its commit
    returned, and is killed (SIGKILL): after ``n`` of them while it goes on committing
    (``mid_write``), or once it stopped after ``n``.  Returns the keys it acknowledged."""
    p = spawn_child(f"""
        import armdb, itertools, time
        db = armdb.Db.open({str(db_path)!r})
        a = db.open_map("a")
        b = db.open_map("b")
        for i in itertools.count() if {mid_write} else range({n}):
            db.tx().put(a, i, i).put(b, i, -i).durable().commit()
            print(i, flush=True)
        print("all", flush=True)
        time.sleep(60)
    """, env=child_env())
    assert p.stdout is not None
    acked = []
    while len(acked) < n:
        line = p.stdout.readline()
        assert line, "the child died before its commits"
        acked.append(int(line))
    if not mid_write:
        assert p.stdout.readline().strip() == "all"
    out, _err = kill_and_read(p)
    acked += [int(x) for x in out.split() if x != "all"]  # printed before the kill
    return acked


# SPEC T2
def test_t2_a_log_file_is_allocated_ahead_at_its_first_durable_commit_and_close_cuts_the_zeros(db_path):
    db = armdb.Db.open(db_path, tx_config=TxConfig(checkpoint_bytes=64 * 1024))
    m = db.open_map("m")
    (f,) = _log_files(db_path)
    db.tx().put(m, 0, "zero").commit()
    assert f.stat().st_size == _records_end(f)  # a log nothing syncs gains nothing from it
    db.tx().put(m, 1, "one").durable().commit()
    assert f.stat().st_size == 64 * 1024 + MIB
    assert f.stat().st_blocks * 512 >= 64 * 1024 + MIB  # blocks, not a sparse file
    for i in range(200):  # past checkpoint_bytes: the checkpoint starts a new file
        db.tx().put(m, i, "x" * 1000).commit()
    files = _log_files(db_path)
    assert files[-1] != f
    db.tx().put(m, 1, "one").durable().commit()
    assert files[-1].stat().st_size == 64 * 1024 + MIB  # allocated at its own first durable commit
    db.close()
    (last,) = _log_files(db_path)
    assert last.stat().st_size == _records_end(last)  # a clean close leaves no zeros


def test_t2_the_allocation_is_capped(db_path):
    db = armdb.Db.open(db_path, tx_config=TxConfig(checkpoint_bytes=1 << 30))
    try:
        db.tx().put(db.open_map("m"), 1, 1).durable().commit()
        (f,) = _log_files(db_path)
        assert f.stat().st_size == 64 * MIB + MIB
    finally:
        db.shutdown()


# SPEC T2, S7
def test_t2_killed_mid_commits_reopens_with_the_zero_tail_as_a_clean_end(db_path, caplog):
    acked = _crash_after_durable_commits(db_path, 300, mid_write=True)
    (f,) = _log_files(db_path)
    raw = f.read_bytes()
    end = _records_end(f)
    assert len(raw) == 4 * MIB + MIB and end < len(raw) and not any(raw[end:])
    replayed = len(_records_at(raw, RECORDS_START)[0])
    assert replayed >= len(acked)  # every acknowledged commit is in the log
    with caplog.at_level(logging.INFO, logger="armdb"):
        with armdb.Db.open(db_path) as db:
            a, b = db.open_map("a"), db.open_map("b")
            assert all(a.get(i) == i and b.get(i) == -i for i in acked)
            stats = db.txlog.stats()
            assert stats["replayed"] == replayed
            assert stats["torn_bytes_dropped"] == 0 and stats["unsynced_records_dropped"] == 0
    assert not [r for r in caplog.records if "tail" in r.getMessage()]
    assert armdb.check(db_path).ok


# SPEC T2
def test_t2_a_torn_record_before_the_zeros_is_cut(db_path):
    acked = _crash_after_durable_commits(db_path, 20)
    assert acked == list(range(20))
    (f,) = _log_files(db_path)
    end = _records_end(f)
    raw = bytearray(f.read_bytes())
    # Mark the file as never synced past its first record, then tear the last record
    # into zeros from its middle: a power cut that wrote half of its page.
    offsets = [off for off, *_ in _records_at(bytes(raw), RECORDS_START)[0]]
    last = offsets[-1]
    raw[last + 30 : end] = bytes(end - last - 30)
    raw[32:64] = bytes(32)  # no synced mark: the tail is not known to be synced
    f.write_bytes(bytes(raw))
    with armdb.Db.open(db_path) as db:
        stats = db.txlog.stats()
        # (The stores may hold the last commit's rows anyway: a killed process's writes
        # reach the page cache.  What the log replays is what this checks.)
        assert stats["replayed"] == len(acked) - 1
        assert stats["torn_bytes_dropped"] == len(raw) - last


# SPEC S7
def test_s7_zeros_where_a_sync_covered_records_are_damage(db_path):
    _crash_after_durable_commits(db_path, 20)
    (f,) = _log_files(db_path)
    raw = bytearray(f.read_bytes())
    version = struct.unpack_from("<I", raw, 8)[0]
    mark = synced_mark(bytes(raw), version, str(f.parent))
    offsets = [off for off, *_ in _records_at(bytes(raw), RECORDS_START)[0]]
    assert mark > offsets[-1]  # durable commits: the last one's sync is marked
    raw[offsets[-1] :] = bytes(len(raw) - offsets[-1])  # synced records gone, zeros left
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="records end at offset .* which a completed sync covered"):
        armdb.Db.open(db_path)
    assert any("synced records are missing" in x for x in armdb.check(db_path).findings)
    assert f.read_bytes() == bytes(raw)  # refused, not cut
    # salvage is the way out: it cuts the file where its records end and forgets the mark
    report = armdb.salvage(db_path)
    (cut,) = report.cuts
    assert cut.offset == offsets[-1] and cut.dropped_records == 0
    with armdb.Db.open(db_path) as db:
        assert db.open_map("a").get(0) == 0


class _NoRoomToAllocate(_fs.RealFS):
    def __init__(self, err: int) -> None:
        self.err = err
        self.calls = 0

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        self.calls += 1
        raise OSError(self.err, os.strerror(self.err))


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
# SPEC T2
def test_t2_a_failed_allocation_ahead_still_commits(db_path, err, caplog):
    fs = _NoRoomToAllocate(err)
    with _fs.use(fs), caplog.at_level(logging.WARNING, logger="armdb"):
        with armdb.Db.open(db_path) as db:
            m = db.open_map("m")
            db.tx().put(m, 1, "one").durable().commit()
            db.tx().put(m, 2, "two").durable().commit()
            (f,) = _log_files(db_path)
            assert f.stat().st_size == _records_end(f)  # grows as it is written
    assert fs.calls == 1  # tried once a file
    assert [r for r in caplog.records if "could not allocate the log file ahead" in r.getMessage()]
    with armdb.Db.open(db_path) as db:
        assert db.open_map("m").get(2) == "two"


class _CheckLocked(_fs.RealFS):
    """Asserts, at each allocation of a log file, that no append can run meanwhile."""

    def __init__(self) -> None:
        self.db: armdb.Db | None = None
        self.seen = 0

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        if self.db is not None and fd == self.db.txlog._fd:
            assert self.db.txlog._lock.locked()
            self.seen += 1
        super().fallocate(fd, offset, length)


# SPEC T2
def test_t2_the_allocation_ahead_holds_off_appends(db_path):
    # Where the file system cannot allocate, RealFS.fallocate writes zeros over the pages
    # that read as zeros: an append made meanwhile would be overwritten.
    fs = _CheckLocked()
    with _fs.use(fs), armdb.Db.open(db_path) as db:
        fs.db = db
        db.tx().put(db.open_map("m"), 1, 1).durable().commit()
    assert fs.seen == 1

