"""``armdb.check``: the read-only consistency check of a closed database (SPEC D6, RELIABILITY I9).

Each damage test builds a clean database, breaks one thing on disk with plain file
writes, and asserts that ``check`` names it, and that ``check`` itself wrote nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Db, DbLocked, FixedConfig, QueueConfig
from armdb.check import CheckReport, check

from .conftest import FakeClock

HEADER_PAGE = 4096
PAYLOAD = np.dtype([("doc", "<u8"), ("flags", "<u4")])
SLOT = 128  # 8 + 16 + 32 + 12 = 68, rounded up to a power of two
Pings = armdb.queue("pings", payload=PAYLOAD)
SMALL = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build()


@dataclass
class Job:
    doc_id: int
    reason: str


Jobs = armdb.queue("jobs", payload=Job, var=True)


def tree(path: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mode of every file and directory under ``path``."""
    out: dict[str, tuple[str, int]] = {}
    for p in sorted(path.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        out[str(p.relative_to(path))] = (digest, st.st_mode)
    return out


def fixed_db(db_path: Path, n: int = 5) -> list[int]:
    """A closed database with one fixed queue in every state: ready, leased, nacked, dead, acked."""
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, SMALL)
        ids = [q.push((i, i)) for i in range(n)]
        leases = q.lease(4)
        q.ack(leases[0].token)
        q.nack(leases[1].token)
        q.nack(leases[2].token, dead=True)
    return ids


def slot_offset(db_path: Path, row_id: int, name: str = "pings", slot_size: int = SLOT) -> int:
    path = db_path / "collections" / name / "shard-000" / "fixed.data"
    raw = path.read_bytes()
    for i in range((len(raw) - HEADER_PAGE) // slot_size):
        off = HEADER_PAGE + i * slot_size
        if (
            struct.unpack_from("<I", raw, off)[0] & 3 == 1
            and struct.unpack_from(">Q", raw, off + 16)[0] == row_id
        ):
            return off
    raise AssertionError(f"row {row_id} not found")


def rewrite_slot(path: Path, off: int, slot_size: int, edit) -> None:
    """Apply ``edit(bytearray_of_body)`` to a slot and re-seal its CRC (valid but inconsistent)."""
    raw = bytearray(path.read_bytes())
    body = bytearray(raw[off + 8 : off + slot_size])
    edit(body)
    raw[off + 8 : off + slot_size] = body
    struct.pack_into("<I", raw, off + 4, zlib.crc32(bytes(raw[off : off + 4]) + bytes(body)))
    path.write_bytes(bytes(raw))


def fixed_path(db_path: Path, name: str = "pings") -> Path:
    return db_path / "collections" / name / "shard-000" / "fixed.data"


# ---------------------------------------------------------------------- clean databases


def test_d6_check_report_shape() -> None:
    r = CheckReport(True, [])
    assert dataclasses.is_dataclass(r)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.ok = False  # type: ignore[misc]
    assert "OK" in str(r)
    bad = CheckReport(False, ["a: broken", "b: also broken"])
    assert str(bad).splitlines() == ["armdb.check: 2 finding(s)", "  - a: broken", "  - b: also broken"]


def test_d6_check_clean_db_with_fixed_queue_is_ok(db_path: Path) -> None:
    fixed_db(db_path)
    r = check(db_path)
    assert r.ok, str(r)
    assert r.findings == []
    assert check(str(db_path)).ok  # str or PathLike


def test_d6_check_fresh_and_empty_databases_are_ok(db_path: Path) -> None:
    Db.open(db_path).shutdown()
    assert check(db_path).ok
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL)
    assert check(db_path).ok


def test_d6_check_clean_db_with_fixed_queue_var_queue_and_map_is_ok(db_path: Path) -> None:
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        f = db.open_queue(Pings, SMALL)
        v = db.open_queue(Jobs, SMALL)
        m = db.open_map("settings")
        for i in range(6):
            f.push((i, 0))
            v.push(Job(i, "edited"))
            m.put(f"k{i}", {"i": i})
        m.delete("k0")
        for q in (f, v):
            ls = q.lease(3)
            q.ack(ls[0].token)
            q.nack(ls[1].token, dead=True)
    r = check(db_path)
    assert r.ok, str(r)


# ---------------------------------------------------------------------- damage is found


def test_d6_flipped_byte_in_fixed_slot_is_a_finding(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)
    off = slot_offset(db_path, ids[3])
    raw = bytearray(path.read_bytes())
    raw[off + 40] ^= 0x01
    path.write_bytes(bytes(raw))
    r = check(db_path)
    assert not r.ok
    assert len(r.findings) == 1, str(r)
    assert "fixed.data" in r.findings[0] and "1 slot(s) fail their CRC" in r.findings[0]
    assert str(r).startswith("armdb.check: 1 finding(s)")


def test_d6_duplicate_row_id_is_a_finding(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)
    off = slot_offset(db_path, ids[4])
    raw = bytearray(path.read_bytes())
    free = HEADER_PAGE + 7 * SLOT
    assert raw[free : free + SLOT] == bytes(SLOT)
    raw[free : free + SLOT] = raw[off : off + SLOT]  # the CRC does not cover the position
    path.write_bytes(bytes(raw))
    r = check(db_path)
    assert any(f"id {ids[4]} in shard 0 slot" in f and "stored twice" in f for f in r.findings), str(r)


def test_d6_dead_key_class_must_match_dead_state(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)

    def set_dead_bit(body: bytearray) -> None:
        body[0] |= 0x80  # bit 63 of the big-endian due word

    rewrite_slot(path, slot_offset(db_path, ids[4]), SLOT, set_dead_bit)  # a READY row
    r = check(db_path)
    assert any("in the dead key class but not DEAD" in f for f in r.findings), str(r)


def test_d6_dead_state_with_live_key_is_a_finding(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)

    def make_dead(body: bytearray) -> None:
        body[16] = 2  # header.state = DEAD, key left in the live class

    rewrite_slot(path, slot_offset(db_path, ids[4]), SLOT, make_dead)
    r = check(db_path)
    assert any("are DEAD but keyed as live rows" in f for f in r.findings), str(r)


def test_d6_unknown_state_and_leased_without_deadline_are_findings(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)

    def bad_state(body: bytearray) -> None:
        body[16] = 9

    def leased_no_deadline(body: bytearray) -> None:
        body[16] = 1
        body[24:32] = bytes(8)

    rewrite_slot(path, slot_offset(db_path, ids[4]), SLOT, bad_state)
    rewrite_slot(path, slot_offset(db_path, ids[1]), SLOT, leased_no_deadline)
    r = check(db_path)
    assert any("unknown state" in f for f in r.findings), str(r)
    assert any("LEASED without a lease deadline" in f for f in r.findings), str(r)


def test_d6_row_id_beyond_the_seqmap_reservation_is_a_finding(db_path: Path) -> None:
    ids = fixed_db(db_path)
    from armdb.seqmap import encode

    (db_path / "seqmap").write_bytes(encode({"q:pings": ids[-1]}))  # ids must stay below the end
    r = check(db_path)
    assert any(f"row id {ids[-1]} is not below the ids reserved in seqmap" in f for f in r.findings), str(r)


def test_d6_leftover_tmp_files_are_findings(db_path: Path) -> None:
    fixed_db(db_path)
    (db_path / "db.meta.tmp").write_bytes(b"partial")
    (db_path / "collections" / "pings" / "queue.meta.tmp").write_bytes(b"")
    r = check(db_path)
    assert sorted(r.findings) == sorted(
        [
            "db.meta.tmp: leftover temporary file (an interrupted atomic write)",
            os.path.join("collections", "pings", "queue.meta.tmp")
            + ": leftover temporary file (an interrupted atomic write)",
        ]
    )


@pytest.mark.parametrize("damage", ["db.meta", "seqmap", "queue.meta", "fixed_header"])
def test_d6_damaged_meta_files_are_findings(db_path: Path, damage: str) -> None:
    fixed_db(db_path)
    path = {
        "db.meta": db_path / "db.meta",
        "seqmap": db_path / "seqmap",
        "queue.meta": db_path / "collections" / "pings" / "queue.meta",
        "fixed_header": fixed_path(db_path),
    }[damage]
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF  # inside each file's version or CRC-covered fields
    path.write_bytes(bytes(raw))
    r = check(db_path)
    assert not r.ok
    assert any(str(path) in f or path.name in f for f in r.findings), str(r)


def test_d6_missing_shard_file_is_a_finding(db_path: Path) -> None:
    fixed_db(db_path)
    fixed_path(db_path).unlink()
    r = check(db_path)
    assert any("fixed.data: missing" in f for f in r.findings), str(r)


def test_d6_not_a_database(tmp_path: Path) -> None:
    r = check(tmp_path / "nope")
    assert not r.ok and "no such database directory" in r.findings[0]
    (tmp_path / "empty").mkdir()
    r = check(tmp_path / "empty")
    assert not r.ok and "db.meta is missing" in r.findings[0]
    assert list((tmp_path / "empty").iterdir()) == []  # not even a LOCK file


# ---------------------------------------------------------------------- locking and read-only


def test_d6_check_on_an_open_db_raises_db_locked(db_path: Path) -> None:
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL).push((1, 1))
        with pytest.raises(DbLocked, match=f"process {os.getpid()}"):
            check(db_path)
    assert check(db_path).ok  # check released the lock it took...
    with Db.open(db_path):  # ...so the database opens again
        pass


def test_d6_check_writes_nothing_on_a_clean_db(db_path: Path) -> None:
    fixed_db(db_path)
    before = tree(db_path)
    assert check(db_path).ok
    assert check(db_path).ok
    assert tree(db_path) == before


def test_d6_check_writes_nothing_on_a_damaged_db(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)
    raw = bytearray(path.read_bytes())
    raw[slot_offset(db_path, ids[3]) + 30] ^= 0x10
    path.write_bytes(bytes(raw))
    (db_path / "seqmap.tmp").write_bytes(b"x")
    before = tree(db_path)
    r = check(db_path)
    assert len(r.findings) == 2, str(r)
    assert tree(db_path) == before  # never repairs: recovery is the next open's job
    assert check(db_path).findings == r.findings


def test_d6_check_writes_nothing_with_var_queue_and_map(db_path: Path) -> None:
    with Db.open(db_path, clock=FakeClock()) as db:
        v = db.open_queue(Jobs, SMALL)
        m = db.open_map("settings")
        for i in range(3):
            v.push(Job(i, "x"))
            m.put(i, b"v")
    before = tree(db_path)
    r = check(db_path)
    assert r.ok, str(r)
    assert tree(db_path) == before


def test_d6_check_after_reopen_repairs_is_clean(db_path: Path) -> None:
    ids = fixed_db(db_path)
    path = fixed_path(db_path)
    raw = bytearray(path.read_bytes())
    raw[slot_offset(db_path, ids[4]) + 20] ^= 0x01
    path.write_bytes(bytes(raw))
    assert not check(db_path).ok
    with Db.open(db_path, clock=FakeClock()) as db:
        assert db.open_queue(Pings, SMALL).stats().repaired_on_open == 1
    r = check(db_path)
    assert r.ok, str(r)


def test_d6_multi_shard_queues_are_checked_shard_by_shard(db_path: Path) -> None:
    cfg = (
        QueueConfig.balanced()
        .header_config(FixedConfig.balanced().grow_step(8).shard_count(3).build())
        .payload_config(armdb.Config.balanced().shard_count(2).build())
        .build()
    )
    with Db.open(db_path, clock=FakeClock()) as db:
        f = db.open_queue(Pings, cfg)
        v = db.open_queue(Jobs, cfg)
        for i in range(12):
            f.push((i, 0))
            v.push(Job(i, "r"))
        v.ack(v.lease(1)[0].token)
    assert check(db_path).ok
    (db_path / "collections" / "pings" / "shard-003").mkdir()
    path = db_path / "collections" / "jobs" / "shard-002" / "fixed.data"
    raw = bytearray(path.read_bytes())
    raw[HEADER_PAGE + 8 + 3] ^= 0x04  # the first slot of the third shard
    path.write_bytes(bytes(raw))
    r = check(db_path)
    assert len(r.findings) == 2, str(r)
    assert any("shard-003: shard folder beyond the stored count 3" in f for f in r.findings)
    assert any("jobs/shard-002/fixed.data" in f and "fail their CRC" in f for f in r.findings)


def test_d6_interrupted_queue_creation_is_a_finding(db_path: Path) -> None:
    with Db.open(db_path) as db:
        db.open_queue(Pings, SMALL)
    qdir = db_path / "collections" / "half"
    qdir.mkdir()
    (qdir / "queue.meta.tmp").write_bytes(b"partial")
    r = check(db_path)
    assert r.findings == [
        "collections/half: creation of queue 'half' was interrupted (queue.meta.tmp without queue.meta)"
    ]
