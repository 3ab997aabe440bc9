"""SPEC S7 (since turn 2): the synced mark and the synced-before flag tell a tail that a
power cut wrote out of order from damage.

A crash state is taken by copying the database folder while it is open (what a process
kill leaves); the files are then damaged as a power cut (or a bad disk) would.  The mark
lives in each log file's and data file's own mark area (bytes 32-63), written after each
completed sync and carried to the disk by the file's next sync (tests/marks.py).
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
from armdb import Config, Db, _fs, _syncmark, bitcask, txlog
from armdb.errors import CorruptionError

from . import marks

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
    recs, _end, bad = txlog._records_at(raw, txlog.RECORDS_START)
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
    marks.clear(log)  # the flag alone proves it
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
    newest, gen = marks.read(log)
    assert newest == marks.log_records_end(log.read_bytes()) and gen >= 2
    cells = log.read_bytes()[marks.AREA]
    older = struct.unpack_from("<Q", cells, ((gen - 1) % 2) * 16)[0]
    assert older == recs[2][0]  # the mark after the second commit's sync
    _flip(log, marks.AREA.start + (gen % 2) * 16 + 3)  # tear the newest cell
    assert marks.read(log) == (older, gen - 1)
    _flip(log, _body(recs[2][0]))  # at the older mark, not below it: a torn tail
    size = log.stat().st_size
    with Db.open(snap) as db:
        assert db.txlog.stats()["torn_bytes_dropped"] == size - recs[2][0]
        assert db.open_map("m", MAP_CFG).get(1) == "v1"


def _old_log(raw: bytes, version: int) -> bytes:
    """The file as an older armdb wrote it: a header of ``version``, records right after it."""
    head = txlog._FILE_HEAD.pack(txlog.FILE_MAGIC, version, 0, 1)
    head += struct.pack("<I", zlib.crc32(head))
    return head + bytes(txlog.FILE_HEADER_SIZE - len(head)) + raw[txlog.RECORDS_START :]


@pytest.mark.parametrize("version", [2, 3])
def test_s7_log_old_format_keeps_the_old_rule(tmp_path, version):
    snap, log, recs = _log_state(tmp_path, [False, False, False])
    log.write_bytes(_old_log(log.read_bytes(), version))
    shift = txlog.RECORDS_START - txlog.FILE_HEADER_SIZE  # records sit 32 bytes lower
    _flip(log, _body(recs[1][0]) - shift)
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
    assert marks.read(log)[0] == len(raw)


def test_s7_log_format_3_mark_in_its_side_file_is_still_read(tmp_path):
    # A log written by an older armdb kept its mark beside it (txlog/synced.mark): a bad
    # last record below that mark is damage, as it was then.
    snap, log, recs = _log_state(tmp_path, [True, True, True])
    log.write_bytes(_old_log(log.read_bytes(), 3))
    shift = txlog.RECORDS_START - txlog.FILE_HEADER_SIZE
    head = log.read_bytes()[: txlog.FILE_HEADER_SIZE]
    cell = _syncmark.cell(head, log.stat().st_size, 3)
    (snap / "txlog" / _syncmark.MARK_NAME).write_bytes(cell + cell)
    _flip(log, _body(recs[2][0]) - shift)
    assert any("damaged below offset" in f for f in armdb.check(snap).findings)
    with pytest.raises(CorruptionError, match=rf"offset {recs[2][0] - shift} is damaged below offset"):
        Db.open(snap)
    # Once the older file is replayed and gone, so is its side file.
    (snap / "txlog" / _syncmark.MARK_NAME).unlink()
    _flip(log, _body(recs[2][0]) - shift)
    Db.open(snap).close()
    assert not (snap / "txlog" / _syncmark.MARK_NAME).exists()


class _Recorder(_fs.RealFS):
    """Records each ``pwrite`` into a mark area and each ``fdatasync``, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []  # ("cell", fd, mark) or ("sync", fd, 0)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        if marks.AREA.start <= offset < marks.AREA.stop and len(data) == _syncmark.CELL_SIZE:
            self.events.append(("cell", fd, struct.unpack_from("<Q", bytes(data))[0]))
        super().pwrite(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        self.events.append(("sync", fd, 0))


@pytest.mark.parametrize("store", ["log", "map"])
def test_s7_each_sync_carries_the_mark_of_the_one_before(tmp_path, store):
    # The mark is durable with the next sync of its file, at no extra sync: after every
    # completed sync a cell naming what it covered is written into the file itself, and
    # the next sync of that file (or the close) follows it.
    rec = _Recorder()
    with _fs.use(rec):
        db = Db.open(tmp_path / "db")
        m = db.open_map("m", MAP_CFG if store == "log" else SYNCED_CFG)
        rec.events.clear()
        for i in range(5):
            if store == "log":
                db.tx().put(m, i, "v%d" % i).durable().commit()
            else:
                m.put(i, "v%d" % i)
        events = list(rec.events)
        db.close()
    fds = {fd for kind, fd, _ in events if kind == "cell"}
    assert len(fds) == 1, events  # every cell went into the one appendable file
    (fd,) = fds
    mine = [(kind, mark) for kind, f, mark in events if f == fd]
    syncs = [i for i, (kind, _) in enumerate(mine) if kind == "sync"]
    cells = [i for i, (kind, _) in enumerate(mine) if kind == "cell"]
    assert len(syncs) == 5 and len(cells) == 5, mine
    for s_i, c_i in zip(syncs, cells, strict=True):
        assert s_i < c_i  # a cell only after the sync it names completed
    for c_i, nxt in zip(cells[:-1], syncs[1:], strict=True):
        assert c_i < nxt  # ... and the next sync of the file carries it
    marks_written = [mine[i][1] for i in cells]
    assert marks_written == sorted(marks_written) and len(set(marks_written)) == 5


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
        recs = [(r[0], r[1]) for r in bitcask._Scan(fd, os.fstat(fd).st_size, False, bitcask.DATA_START)]
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
    marks.clear(data)  # the flag alone proves it
    _flip(data, _in_record(recs[1][0]))
    assert f"{data}: corrupt record at offset {recs[1][0]}" in armdb.check(snap).findings
    with Db.open(snap) as db, pytest.raises(CorruptionError, match=rf"offset {recs[1][0]}, followed by a valid record at offset {recs[2][0]} that was appended after a sync"):
        db.open_map("m", SYNCED_CFG)


@pytest.mark.parametrize("which", [2, 5])
def test_s7_map_byte_flipped_in_a_cleanly_closed_file_is_refused(tmp_path, which):
    # Unsynced puts (enable_fsync off), then a clean close: the mark covers the whole file,
    # so even the last record (nothing valid after it) is damage, not a torn tail.
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 6, clean=True)
    mark, _gen = marks.read(data)
    assert mark == data.stat().st_size
    _flip(data, _in_record(recs[which][0]))
    with Db.open(snap) as db, pytest.raises(CorruptionError, match=rf"offset {recs[which][0]}, below offset {mark}"):
        db.open_map("m", MAP_CFG)


def test_s7_map_torn_mark_cell_is_ignored_and_the_other_cell_used(tmp_path):
    snap, data, recs = _map_state(tmp_path, SYNCED_CFG, 4)
    newest, gen = marks.read(data)
    assert newest == data.stat().st_size
    _flip(data, marks.AREA.start + (gen % 2) * 16 + 9)  # tear the newest cell (its generation)
    assert marks.read(data) == (recs[3][0], gen - 1)
    _flip(data, _in_record(recs[3][0]))  # at the older mark, with nothing after it: torn
    with Db.open(snap) as db:
        m = db.open_map("m", SYNCED_CFG)
        assert [m.get(i) for i in range(4)] == ["value 0", "value 1", "value 2", None]


_DATA_SHIFT = bitcask.DATA_START - bitcask.FILE_HEADER_SIZE  # older data files have no mark area


def _as_version(data: Path, version: int) -> None:
    """Rewrite a data file as an older armdb wrote it: a header of ``version``, records
    right after it (the hint, which names offsets, is dropped)."""
    raw = bytearray(data.read_bytes())
    struct.pack_into("<H", raw, 8, version)
    struct.pack_into("<I", raw, 28, zlib.crc32(raw[:28]))
    data.write_bytes(bytes(raw[: bitcask.FILE_HEADER_SIZE] + raw[bitcask.DATA_START :]))
    data.with_suffix(".hint").unlink(missing_ok=True)


@pytest.mark.parametrize("version", [1, 2])
def test_s7_map_old_format_keeps_the_old_rule(tmp_path, version):
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 5)
    _as_version(data, version)  # (a new header, so no mark names it)
    bad = recs[2][0] - _DATA_SHIFT
    _flip(data, _in_record(bad))
    with Db.open(snap) as db:
        if version == 1:
            with pytest.raises(CorruptionError, match=rf"offset {bad}, followed by a valid record"):
                db.open_map("m", MAP_CFG)
        else:
            assert db.open_map("m", MAP_CFG).stats()["unsynced_records_dropped"] == 2


@pytest.mark.parametrize("version", [1, 2])
def test_s7_map_active_file_of_an_older_format_is_sealed_and_a_new_one_started(tmp_path, version):
    # Appends never go to a file without a mark area: open syncs the older active file,
    # leaves it as it is, and appends go to a new file of the current format.
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 5, clean=True)
    _as_version(data, version)
    before = data.read_bytes()
    side = data.parent / _syncmark.MARK_NAME  # what an older armdb kept beside it
    cell = _syncmark.cell(before[: bitcask.FILE_HEADER_SIZE], len(before), 3)
    side.write_bytes(cell + cell)
    with Db.open(snap) as db:
        m = db.open_map("m", MAP_CFG)
        assert [m.get(i) for i in range(5)] == ["value %d" % i for i in range(5)]
        m.put(7, "new")
    assert data.read_bytes() == before
    newer = sorted(data.parent.glob("*.data"))
    assert len(newer) == 2 and struct.unpack_from("<H", newer[1].read_bytes(), 8)[0] == bitcask.DATA_VERSION
    assert marks.read(newer[1])[0] == newer[1].stat().st_size  # sealed at close
    with Db.open(snap) as db:
        assert db.open_map("m", MAP_CFG).get(7) == "new"
    assert armdb.check(snap).ok
    assert not side.exists()  # an older format's side file goes with its file's last appends


def test_s7_map_format_2_mark_in_its_side_file_is_still_read(tmp_path):
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 4, clean=True)
    _as_version(data, 2)
    head = data.read_bytes()[: bitcask.FILE_HEADER_SIZE]
    cell = _syncmark.cell(head, data.stat().st_size, 3)
    (data.parent / _syncmark.MARK_NAME).write_bytes(cell + cell)
    bad = recs[3][0] - _DATA_SHIFT  # the last record: below the side file's mark
    _flip(data, _in_record(bad))
    assert f"{data}: corrupt record at offset {bad}" in armdb.check(snap).findings
    with Db.open(snap) as db, pytest.raises(CorruptionError, match=rf"offset {bad}, below offset"):
        db.open_map("m", MAP_CFG)


def test_s7_salvage_cuts_damage_below_the_mark_with_nothing_after_it(tmp_path):
    snap, data, recs = _map_state(tmp_path, MAP_CFG, 4, clean=True)
    _flip(data, _in_record(recs[3][0]))
    (cut,) = armdb.salvage(snap).cuts
    assert (cut.offset, cut.next_valid, cut.dropped_records) == (recs[3][0], None, 0)
    with Db.open(snap) as db:
        assert [db.open_map("m", MAP_CFG).get(i) for i in range(4)] == ["value 0", "value 1", "value 2", None]


def test_s7_mark_generation_wraps_and_a_forged_generation_is_harmless(tmp_path):
    # A cell can hold any generation, 2**32 - 1 included: the next cell written wraps
    # to 1 (an untyped struct error once refused the open).
    f = tmp_path / "f"
    head = b"h" * 32
    f.write_bytes(head + _syncmark.cell(head, 5, 0xFFFFFFFE) + _syncmark.cell(head, 9, 0xFFFFFFFF))
    fd = os.open(f, os.O_RDWR)
    try:
        w = _syncmark.MarkWriter(fd, head, *_syncmark.read_area(f.read_bytes()))
        assert w.generation == 0xFFFFFFFF
        w.write(100)
        # The write after the wrap (generation 1) took the newest cell's slot: the older
        # cell wins, whose mark is smaller, which only makes open less sure.
        assert w.generation == 1 and _syncmark.read_area(f.read_bytes()) == (5, 0xFFFFFFFE)
        w.write(200)
    finally:
        os.close(fd)
    assert _syncmark.read_area(f.read_bytes()) == (200, 2)
