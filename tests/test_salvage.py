"""``armdb.salvage``: the explicit way out of an S7 refusal (SPEC S7, docs/operations.md).

The power-loss harness (tests/reliability/test_powerloss.py) runs salvage on every
crash state that open refuses under S7 and checks the state afterwards; these tests
build such files by hand: a record lost in the middle of a file whose later records
survived, as reordered page write-back leaves it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import armdb
from armdb import Config, Db
from armdb.bitcask import DATA_START, _Scan
from armdb.cli import main
from armdb.errors import CorruptionError, DbLocked, FormatError
from armdb.txlog import RECORDS_START as LOG_HEADER_SIZE
from armdb.txlog import _parse_one

from . import marks

MAP_CFG = Config.balanced().shard_count(1).enable_fsync(False).build()


def _map_file(db_path: Path) -> Path:
    return db_path / "collections" / "m" / "shard-000" / "00000001.data"


def _record_offsets(path: Path) -> list[int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [rec[0] for rec in _Scan(fd, os.fstat(fd).st_size, False, DATA_START)]
    finally:
        os.close(fd)


def _zero(path: Path, offset: int, n: int) -> None:
    """A page write lost to a power cut: the bytes read back as zeros."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * n)


def _map_with_hole(tmp_path: Path, n: int = 20, hole: int = 10) -> tuple[Path, int, bytes]:
    """A map of ``n`` puts whose record ``hole`` reads as zeros; returns the path, the
    hole's offset and the file's bytes from there on."""
    path = tmp_path / "db"
    with Db.open(path) as db:
        m = db.open_map("m", MAP_CFG)
        for i in range(n):
            m.put(i, f"value {i}")
    data = _map_file(path)
    offsets = _record_offsets(data)
    assert len(offsets) == n
    _zero(data, offsets[hole], 24)
    return path, offsets[hole], data.read_bytes()[offsets[hole] :]


def test_s7_salvage_cuts_a_map_file_at_its_hole_and_keeps_the_cut_bytes(tmp_path: Path) -> None:
    path, hole_at, tail = _map_with_hole(tmp_path)
    with Db.open(path) as db, pytest.raises(CorruptionError, match="armdb salvage") as refused:
        db.open_map("m", MAP_CFG)
    # A cleanly closed file: its synced mark covers the hole, so it is damage (S7).
    assert "which a completed sync covered" in str(refused.value)

    report = armdb.salvage(path)
    (cut,) = report.cuts
    assert cut.path == os.path.join("collections", "m", "shard-000", "00000001.data")
    assert (cut.offset, cut.dropped_bytes, cut.dropped_records) == (hole_at, len(tail), 9)
    assert cut.next_valid > cut.offset
    assert cut.kept_as is not None and (path / cut.kept_as).read_bytes() == tail
    assert _map_file(path).stat().st_size == hole_at
    assert "cut 1 file(s)" in str(report) and cut.kept_as in str(report)

    with Db.open(path) as db:
        m = db.open_map("m", MAP_CFG)
        assert {i: m.get(i) for i in range(20)} == {i: (f"value {i}" if i < 10 else None) for i in range(20)}
        m.put(99, "after")  # writable again
    assert armdb.check(path).ok
    assert armdb.salvage(path).cuts == []  # nothing left to cut


def test_s7_salvage_dry_run_changes_nothing(tmp_path: Path) -> None:
    path, hole_at, _tail = _map_with_hole(tmp_path)
    before = _map_file(path).read_bytes()
    report = armdb.salvage(path, dry_run=True)
    (cut,) = report.cuts
    assert cut.offset == hole_at and cut.kept_as is None
    assert "would cut 1 file(s)" in str(report)
    assert _map_file(path).read_bytes() == before
    assert not (path / "salvaged").exists()
    with Db.open(path) as db, pytest.raises(CorruptionError):
        db.open_map("m", MAP_CFG)


def test_s7_salvage_leaves_a_torn_tail_to_open(tmp_path: Path) -> None:
    # The last record is the bad one and no synced mark covers it (as a crash before any
    # sync leaves it; a clean close would mark it synced): a torn tail, which open cuts
    # by itself (S7).
    path, _hole_at, _tail = _map_with_hole(tmp_path, n=5, hole=4)
    marks.clear(_map_file(path))
    assert armdb.salvage(path).cuts == []
    with Db.open(path) as db:
        m = db.open_map("m", MAP_CFG)
        assert [m.get(i) for i in range(5)] == ["value 0", "value 1", "value 2", "value 3", None]


def test_s7_salvage_cuts_the_log_at_a_damaged_record(tmp_path: Path) -> None:
    # A child commits ten durable transactions and is killed before any checkpoint; then
    # the log's fifth record is zeroed.  A sync covered it (its mark and the flags of the
    # records after it say so), so it is damage: open refuses and salvage cuts.  (With
    # non-durable commits the same hole is a tail a power cut reordered, which open cuts
    # by itself since synced marks exist: tests/test_s7_synced_mark.py.)
    path = tmp_path / "db"
    child = textwrap.dedent(
        f"""
        import os, signal
        from armdb import Config, Db
        db = Db.open({str(path)!r})
        m = db.open_map("m", Config.balanced().shard_count(1).enable_fsync(False).build())
        for i in range(10):
            db.tx().put(m, i, "v%d" % i).durable().commit()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    (log,) = sorted((path / "txlog").glob("*.log"))
    raw = log.read_bytes()
    offsets, pos = [], LOG_HEADER_SIZE
    while (rec := _parse_one(raw, pos)) is not None:
        offsets.append(pos)
        pos = rec[3]
    assert len(offsets) >= 10
    fifth = offsets[-6]  # the map's ten commits are the last ten records
    _zero(log, fifth, 16)

    with pytest.raises(CorruptionError, match="damage, not a torn write") as refused:
        Db.open(path)
    assert "armdb salvage" in str(refused.value)

    (cut,) = armdb.salvage(path).cuts
    assert cut.path == os.path.join("txlog", log.name)
    assert (cut.offset, cut.dropped_records) == (fifth, 5)
    with Db.open(path) as db:
        m = db.open_map("m", MAP_CFG)
        # The killed process had applied every commit to the store's pages, which a
        # process kill keeps; the log records salvage dropped were only their redo.
        assert [m.get(i) for i in range(10)] == [f"v{i}" for i in range(10)]
    assert armdb.check(path).ok


def test_s7_salvage_refuses_an_open_database_and_a_foreign_directory(tmp_path: Path) -> None:
    path, _hole_at, _tail = _map_with_hole(tmp_path)
    with Db.open(path), pytest.raises(DbLocked):
        armdb.salvage(path)
    with pytest.raises(FormatError, match="not an armdb database"):
        armdb.salvage(tmp_path / "elsewhere")


def test_c_salvage_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, hole_at, _tail = _map_with_hole(tmp_path)
    assert main(["salvage", str(path), "--dry-run"]) == 0
    assert "would cut 1 file(s)" in capsys.readouterr().out
    assert main(["salvage", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"at offset {hole_at}" in out and "kept in salvaged" in out
    assert main(["salvage", str(path)]) == 0
    assert "nothing to cut" in capsys.readouterr().out
    assert main(["salvage", str(tmp_path / "none")]) == 1
    assert "not an armdb database" in capsys.readouterr().err


def test_s7_q15_salvaged_var_queue_drops_the_rows_whose_bodies_were_cut(tmp_path: Path) -> None:
    # A var queue's body file loses a record in the middle; after salvage, the rows whose
    # bodies went with the cut are dropped at open (never a header without its body, Q15).
    path = tmp_path / "db"
    jobs = armdb.queue("jobs", payload=dict, var=True)
    cfg = armdb.QueueConfig.balanced().payload_config(Config.balanced().shard_count(1).build()).build()
    with Db.open(path) as db:
        q = db.open_queue(jobs, cfg)
        for i in range(20):
            q.push({"n": i})
    data = path / "collections" / "jobs.payload" / "shard-000" / "00000001.data"
    offsets = _record_offsets(data)
    assert len(offsets) == 20
    _zero(data, offsets[12], 24)
    with Db.open(path) as db, pytest.raises(CorruptionError, match="armdb salvage"):
        db.open_queue(jobs, cfg)

    (cut,) = armdb.salvage(path).cuts
    assert (cut.offset, cut.dropped_records) == (offsets[12], 7)
    with Db.open(path) as db:
        q = db.open_queue(jobs, cfg)
        assert len(q) == 12
        assert q.stats().repaired_on_open == 8  # rows 12..19
        assert sorted(lease.payload["n"] for lease in q.lease(20)) == list(range(12))
    assert armdb.check(path).ok
