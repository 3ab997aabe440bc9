"""``armdb.check`` against crafted, CRC-valid hostile files (SPEC D6; found by the d2
structured mutation harness, tests/reliability/test_structured_mutation.py).

Each test builds a clean database, rewrites one field with a valid CRC, and asserts
that ``check`` reports a finding (never raises a builtin) wherever the open refuses.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Db, FixedConfig, QueueConfig
from armdb.check import check
from armdb.errors import ArmdbError, CorruptionError, FormatError

from . import marks
from .conftest import FakeClock

HEADER_PAGE = 4096
PAYLOAD = np.dtype([("doc", "<u8"), ("flags", "<u4")])
Pings = armdb.queue("pings", payload=PAYLOAD)
SMALL = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build()
_HDR = struct.Struct("<8sIIIII")  # fixed.data: magic, version, slot_size, key_size, value_size, shard
_REDO_HDR = struct.Struct("<8sII")  # fixed.redo: magic, version, slot_size; then crc32
REDO_OFFSET = 64  # where the redo record starts


def fixed_db(db_path: Path, n: int = 5) -> list[int]:
    """A closed database with one fixed queue; leases and nacks leave a redo record."""
    with Db.open(db_path, clock=FakeClock()) as db:
        q = db.open_queue(Pings, SMALL)
        ids = [q.push((i, i)) for i in range(n)]
        leases = q.lease(3)
        q.ack(leases[0].token)
        q.nack(leases[1].token)
    return ids


def shard_dir(db_path: Path) -> Path:
    return db_path / "collections" / "pings" / "shard-000"


def open_and_read(db_path: Path) -> None:
    with Db.open(db_path, clock=FakeClock()) as db:
        q = db.open_queue(Pings, SMALL)
        q.stats()


def assert_check_reports(db_path: Path, needle: str) -> None:
    r = check(db_path)  # must not raise
    assert not r.ok, str(r)
    assert any(needle in f for f in r.findings), str(r)


# ------------------------------------------------------------------ fixed.data header


@pytest.mark.parametrize("slot_size", [0, 1, 7, 8, 64, 4096, 0xFFFFFFFF])
def test_d6_fixed_header_slot_size_is_a_finding_not_a_crash(db_path: Path, slot_size: int) -> None:
    # SPEC D6: every header field check reads is validated first (slot size 0 raised
    # ZeroDivisionError, 1 a ValueError out of armdb.check).
    fixed_db(db_path)
    path = shard_dir(db_path) / "fixed.data"
    raw = bytearray(path.read_bytes())
    magic, version, _ss, ks, vs, shard = _HDR.unpack_from(raw)
    body = _HDR.pack(magic, version, slot_size, ks, vs, shard)
    raw[: _HDR.size + 4] = body + struct.pack("<I", zlib.crc32(body))
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError):
        open_and_read(db_path)
    assert_check_reports(db_path, "fixed.data")


def test_d6_fixed_header_geometry_of_another_payload_is_a_finding(db_path: Path) -> None:
    fixed_db(db_path)
    path = shard_dir(db_path) / "fixed.data"
    raw = bytearray(path.read_bytes())
    magic, version, ss, ks, _vs, shard = _HDR.unpack_from(raw)
    body = _HDR.pack(magic, version, ss, ks, 1, shard)  # value size 1, slot size unchanged
    raw[: _HDR.size + 4] = body + struct.pack("<I", zlib.crc32(body))
    path.write_bytes(bytes(raw))
    with pytest.raises(ArmdbError):
        open_and_read(db_path)
    assert_check_reports(db_path, "slot geometry")


# ------------------------------------------------------------------ fixed.redo header


def _redo_with_record(db_path: Path) -> tuple[Path, bytearray]:
    fixed_db(db_path)
    path = shard_dir(db_path) / "fixed.redo"
    raw = bytearray(path.read_bytes())
    assert any(raw[REDO_OFFSET:]), "the golden must hold a redo record"
    return path, raw


@pytest.mark.parametrize(
    "field,value",
    [("magic", b"ARMSEQ01"), ("magic", b"\0" * 8), ("version", 2), ("version", 0xFFFFFFFF),
     ("slot_size", 0), ("slot_size", 63), ("slot_size", 256)],
)
def test_d6_redo_header_open_refuses_is_a_finding(db_path: Path, field: str, value: object) -> None:
    # SPEC D6: open refuses a redo file whose header is not this store's (FormatError in
    # FixedShard._open_redo); check judged only the data file and said OK.
    path, raw = _redo_with_record(db_path)
    magic, version, ss = _REDO_HDR.unpack_from(raw)
    fields = {"magic": magic, "version": version, "slot_size": ss, field: value}
    head = _REDO_HDR.pack(fields["magic"], fields["version"], fields["slot_size"])
    raw[: _REDO_HDR.size + 4] = head + struct.pack("<I", zlib.crc32(head))
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError):
        open_and_read(db_path)
    assert_check_reports(db_path, "fixed.redo")


def test_d6_redo_header_failing_its_crc_over_a_record_is_a_finding(db_path: Path) -> None:
    path, raw = _redo_with_record(db_path)
    raw[_REDO_HDR.size] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError):
        open_and_read(db_path)
    assert_check_reports(db_path, "fixed.redo")


def test_d6_damaged_redo_header_without_a_record_is_recreated_and_check_agrees(db_path: Path) -> None:
    # Open recreates a redo file whose header is damaged but which holds no record (only
    # damage does that; nothing is lost), so check does not call it a refusal.
    path, raw = _redo_with_record(db_path)
    raw[REDO_OFFSET:] = bytes(len(raw) - REDO_OFFSET)
    raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))
    r = check(db_path)
    assert not any("fixed.redo" in f for f in r.findings), str(r)
    open_and_read(db_path)
    assert check(db_path).ok


# ------------------------------------------------------------------ logged slot writes (log replay)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "LOCK"}


def _slot(db_path: Path, slot: int, slot_size: int) -> bytes:
    raw = (shard_dir(db_path) / "fixed.data").read_bytes()
    return raw[HEADER_PAGE + slot * slot_size : HEADER_PAGE + (slot + 1) * slot_size]


def _log_rows(db_path: Path, rows: list[list[object]], txid: int = 1) -> int:
    import msgpack

    from armdb import txlog

    f = sorted((db_path / "txlog").glob("*.log"))[-1]
    offset = f.stat().st_size
    with open(f, "ab") as out:
        out.write(txlog.encode_record(txid, msgpack.packb(rows, use_bin_type=True), 0))
    return offset


def _queue_db(db_path: Path) -> tuple[int, bytes, int]:
    """A closed database with one fixed queue holding rows 1..3 in slots 0..2; returns
    the slot size, slot 0's body (row 1) and slot 0's version."""
    with Db.open(db_path, clock=FakeClock()) as db:
        q = db.open_queue(Pings, SMALL)
        for i in range(3):
            q.push((i, i))
    slot_size = _HDR.unpack_from((shard_dir(db_path) / "fixed.data").read_bytes())[2]
    image = _slot(db_path, 0, slot_size)
    meta = struct.unpack_from("<I", image)[0]
    assert meta & 3 == 1 and struct.unpack_from(">Q", image, 16)[0] == 1
    return slot_size, image[8:], meta >> 2


def test_t2_logged_row_whose_id_lives_in_another_slot_is_refused_and_reported(tmp_path: Path) -> None:
    # SPEC T2, D6: a CRC-valid unapplied record writes row 1 (stored in slot 0) into free
    # slot 5.  The replay wrote it and the queue's open then refused the shard (two slots
    # share a row id) while check said OK.  Now the replay refuses before writing anything.
    db = tmp_path / "db"
    slot_size, body, _ = _queue_db(db)
    offset = _log_rows(db, [["F", "pings", 0, 5, 1, 1, body]])
    r = check(db)
    assert not r.ok and any(f"offset {offset}" in f and "row id 1" in f for f in r.findings), str(r)
    before = _snapshot(tmp_path)
    with pytest.raises(CorruptionError, match=f"offset {offset}.*row id 1"):
        Db.open(db, clock=FakeClock())
    assert _snapshot(tmp_path) == before


def test_t2_two_logged_slots_with_one_new_row_id_are_refused_and_reported(tmp_path: Path) -> None:
    db = tmp_path / "db"
    _, body, _ = _queue_db(db)
    row = bytearray(body)
    row[8:16] = (9).to_bytes(8, "big")  # an id no slot holds yet, written into two free slots
    offset = _log_rows(db, [["F", "pings", 0, 5, 1, 1, bytes(row)], ["F", "pings", 0, 6, 1, 1, bytes(row)]])
    r = check(db)
    assert not r.ok and any(f"offset {offset}" in f and "row id 9" in f for f in r.findings), str(r)
    with pytest.raises(CorruptionError, match="row id 9"):
        Db.open(db, clock=FakeClock())


def test_t2_logged_rows_that_move_nothing_still_replay(tmp_path: Path) -> None:
    # What a legitimate log does: rewrite a row in place with a newer version, free a
    # slot and reuse it for a new id, and carry writes that are already applied (an
    # equal or older version, skipped).  None of it is a conflict.
    db = tmp_path / "db"
    _, body, version = _queue_db(db)
    leased = bytearray(body)
    newer = version + 1
    _log_rows(db, [["F", "pings", 0, 0, version, 1, body],  # already applied: skipped
                   ["F", "pings", 0, 0, newer, 2, b""],  # row 1 acked: slot 0 freed
                   ["F", "pings", 0, 5, 1, 1, bytes(leased)]])  # row 1 in slot 5 once slot 0 is free
    assert check(db).ok, str(check(db))
    with Db.open(db, clock=FakeClock()) as d:
        assert d.open_queue(Pings, SMALL).stats().ready == 3
    assert check(db).ok


def test_t2_an_old_logged_write_of_a_rewritten_slot_is_skipped_not_a_conflict(tmp_path: Path) -> None:
    # The slot on disk is newer than the logged write (a later commit rewrote it): the
    # replay skips the write, so the row id it names in that slot is no conflict.
    db = tmp_path / "db"
    _, body, version = _queue_db(db)
    other = bytearray(body)
    other[8:16] = (2).to_bytes(8, "big")  # row 2 lives in slot 1
    _log_rows(db, [["F", "pings", 0, 0, (version - 1) or RING_OLD, 1, bytes(other)]])
    assert check(db).ok, str(check(db))
    with Db.open(db, clock=FakeClock()) as d:
        assert d.open_queue(Pings, SMALL).stats().ready == 3


RING_OLD = (1 << 30) - 1  # one step behind version 1 on the 30-bit ring


# ------------------------------------------------------------------ the log's synced mark


@pytest.mark.parametrize("mark", [65, 4096, 2**32 + 1, 2**64 - 1])
def test_s7_d6_log_synced_mark_past_the_end_of_its_log_is_a_finding(tmp_path: Path, mark: int) -> None:
    # SPEC S7, D6: open refuses a log whose synced mark lies past the end of the file it
    # names (a completed sync covered bytes that are gone); check said OK.
    db = tmp_path / "db"
    _queue_db(db)
    log = sorted((db / "txlog").glob("*.log"))[-1]
    assert mark > log.stat().st_size
    marks.plant(log, mark)
    with pytest.raises(CorruptionError):
        Db.open(db, clock=FakeClock())
    assert_check_reports(db, "synced mark")


def test_s7_d6_log_synced_mark_within_its_log_is_no_finding(tmp_path: Path) -> None:
    db = tmp_path / "db"
    _queue_db(db)
    log = sorted((db / "txlog").glob("*.log"))[-1]
    marks.plant(log, log.stat().st_size)
    assert check(db).ok, str(check(db))
    with Db.open(db, clock=FakeClock()):
        pass


def test_s7_d6_bitcask_synced_mark_past_the_end_of_its_data_file_is_a_finding(tmp_path: Path) -> None:
    # SPEC S7, D6: a Bitcask shard whose active data file is shorter than its synced
    # mark is refused by open (synced records are missing); check said OK.
    db = tmp_path / "db"
    with Db.open(db, clock=FakeClock()) as d:
        m = d.open_map("docs")
        for i in range(5):
            m.put(f"k{i}", i)
    sdir = db / "collections" / "docs" / "shard-000"
    data = sorted(sdir.glob("*.data"))[-1]
    assert check(db).ok
    marks.plant(data, data.stat().st_size + 8)
    with pytest.raises(CorruptionError), Db.open(db, clock=FakeClock()) as d:
        dict(d.open_map("docs").items())
    assert_check_reports(db, "synced mark")
