"""Crafted but CRC-valid queue rows in ``fixed.data`` (issue 14 item 11, queue slots).

SPEC D6 (check reports every problem), S1/S11 (a slot's CRC covers its meta and body)
and Q2 (open recovers a queue or refuses it with a typed error).  Each case rewrites
one or two slots with a row armdb never writes and re-seals its CRC, so only the row
rules can tell.  Open must either raise ``CorruptionError`` naming the file and slot,
or serve correct data; never a builtin exception.  ``armdb.check`` reports each case.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import FixedConfig, QueueConfig, State
from armdb._core import fixed as _k
from armdb.errors import CorruptionError
from armdb.fixed import HEADER_PAGE, decode_header

from .conftest import FakeClock

DEAD_BIT = 1 << 63
KEY = struct.Struct(">QQ")
HDR = struct.Struct("<BBHIqQq")  # state, flags, attempts, epoch, deadline, payload_id, pushed
PING = np.dtype([("doc", "<u8")])
FixedQ = armdb.queue("hq", payload=PING)
VarQ = armdb.queue("hq", payload=bytes, var=True)


def qcfg(shards: int = 1) -> QueueConfig:
    return (
        QueueConfig.balanced()
        .max_attempts(3)
        .header_config(FixedConfig.balanced().grow_step(64).shard_count(shards).build())
        .build()
    )


class Row:
    """One occupied slot: its index, key and header, editable."""

    def __init__(self, slot: int, due: int, seq: int, hdr: tuple[int, ...]) -> None:
        self.slot, self.due, self.seq, self.hdr = slot, due, seq, list(hdr)

    def set(self, **kw: int) -> Row:
        names = ["state", "flags", "attempts", "epoch", "deadline", "payload_id", "pushed"]
        for k, v in kw.items():
            if k in ("due", "seq"):
                setattr(self, k, v)
            else:
                self.hdr[names.index(k)] = v
        return self


def shard_file(db_path: Path, shard: int = 0) -> Path:
    return db_path / "collections" / "hq" / f"shard-{shard:03d}" / "fixed.data"


def read_rows(path: Path) -> tuple[list[Row], int]:
    raw = path.read_bytes()
    slot_size = decode_header(raw[:HEADER_PAGE], str(path))[0]
    out = []
    for i in range((len(raw) - HEADER_PAGE) // slot_size):
        o = HEADER_PAGE + i * slot_size
        if struct.unpack_from("<I", raw, o)[0] & 3 == 1:
            due, seq = KEY.unpack_from(raw, o + 8)
            out.append(Row(i, due, seq, HDR.unpack_from(raw, o + 24)))
    return out, slot_size


def write_row(path: Path, row: Row, *, payload_from: int | None = None) -> None:
    """Write ``row`` into its slot (a free slot becomes occupied) with a valid CRC."""
    raw = bytearray(path.read_bytes())
    slot_size = decode_header(bytes(raw[:HEADER_PAGE]), str(path))[0]
    o = HEADER_PAGE + row.slot * slot_size
    if payload_from is not None:  # copy the body bytes after the header (a fixed payload)
        src = HEADER_PAGE + payload_from * slot_size
        raw[o + 56 : o + slot_size] = raw[src + 56 : src + slot_size]
    meta = struct.unpack_from("<I", raw, o)[0] or (1 << 2 | 1)  # version 1, occupied
    struct.pack_into("<I", raw, o, meta)
    KEY.pack_into(raw, o + 8, row.due, row.seq)
    HDR.pack_into(raw, o + 24, *row.hdr)
    body = bytes(raw[o + 8 : o + slot_size])
    crc = zlib.crc32(body, zlib.crc32(bytes(raw[o : o + 4])))
    assert crc == _k.slot_crc(meta, np.frombuffer(body, np.uint8).copy())  # the kernel's own CRC
    struct.pack_into("<I", raw, o + 4, crc)
    path.write_bytes(bytes(raw))


def build(db_path: Path, clock: FakeClock, var: bool, shards: int = 1) -> list[int]:
    """Five rows: the first leased (attempt 1), the others ready."""
    spec = VarQ if var else FixedQ
    with armdb.Db.open(db_path, clock=clock) as db:
        q = db.open_queue(spec, qcfg(shards))
        ids = [q.push(b"body%d" % i if var else (100 + i,)) for i in range(5)]
        (lz,) = q.lease(1)
        assert lz.id == ids[0]
    return ids


def payload_of(var: bool, i: int) -> Any:
    return b"body%d" % i if var else 100 + i


def served(lz: Any, var: bool) -> Any:
    return lz.payload if var else int(lz.payload["doc"])


# Each case: rows of shard 0 (in slot order) -> rows to write; what open does; the
# finding check() must report (a substring).
Mutate = Callable[[list[Row]], list[Row]]
CASES: dict[str, tuple[Mutate, str, str]] = {
    "duplicate_id_same_key": (
        lambda r: [Row(5, r[2].due, r[2].seq, tuple(r[2].hdr))], "refuse", "stored twice"),
    "duplicate_id_other_due": (
        lambda r: [Row(5, r[2].due + 7, r[2].seq, tuple(r[2].hdr))], "refuse", "stored twice"),
    "unknown_state": (lambda r: [r[1].set(state=7)], "refuse", "unknown state"),
    "dead_key_without_dead_state": (lambda r: [r[1].set(due=r[1].due | DEAD_BIT)], "refuse",
                                    "in the dead key class but not DEAD"),
    "dead_state_with_live_key": (lambda r: [r[1].set(state=State.DEAD, attempts=1)], "refuse",
                                 "DEAD but keyed as live rows"),
    "row_id_0": (lambda r: [r[1].set(seq=0, payload_id=0)], "refuse", "row id 0"),
    "ready_with_65535_attempts": (lambda r: [r[1].set(attempts=0xFFFF)], "refuse", "65535 attempts"),
    "leased_negative_deadline": (lambda r: [r[0].set(deadline=-5)], "expired_lease", "negative lease deadline"),
    "leased_without_deadline": (lambda r: [r[0].set(deadline=0)], "expired_lease", "LEASED without a lease deadline"),
    "ready_negative_deadline": (lambda r: [r[1].set(deadline=-(1 << 63))], "serve", "negative lease deadline"),
    "leased_with_0_attempts": (lambda r: [r[0].set(attempts=0)], "expired_lease", "count 0 attempts"),
    "payload_id_mismatch": (lambda r: [r[1].set(payload_id=r[1].seq + 1000)], "serve", "payload id"),
    "unknown_flags": (lambda r: [r[1].set(flags=0x81)], "serve", "flags armdb never sets"),
    "explicit_dead_flag_on_ready_row": (lambda r: [r[1].set(flags=1)], "serve", "flags armdb never sets"),
}


@pytest.mark.parametrize("var", [False, True], ids=["fixed", "var"])
@pytest.mark.parametrize("case", list(CASES))
def test_d6_q2_crafted_crc_valid_row_is_refused_or_served(db_path: Path, clock: FakeClock, case: str,
                                                          var: bool) -> None:
    mutate, expect, finding = CASES[case]
    ids = build(db_path, clock, var)
    path = shard_file(db_path)
    rows, _ = read_rows(path)
    assert [r.seq for r in rows] == ids
    for row in mutate(rows):
        src = next((r.slot for r in rows if r.seq == row.seq), None)
        write_row(path, row, payload_from=src if row.slot >= len(rows) else None)
    report = armdb.check(db_path)
    assert any(finding in f for f in report.findings), str(report)
    spec = VarQ if var else FixedQ
    clock.advance(60)  # past the first row's lease
    db = armdb.Db.open(db_path, clock=clock)
    try:
        if expect == "refuse":
            with pytest.raises(CorruptionError, match=r"fixed\.data: .*slots \[\d+.*offsets") as e:
                db.open_queue(spec, qcfg())
            assert "shard-000" in str(e.value)
            return
        q = db.open_queue(spec, qcfg())
        got = q.lease(10)
        want = {s: payload_of(var, i) for i, s in enumerate(ids)}
        assert {lz.id: served(lz, var) for lz in got} == want  # every row, with its payload
        first = next(lz for lz in got if lz.id == ids[0])
        if expect == "expired_lease":  # served as the expired lease it claims to be
            assert first.attempt == (1 if case == "leased_with_0_attempts" else 2)
            assert q.stats().repaired_on_open == (0 if case == "leased_with_0_attempts" else 1)
        else:
            assert first.attempt == 2 and q.stats().repaired_on_open == 0
        for lz in got:
            q.ack(lz.token)
        assert q.len() == 0 and q.dead_len() == 0
    finally:
        db.shutdown()
    assert armdb.check(db_path).ok  # every crafted row was acked away


@pytest.mark.parametrize("var", [False, True], ids=["fixed", "var"])
def test_d6_q2_attempts_above_max_attempts_are_served_by_the_queue_rules(db_path: Path, clock: FakeClock,
                                                                          var: bool) -> None:
    """Not a finding: max_attempts may be lowered between opens.  The row is delivered
    once more, and a nack then dead-letters it (Q9, Q14)."""
    ids = build(db_path, clock, var)
    path = shard_file(db_path)
    rows, _ = read_rows(path)
    write_row(path, rows[1].set(attempts=10))
    assert armdb.check(db_path).ok
    with armdb.Db.open(db_path, clock=clock) as db:
        q = db.open_queue(VarQ if var else FixedQ, qcfg())
        got = {lz.id: lz for lz in q.lease(10)}
        assert got[ids[1]].attempt == 11 and served(got[ids[1]], var) == payload_of(var, 1)
        q.nack(got[ids[1]].token)
        assert q.dead_len() == 1


@pytest.mark.parametrize("var", [False, True], ids=["fixed", "var"])
def test_d6_q2_row_in_the_wrong_shard_or_twice_across_shards_is_refused(db_path: Path, clock: FakeClock,
                                                                        var: bool) -> None:
    build(db_path, clock, var, shards=2)
    rows0, _ = read_rows(shard_file(db_path, 0))
    rows1, _ = read_rows(shard_file(db_path, 1))
    assert rows0 and all(r.seq % 2 == 0 for r in rows0) and all(r.seq % 2 == 1 for r in rows1)
    twin = rows0[0]
    # The same row again in shard 1, in a free slot (a fixed payload is left zero).
    write_row(shard_file(db_path, 1), Row(len(rows1), twin.due, twin.seq, tuple(twin.hdr)))
    report = armdb.check(db_path)
    assert any("belong to another shard" in f and "shard-001" in f for f in report.findings), str(report)
    assert any(f"id {twin.seq} in shard 0 slot" in f and "stored twice" in f for f in report.findings), str(report)
    with armdb.Db.open(db_path, clock=clock) as db:
        with pytest.raises(CorruptionError, match=r"shard-001/fixed\.data: 1 row\(s\) belong to another shard"):
            db.open_queue(VarQ if var else FixedQ, qcfg(2))


def test_d6_refused_open_leaves_the_file_and_the_db_usable(db_path: Path, clock: FakeClock) -> None:
    """A refused queue changes no byte of its file, and the rest of the Db works."""
    build(db_path, clock, False)
    path = shard_file(db_path)
    rows, _ = read_rows(path)
    write_row(path, rows[1].set(state=9))
    before = path.read_bytes()
    with armdb.Db.open(db_path, clock=clock) as db:
        with pytest.raises(CorruptionError, match="unknown state"):
            db.open_queue(FixedQ, qcfg())
        m = db.open_map("other")
        m.put("k", 1)
        assert m.get("k") == 1
    assert path.read_bytes() == before
