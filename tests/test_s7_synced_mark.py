"""SPEC S7 (since turn 2): the synced mark and the synced-before flag tell a tail that a
power cut wrote out of order from damage.

A crash state is taken by copying the database folder while it is open (what a process
kill leaves); the files are then damaged as a power cut (or a bad disk) would.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest

import armdb
from armdb import Config, Db, _syncmark, bitcask, txlog
from armdb.errors import CorruptionError

MAP_CFG = Config.balanced().shard_count(1).enable_fsync(False).build()
SYNCED_CFG = Config.balanced().shard_count(1).enable_fsync(True).sync_interval(0).build()


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


# -- the transaction log ------------------------------------------------------------------


def _log_state(tmp_path: Path, durable: list[bool]) -> tuple[Path, Path, list[tuple[int, int]]]:
    """A crash state after one commit per entry of ``durable``: the database folder, its
    log file and each commit record's ``(offset, flags)``."""
    live, snap = tmp_path / "live", tmp_path / "snap"
    db = Db.open(live)
    m = db.open_map("m", MAP_CFG)
    for i, d in enumerate(durable):
        tx = db.tx().put(m, i, "v%d" % i)
        (tx.durable() if d else tx).commit()
    shutil.copytree(live, snap)
    db.close()
    (log,) = sorted((snap / "txlog").glob("*.log"))
    raw = log.read_bytes()
    recs, _end, bad = txlog._records_at(raw, txlog.FILE_HEADER_SIZE)
    assert bad is None
    return snap, log, [(off, flags) for off, _txid, flags, _body in recs][-len(durable) :]


def _body(offset: int) -> int:
    return offset + txlog.REC_HEAD_SIZE + 2  # a byte inside the record's body


def test_s7_log_bad_record_before_unflagged_records_is_cut_with_a_warning(tmp_path, caplog):
    snap, log, recs = _log_state(tmp_path, [True, False, False, False])
    assert [bool(f & txlog.FLAG_SYNCED_BEFORE) for _o, f in recs] == [True, True, False, False]
    _flip(log, _body(recs[2][0]))  # an unsynced record; only an unflagged one follows
    size = log.stat().st_size
    # check, before the open, says what open will do: cut the tail, not refuse it
    assert any(f"unsynced tail of {size - recs[2][0]} bytes at offset {recs[2][0]}, 1 intact record" in f
               for f in armdb.check(snap).findings), armdb.check(snap)
    with caplog.at_level(logging.WARNING, logger="armdb"), Db.open(snap) as db:
        m = db.open_map("m", MAP_CFG)
        assert db.txlog.stats()["unsynced_records_dropped"] == 1
        assert db.txlog.stats()["torn_bytes_dropped"] == size - recs[2][0]
        assert m.get(0) == "v0" and m.get(1) == "v1"
    assert any("unsynced log tail" in r.getMessage() and "1 intact record" in r.getMessage() for r in caplog.records)


def test_s7_log_bad_record_before_a_flagged_record_is_refused(tmp_path):
    snap, log, recs = _log_state(tmp_path, [True, True])
    assert recs[1][1] & txlog.FLAG_SYNCED_BEFORE
    _syncmark.drop(str(snap / "txlog"))  # the flag alone proves it
    _flip(log, _body(recs[0][0]))
    assert any(f"offset {recs[0][0]} is damaged" in f for f in armdb.check(snap).findings)
    with pytest.raises(CorruptionError, match=rf"offset {recs[0][0]} is damaged.*offset {recs[1][0]}"):
        Db.open(snap)


def test_s7_log_bad_record_below_the_mark_is_refused(tmp_path):
    # The last record, with nothing after it: without the mark it would be a torn tail.
    snap, log, recs = _log_state(tmp_path, [True, True, True])
    _flip(log, _body(recs[2][0]))
    with pytest.raises(CorruptionError, match=rf"offset {recs[2][0]} is damaged below offset"):
        Db.open(snap)


def test_s7_log_torn_mark_cell_is_ignored_and_the_other_cell_used(tmp_path):
    snap, log, recs = _log_state(tmp_path, [True, True, True])
    head = log.read_bytes()[: txlog.FILE_HEADER_SIZE]
    mark_file = snap / "txlog" / _syncmark.MARK_NAME
    cells = mark_file.read_bytes()
    newest, gen = _syncmark.parse_cells(cells, head)
    assert newest == log.stat().st_size and gen >= 2
    older_cell = (gen - 1) % 2
    older = struct.unpack_from("<Q", cells, older_cell * 16)[0]
    assert older == recs[2][0]  # the mark after the second commit's sync
    _flip(mark_file, (gen % 2) * 16 + 3)  # tear the newest cell
    assert _syncmark.parse_cells(mark_file.read_bytes(), head) == (older, gen - 1)
    _flip(log, _body(recs[2][0]))  # at the older mark, not below it: a torn tail
    size = log.stat().st_size
    with Db.open(snap) as db:
        assert db.txlog.stats()["torn_bytes_dropped"] == size - recs[2][0]
        assert db.open_map("m", MAP_CFG).get(1) == "v1"


def _old_log(raw: bytes, version: int) -> bytes:
    head = txlog._FILE_HEAD.pack(txlog.FILE_MAGIC, version, 0, 1)
    head += struct.pack("<I", zlib.crc32(head))
    return head + bytes(txlog.FILE_HEADER_SIZE - len(head)) + raw[txlog.FILE_HEADER_SIZE :]


@pytest.mark.parametrize("version", [2, 3])
def test_s7_log_old_format_keeps_the_old_rule(tmp_path, version):
    snap, log, recs = _log_state(tmp_path, [False, False, False])
    _syncmark.drop(str(snap / "txlog"))
    log.write_bytes(_old_log(log.read_bytes(), version))
    _flip(log, _body(recs[1][0]))
    if version == 2:
        with pytest.raises(CorruptionError, match="later records are intact"):
            Db.open(snap)
    else:
        with Db.open(snap) as db:
            assert db.txlog.stats()["unsynced_records_dropped"] == 1


def test_s7_log_clean_close_leaves_the_mark_at_the_end(tmp_path):
    with Db.open(tmp_path / "db") as db:
        m = db.open_map("m", MAP_CFG)
        db.tx().put(m, 1, "x").commit()
    (log,) = sorted((tmp_path / "db" / "txlog").glob("*.log"))
    raw = log.read_bytes()
    mark, _gen = _syncmark.read_mark(str(tmp_path / "db" / "txlog"), raw[: txlog.FILE_HEADER_SIZE])
    assert mark == len(raw)


# -- a map's Bitcask active data file ----------------------------------------------------


def _map_state(tmp_path: Path, cfg: Config, n: int, *, clean: bool = False) -> tuple[Path, Path, list[tuple[int, int]]]:
    """A map of ``n`` puts, as a crash leaves it (or after a clean close): the database
    folder, the map's active data file and each record's ``(offset, gsn word)``."""
    live, snap = tmp_path / "live", tmp_path / "snap"
    db = Db.open(live)
    m = db.open_map("m", cfg)
    for i in range(n):
        m.put(i, "value %d" % i)
    if clean:
        db.close()
        shutil.copytree(live, snap)
    else:
        shutil.copytree(live, snap)
        db.close()
    data = snap / "collections" / "m" / "shard-000" / "00000001.data"
    fd = os.open(data, os.O_RDONLY)
    try:
        recs = [(r[0], r[1]) for r in bitcask._Scan(fd, os.fstat(fd).st_size, False)]
    finally:
        os.close(fd)
    assert len(recs) == n
    return snap, data, recs


def _flagged(recs: list[tuple[int, int]]) -> list[bool]:
    return [bool(g & bitcask.SYNCED_BEFORE) for _o, g in recs]


def _in_record(offset: int) -> int:
    return offset + bitcask.REC_HEAD_SIZE + 1  # a byte of the key field


def test_s7_map_bad_record_before_unflagged_records_is_cut_with_a_warning(tmp_path, caplog):
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 6)
    assert _flagged(recs) == [True] + [False] * 5  # only the first follows a sync (creation)
    _flip(data, _in_record(recs[3][0]))
    size = data.stat().st_size
    assert any(f"unsynced tail of {size - recs[3][0]} bytes at offset {recs[3][0]}, 2 intact record" in f
               for f in armdb.check(snap).findings), armdb.check(snap)
    with caplog.at_level(logging.WARNING, logger="armdb"), Db.open(snap) as db:
        m = db.open_map("m", MAP_CFG)
        assert [m.get(i) for i in range(6)] == ["value 0", "value 1", "value 2", None, None, None]
        stats = m.stats()
        assert stats["unsynced_records_dropped"] == 2
        assert stats["torn_bytes_dropped"] == size - recs[3][0]
        m.put(9, "after")  # writable again
    assert data.stat().st_size > recs[3][0]
    assert any("unsynced tail" in r.getMessage() and "2 intact record" in r.getMessage() for r in caplog.records)
    assert armdb.check(snap).ok


def test_s7_map_bad_record_before_a_flagged_record_is_refused(tmp_path):
    snap, data, recs = _map_state(tmp_path, SYNCED_CFG, 4)
    assert _flagged(recs) == [True] * 4  # each put was synced before the next
    _syncmark.drop(str(data.parent))  # the flag alone proves it
    _flip(data, _in_record(recs[1][0]))
    assert f"{data}: corrupt record at offset {recs[1][0]}" in armdb.check(snap).findings
    with Db.open(snap) as db, pytest.raises(CorruptionError, match=rf"offset {recs[1][0]}, followed by a valid record at offset {recs[2][0]} that was appended after a sync"):
        db.open_map("m", SYNCED_CFG)


@pytest.mark.parametrize("which", [2, 5])
def test_s7_map_byte_flipped_in_a_cleanly_closed_file_is_refused(tmp_path, which):
    # Unsynced puts (enable_fsync off), then a clean close: the mark covers the whole file,
    # so even the last record (nothing valid after it) is damage, not a torn tail.
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 6, clean=True)
    mark, _gen = _syncmark.read_mark(str(data.parent), data.read_bytes()[: bitcask.FILE_HEADER_SIZE])
    assert mark == data.stat().st_size
    _flip(data, _in_record(recs[which][0]))
    with Db.open(snap) as db, pytest.raises(CorruptionError, match=rf"offset {recs[which][0]}, below offset {mark}"):
        db.open_map("m", MAP_CFG)


def test_s7_map_torn_mark_cell_is_ignored_and_the_other_cell_used(tmp_path):
    snap, data, recs = _map_state(tmp_path, SYNCED_CFG, 4)
    head = data.read_bytes()[: bitcask.FILE_HEADER_SIZE]
    mark_file = data.parent / _syncmark.MARK_NAME
    newest, gen = _syncmark.parse_cells(mark_file.read_bytes(), head)
    assert newest == data.stat().st_size
    _flip(mark_file, (gen % 2) * 16 + 9)  # tear the newest cell (its generation)
    assert _syncmark.parse_cells(mark_file.read_bytes(), head) == (recs[3][0], gen - 1)
    _flip(data, _in_record(recs[3][0]))  # at the older mark, with nothing after it: torn
    with Db.open(snap) as db:
        m = db.open_map("m", SYNCED_CFG)
        assert [m.get(i) for i in range(4)] == ["value 0", "value 1", "value 2", None]


def _as_version(data: Path, version: int) -> None:
    raw = bytearray(data.read_bytes())
    struct.pack_into("<H", raw, 8, version)
    struct.pack_into("<I", raw, 28, zlib.crc32(raw[:28]))
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("version", [1, 2])
def test_s7_map_old_format_keeps_the_old_rule(tmp_path, version):
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 5)
    _as_version(data, version)  # (a new header, so no mark names it)
    _flip(data, _in_record(recs[2][0]))
    with Db.open(snap) as db:
        if version == 1:
            with pytest.raises(CorruptionError, match=rf"offset {recs[2][0]}, followed by a valid record"):
                db.open_map("m", MAP_CFG)
        else:
            assert db.open_map("m", MAP_CFG).stats()["unsynced_records_dropped"] == 2


def test_s7_salvage_cuts_damage_below_the_mark_with_nothing_after_it(tmp_path):
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 4, clean=True)
    _flip(data, _in_record(recs[3][0]))
    (cut,) = armdb.salvage(snap).cuts
    assert (cut.offset, cut.next_valid, cut.dropped_records) == (recs[3][0], None, 0)
    with Db.open(snap) as db:
        assert [db.open_map("m", MAP_CFG).get(i) for i in range(4)] == ["value 0", "value 1", "value 2", None]


def test_s7_mark_generation_wraps_and_a_forged_generation_is_harmless(tmp_path):
    # A damaged cell can hold any generation, 2**32 - 1 included: the next cell written
    # wraps to 1 (an untyped struct error once refused the open).
    d = tmp_path / "d"
    d.mkdir()
    (d / _syncmark.MARK_NAME).write_bytes(bytes(16) + struct.pack("<QII", 5, 0xFFFFFFFF, 0))
    w = _syncmark.MarkWriter(str(d), b"h" * 32, 0)
    w.write(100)
    w.close()
    assert _syncmark.parse_cells((d / _syncmark.MARK_NAME).read_bytes(), b"h" * 32) == (100, 1)
