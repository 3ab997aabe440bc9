"""Hostile transaction logs and meta files: CRC-valid content that armdb did not write
(SPEC D5, D6, S7, T2, T4; issue 14 items 5, 6, 7, 11, 13, 14).

Every record here is framed by the log's own encoder, so its magic, length and CRC are
right: what is wrong is what it says.  Open must refuse it with a typed error naming the
file and offset, create and write nothing, stay within time and memory bounds, and
``armdb.check`` must report the same file.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import armdb
from armdb import FixedConfig, QueueConfig, TxConfig
from armdb import logformat as txlog  # the log's format (and its zlib, counted below)
from armdb.errors import CorruptionError, FormatError, WrongKey

PING = np.dtype([("doc", "<u8")])
Pings = armdb.queue("jobs", payload=PING)
LOGKEY = bytes(range(32, 64))
OTHER_LOGKEY = bytes(range(64, 96))


def qcfg() -> QueueConfig:
    return QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(64).build()).build()


def make_db(path: Path, *, key: bytes | None = None) -> None:
    """A closed database with the fixed queue ``jobs`` (one row) and the map ``docs``."""
    tx = TxConfig(log_encryption_key=key) if key is not None else None
    with armdb.Db.open(path, tx_config=tx) as db:
        db.open_queue(Pings, qcfg()).push((7,))
        db.open_map("docs").put("a", 1)


def log_file(path: Path) -> Path:
    return sorted((path / "txlog").glob("*.log"))[-1]


def add_record(path: Path, body: bytes, *, txid: int = 1, flags: int = 0) -> int:
    """Append one well-framed record to the newest log file; returns its offset."""
    f = log_file(path)
    offset = f.stat().st_size
    with open(f, "ab") as out:
        out.write(txlog.encode_record(txid, body, flags))
    return offset


def add_rows(path: Path, rows: list[Any], **kw: Any) -> int:
    return add_record(path, msgpack.packb(rows, use_bin_type=True), **kw)


def snapshot(root: Path) -> dict[str, int]:
    """Every file under ``root`` (the test's tmp dir) with its size, and every directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.join(dirpath, d) + "/"] = 0
        for n in filenames:
            out[os.path.join(dirpath, n)] = os.path.getsize(os.path.join(dirpath, n))
    return out


def refuse(path: Path, root: Path, *, exc: type[Exception] = CorruptionError, tx: TxConfig | None = None,
           match: str | None = None) -> Exception:
    """Open refuses with ``exc`` and changes nothing anywhere under ``root``; check reports it."""
    before = snapshot(root)
    t0 = time.monotonic()
    with pytest.raises(exc, match=match) as info:
        armdb.Db.open(path, tx_config=tx)
    assert time.monotonic() - t0 < 10
    after = snapshot(root)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    # The refused open may only touch its own LOCK file.
    assert changed <= {str(path / "LOCK")}, sorted(changed)
    return info.value


def slot_row(*, name: str = "jobs", shard: Any = 0, slot: Any = 0, version: Any = 5, status: Any = 1,
             body: Any = b"") -> list[Any]:
    return ["F", name, shard, slot, version, status, body]


# -- item 5: names ---------------------------------------------------------------------------------------------


HOSTILE_NAMES = ["/abs/path", "../../x", "../x", "a/b", "a\0b", "x" * 300, "", ".", "..", "UPPER", 5, None, b"docs"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_d5_t2_logged_map_row_with_a_hostile_name_is_refused(tmp_path: Path, name: Any) -> None:
    db = tmp_path / "db"
    make_db(db)
    if isinstance(name, str) and name.startswith("/"):
        name = str(tmp_path / "outside")  # an absolute path inside the test's own directory
    offset = add_rows(db, [["B", name, b"\x91\x01", b"\x01", 10_000]])
    err = refuse(db, tmp_path)
    assert str(log_file(db)) in str(err) and f"offset {offset}" in str(err)
    assert not (tmp_path / "outside").exists() and not (tmp_path / "x").exists()
    assert not armdb.check(db).ok


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_d5_t2_logged_slot_row_with_a_hostile_name_is_refused(tmp_path: Path, name: Any) -> None:
    db = tmp_path / "db"
    make_db(db)
    offset = add_rows(db, [slot_row(name=name)])
    err = refuse(db, tmp_path)
    assert f"offset {offset}" in str(err)
    assert not armdb.check(db).ok


def test_d5_t2_logged_row_cannot_reach_another_database(tmp_path: Path) -> None:
    db, other = tmp_path / "db", tmp_path / "other_db"
    make_db(db)
    make_db(other)
    target = other / "collections" / "jobs" / "shard-000" / "fixed.data"
    before = target.read_bytes()
    add_rows(db, [slot_row(name="../../other_db/collections/jobs", version=99, body=b"\xff" * 8)])
    refuse(db, tmp_path)
    assert target.read_bytes() == before
    with armdb.Db.open(other) as d:
        assert [lz.payload["doc"] for lz in d.open_queue(Pings, qcfg()).lease(5)] == [7]


def test_t2_logged_map_row_for_a_queue_header_collection_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [["B", "jobs", b"\xa1k", b"\x01", 10_000]])
    refuse(db, tmp_path)


def test_t2_logged_map_row_for_a_missing_collection_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [["B", "nosuch", b"\xa1k", b"\x01", 10_000]])
    refuse(db, tmp_path)
    assert not (db / "collections" / "nosuch").exists()


# -- items 5 and 6: shard, slot, lengths -------------------------------------------------------------------------


@pytest.mark.parametrize("shard", [1, 5, -1, 2**31, 2**64 - 1, "0", True, 0.0, None], ids=repr)
def test_t2_logged_slot_row_with_a_shard_out_of_range_is_refused(tmp_path: Path, shard: Any) -> None:
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [slot_row(shard=shard)])
    refuse(db, tmp_path)
    assert not armdb.check(db).ok


@pytest.mark.parametrize("slot", [2**31, 2**32 - 1, 2**40, 10**7, -1, 2**64 - 1, "3", None, 1.5], ids=repr)
def test_t2_logged_slot_far_past_the_file_is_refused_without_growing_it(tmp_path: Path, slot: Any) -> None:
    # SPEC S2/S7: a 100-byte record once grew fixed.data to 274 GB.  The bound is what a
    # legitimate log can be ahead of the file after a power loss (docs/format.md).
    db = tmp_path / "db"
    make_db(db)
    data = db / "collections" / "jobs" / "shard-000" / "fixed.data"
    size = data.stat().st_size
    add_rows(db, [slot_row(slot=slot)])
    t0 = time.monotonic()
    refuse(db, tmp_path)
    assert time.monotonic() - t0 < 5
    assert data.stat().st_size == size
    assert not armdb.check(db).ok


def test_t2_logged_slot_within_lost_growth_is_replayed(tmp_path: Path) -> None:
    # A slot past the file's end but within the bound is what a power loss that lost the
    # file's last growth leaves: it is replayed, and the file grows to hold it.
    db = tmp_path / "db"
    make_db(db)
    row = bytes(32)  # any slot image body that fits
    add_rows(db, [slot_row(slot=1000, version=1, status=2, body=row)])
    with armdb.Db.open(db) as d:
        assert d.open_queue(Pings, qcfg()).len() == 1


@pytest.mark.parametrize(
    "field, value",
    [("body", b"\x00" * 10_000), ("body", "text"), ("body", None), ("status", 7), ("status", 0), ("status", -1),
     ("version", -1), ("version", 0), ("version", 2**30), ("version", 2**64 - 1), ("version", "1")],
)
def test_t2_logged_slot_row_with_bad_fields_is_refused(tmp_path: Path, field: str, value: Any) -> None:
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [slot_row(**{field: value})])
    refuse(db, tmp_path)
    assert not armdb.check(db).ok


@pytest.mark.parametrize(
    "row",
    [["B", "docs", b"b" * 70_000, b"\xa1v", 10_000], ["B", "docs", "k", b"\xa1v", 10_000], ["B", "docs", b"bk", 5, 10_000],
     ["B", "docs", b"bk", b"\xa1v", 0], ["B", "docs", b"bk", b"\xa1v", -1], ["B", "docs", b"bk", b"\xa1v", 2**60],
     ["B", "docs", b"bk", b"\xa1v", "9"], ["B", "docs", b"bk", b"\xa1v"], ["B", "docs", b"bk", b"\xa1v", 1, 2],
     ["B", "docs", b"bk", b"\xa1v", 2**40],  # past the gsns the seqmap reserved: would block the map's next open
     ["B", "docs", b"\xffkey", b"\x01", 500],  # a map key of no known type tag
     ["B", "docs", b"skey", b"\xc1", 500], ["B", "docs", b"skey", b"\x01\x02", 500]],  # values that do not decode
    ids=repr,
)
def test_t2_logged_map_row_with_bad_fields_is_refused(tmp_path: Path, row: list[Any]) -> None:
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [row])
    refuse(db, tmp_path)
    assert not armdb.check(db).ok


# -- item 11: undecodable bodies and malformed rows ----------------------------------------------------------------


BAD_BODIES = {
    "format_error": b"\xc1",
    "extra_data": msgpack.packb([]) + b"\x00",
    "stack_error": b"\x91" * 5000 + b"\x90",
    "unicode": b"\x91\x92\xa1F\xa1\xff",
    "int_map_key": msgpack.packb([{1: 2}]),
    "truncated": b"\x92\x91",
    "not_a_list": msgpack.packb(5),
    "row_not_a_list": msgpack.packb([5]),
    "empty_row": msgpack.packb([[]]),
    "unknown_kind": msgpack.packb([["Z", "docs"]]),
    "kind_not_str": msgpack.packb([[1, "docs"]]),
    "short_slot_row": msgpack.packb([["F", "jobs", 0]]),
    "long_slot_row": msgpack.packb([["F", "jobs", 0, 0, 5, 1, b"", 1]]),
    "ext_type": msgpack.packb([msgpack.ExtType(5, b"x")]),
}


@pytest.mark.parametrize("kind", sorted(BAD_BODIES))
def test_t2_undecodable_or_malformed_log_body_is_corruption(tmp_path: Path, kind: str) -> None:
    db = tmp_path / "db"
    make_db(db)
    offset = add_record(db, BAD_BODIES[kind])
    err = refuse(db, tmp_path)
    assert f"offset {offset}" in str(err)
    report = armdb.check(db)
    assert not report.ok and any(f"offset {offset}" in f for f in report.findings), report.findings


def test_t2_txid_that_would_overflow_the_next_commit_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [["B", "docs", b"\xa1a", b"\x02", 10_000]], txid=2**64 - 1)
    refuse(db, tmp_path)


def queue_row(seq: int = 2, state: int = 0, payload: bytes = bytes(8)) -> bytes:
    """A queue row image as a push writes it (ready, due at 1000 ms)."""
    from armdb.qrows import pack_row as _pack_row

    return _pack_row(1000, seq, state, 0, 0, 0, 0, 0, 1000, payload)


def test_t2_every_row_is_checked_before_any_is_applied(tmp_path: Path) -> None:
    # A good row before a bad one is not applied either: nothing is written.
    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [slot_row(slot=1, version=99, body=queue_row())], txid=1)
    add_rows(db, [slot_row(shard=9)], txid=2)
    refuse(db, tmp_path)
    # The good row alone replays: the queue then holds both rows.
    log = log_file(db)
    raw = log.read_bytes()
    log.write_bytes(raw[: len(raw) - len(txlog.encode_record(2, msgpack.packb([slot_row(shard=9)]), 0))])
    with armdb.Db.open(db) as d:
        assert d.open_queue(Pings, qcfg()).len() == 2


@pytest.mark.parametrize("image", ["row_id_0", "unknown_state", "short"])
def test_t2_logged_slot_image_that_is_no_queue_row_is_refused(tmp_path: Path, image: str) -> None:
    # The rules open applies to stored rows apply to a logged row before it is written.
    db = tmp_path / "db"
    make_db(db)
    body = {"row_id_0": queue_row(seq=0), "unknown_state": queue_row(state=77), "short": b"\x01" * 8}[image]
    add_rows(db, [slot_row(slot=1, version=99, body=body)])
    refuse(db, tmp_path)
    assert not armdb.check(db).ok


# -- items 6 and 11: queue.meta --------------------------------------------------------------------------------


def queue_meta(body: Any) -> bytes:
    from armdb.qrows import META_MAGIC, META_VERSION

    packed = msgpack.packb(body, use_bin_type=True) if not isinstance(body, bytes) else body
    raw = META_MAGIC + struct.pack("<II", META_VERSION, len(packed)) + packed
    return raw + struct.pack("<I", zlib.crc32(raw))


def rewrite_queue_meta(path: Path, **changes: Any) -> None:
    from armdb.qrows import decode_meta as _decode_meta

    meta_path = path / "collections" / "jobs" / "queue.meta"
    meta = _decode_meta(meta_path.read_bytes(), str(meta_path))
    meta.update(changes)
    for k, v in list(meta.items()):
        if v is KeyError:
            del meta[k]
    meta_path.write_bytes(queue_meta(meta))


@pytest.mark.parametrize(
    "changes",
    [{"shard_count": 0}, {"shard_count": 2000}, {"shard_count": -1}, {"shard_count": "1"}, {"shard_count": 2**64 - 1},
     {"shard_count": True}, {"shard_count": KeyError}, {"var": KeyError}, {"var": "yes"}, {"fingerprint": 5},
     {"key_size": 0}, {"key_size": 17}, {"value_size": 2**40}, {"value_size": -1}, {"value_size": 3}],
    ids=repr,
)
@pytest.mark.parametrize("via", ["open_queue", "replay"])
def test_d5_crafted_queue_meta_is_a_typed_error(tmp_path: Path, changes: dict[str, Any], via: str) -> None:
    db = tmp_path / "db"
    make_db(db)
    rewrite_queue_meta(db, **changes)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    if via == "replay":
        add_rows(db, [slot_row()])
        refuse(db, tmp_path, exc=(FormatError, CorruptionError))  # type: ignore[arg-type]
    else:
        with armdb.Db.open(db) as d, pytest.raises(FormatError):
            d.open_queue(Pings, qcfg())
        after = snapshot(tmp_path)
        assert not [k for k in after if k not in before and "shard-" in k]
    assert time.monotonic() - t0 < 5
    assert not armdb.check(db).ok


@pytest.mark.parametrize("body", [msgpack.packb([1, 2]), b"\xc1", msgpack.packb({1: 2}), msgpack.packb({}) + b"\x00"],
                         ids=["list", "format", "int_key", "extra"])
def test_d5_queue_meta_body_that_is_not_a_map_is_a_format_error(tmp_path: Path, body: bytes) -> None:
    db = tmp_path / "db"
    make_db(db)
    (db / "collections" / "jobs" / "queue.meta").write_bytes(queue_meta(body))
    with armdb.Db.open(db) as d, pytest.raises(FormatError):
        d.open_queue(Pings, qcfg())
    assert not armdb.check(db).ok


def test_s5_shard_count_above_the_maximum_is_a_config_error() -> None:
    from armdb.config import MAX_SHARD_COUNT

    assert FixedConfig.balanced().shard_count(MAX_SHARD_COUNT).build().shard_count == MAX_SHARD_COUNT
    with pytest.raises(armdb.ConfigError, match="at most"):
        FixedConfig.balanced().shard_count(MAX_SHARD_COUNT + 1).build()
    with pytest.raises(armdb.ConfigError, match="at most"):
        armdb.Config.balanced().shard_count(MAX_SHARD_COUNT + 1).build()


# -- item 7: the torn-tail search is linear -----------------------------------------------------------------------


def crafted_log(size: int, *, valid_at_end: bool = False) -> bytes:
    """A header, then a record head every 24 bytes whose length reaches the end of the
    file and whose CRC fails: the search for a valid record after the first bad one once
    CRC'd every candidate to the end (quadratic)."""
    raw = bytearray(txlog._file_header(1)) + bytearray(size - txlog.FILE_HEADER_SIZE)
    # flagged: appended after a sync covered the bad bytes, so they are damage (S7)
    tail = txlog.encode_record(3, b"tail", txlog.FLAG_SYNCED_BEFORE) if valid_at_end else b""
    end = size - len(tail)
    end -= end % 8
    for p in range(txlog.RECORDS_START, end - txlog.REC_HEAD_SIZE, 24):
        struct.pack_into("<IIQI", raw, p, txlog.REC_MAGIC, 0, 1, size - p - txlog.REC_HEAD_SIZE)
    raw[end : end + len(tail)] = tail
    return bytes(raw[:size])


class _CountingZlib:
    def __init__(self) -> None:
        self.bytes = 0

    def crc32(self, data: Any, value: int = 0) -> int:
        self.bytes += len(data)
        return zlib.crc32(data, value)


def _reference_valid_record_after(raw: bytes, pos: int) -> int | None:
    """The old search: every aligned candidate after ``pos``, checked on its own."""
    p = pos + 8
    magic = struct.pack("<I", txlog.REC_MAGIC)
    while True:
        p = raw.find(magic, p)
        if p < 0:
            return None
        if (p - txlog.RECORDS_START) % 8 == 0 and txlog._parse_one(raw, p) is not None:
            return p
        p += 1


@pytest.mark.parametrize("valid_at_end", [False, True])
def test_s7_torn_tail_search_on_a_crafted_1mib_log_is_linear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, valid_at_end: bool
) -> None:
    size = 1 << 20
    db = tmp_path / "db"
    make_db(db)
    log_file(db).write_bytes(crafted_log(size, valid_at_end=valid_at_end))
    counter = _CountingZlib()
    monkeypatch.setattr(txlog, "zlib", counter)
    t0 = time.monotonic()
    if valid_at_end:
        with pytest.raises(CorruptionError, match=f"offset {txlog.RECORDS_START} "):
            armdb.Db.open(db)
    else:
        armdb.Db.open(db).close()
    elapsed = time.monotonic() - t0
    # Linear: a few passes over the file, not one per candidate (that was ~20 GB of CRC).
    assert counter.bytes < 4 * size, counter.bytes
    assert elapsed < 3, elapsed


def test_s7_linear_search_gives_the_verdicts_of_the_per_candidate_search() -> None:
    rng = np.random.default_rng(14)
    hits = 0
    for _ in range(1500):
        n = int(rng.integers(32, 700))
        raw = bytearray(rng.bytes(n)) if rng.random() < 0.3 else bytearray(n)
        for _ in range(int(rng.integers(0, 6))):
            p = 32 + 8 * int(rng.integers(0, max(1, (n - 32) // 8 + 1)))
            rec = txlog.encode_record(int(rng.integers(0, 2**63)), rng.bytes(int(rng.integers(0, 60))), 0)
            if rng.random() < 0.3:
                rec = rec[:20] + b"\0\0\0\0" + rec[24:]  # CRC fails
            if rng.random() < 0.3:  # a head whose length runs anywhere
                rec = struct.pack("<IIQI", txlog.REC_MAGIC, 0, 1, int(rng.integers(0, n))) + bytes(4)
            raw[p : p + len(rec)] = rec
        data = bytes(raw)
        for pos in (24, 32, 40, 8 * int(rng.integers(3, max(4, len(data) // 8)))):
            want = _reference_valid_record_after(data, pos)
            hits += want is not None
            assert txlog._valid_record_after(data, pos) == want
            first = pos + 8 + (-(pos + 8 - txlog.RECORDS_START) % 8)
            every = [p for p in range(first, len(data), 8) if txlog._parse_one(data, p) is not None]
            assert txlog.valid_offsets_after(data, pos).tolist() == every
    assert hits > 100


# -- items 13 and 14: the log key ------------------------------------------------------------------------------


def test_t4_wrong_log_key_is_refused_at_open_with_an_empty_log(tmp_path: Path) -> None:
    db = tmp_path / "db"
    make_db(db, key=LOGKEY)
    before = snapshot(tmp_path)
    with pytest.raises(WrongKey, match="log key"):
        armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=OTHER_LOGKEY))
    assert {k for k in snapshot(tmp_path).items()} ^ {k for k in before.items()} <= {(str(db / "LOCK"), 0)}
    # Without a key (nothing sealed is owed) and with the right key it opens.
    armdb.Db.open(db).close()
    with armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=LOGKEY)) as d:
        db_ = d.open_map("docs")
        d.tx().put(db_, "b", 2).commit()
    with pytest.raises(WrongKey, match="log key"):
        armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=OTHER_LOGKEY))


def test_t4_first_log_key_given_is_remembered(tmp_path: Path) -> None:
    db = tmp_path / "db"
    make_db(db)  # no log key yet
    armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=LOGKEY)).close()
    with pytest.raises(WrongKey, match="log key"):
        armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=OTHER_LOGKEY))


def _sealed_commit_records(path: Path) -> bytes:
    """Commit one logged put in a fresh db at ``path`` (log key LOGKEY) and return the log
    bytes after the header while they are still in the log (before close trims it)."""
    tx = TxConfig(log_encryption_key=LOGKEY)
    with armdb.Db.open(path, tx_config=tx) as d:
        m = d.open_map("docs")
        d.tx().put(m, "stolen", "from A").commit()
        return log_file(path).read_bytes()[txlog.RECORDS_START :]


def test_t4_sealed_record_of_another_database_does_not_replay(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    records = _sealed_commit_records(a)
    assert records
    make_db(b, key=LOGKEY)
    with open(log_file(b), "ab") as f:
        f.write(records)
    refuse(b, tmp_path, tx=TxConfig(log_encryption_key=LOGKEY), match="another database|damaged")
    with open(log_file(b), "r+b") as f:
        f.truncate(txlog.RECORDS_START)
    with armdb.Db.open(b, tx_config=TxConfig(log_encryption_key=LOGKEY)) as d:
        assert "stolen" not in d.open_map("docs")


def test_d5_db_meta_identity_and_key_check_survive_reopen(tmp_path: Path) -> None:
    from armdb.db import META_FILE, check_meta

    db = tmp_path / "db"
    make_db(db, key=LOGKEY)
    raw = (db / META_FILE).read_bytes()
    meta = check_meta(raw, str(db / META_FILE))
    assert meta is not None and len(meta.db_id) == 16 and meta.log_key_check
    armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=LOGKEY)).close()
    assert (db / META_FILE).read_bytes() == raw


@pytest.mark.parametrize("cut", [1, 4, 20])
def test_d5_damaged_db_meta_is_a_format_error(tmp_path: Path, cut: int) -> None:
    # The identity block cut short, its CRC fixed: the length field no longer fits.
    from armdb.db import META_FILE

    db = tmp_path / "db"
    make_db(db, key=LOGKEY)
    meta = db / META_FILE
    raw = meta.read_bytes()
    body = raw[: len(raw) - 4 - cut]  # a shorter body, re-sealed with a valid CRC
    meta.write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    with pytest.raises(FormatError):
        armdb.Db.open(db)
    assert not armdb.check(db).ok


def test_d5_version_1_database_and_sealed_log_still_open_and_are_upgraded(tmp_path: Path) -> None:
    # A database written before database ids: a 16-byte db.meta and a version-1 log file
    # whose sealed record is bound to its txid alone.  It replays, then db.meta gains its
    # identity block and the log key's check value, and new log files are version 2.
    from armdb._crypto import Sealer
    from armdb.db import META_FILE, DbMeta, check_meta, encode_meta

    db = tmp_path / "db"
    make_db(db)
    v1 = encode_meta(DbMeta())  # what armdb wrote before database ids: 16 bytes, version 1
    assert len(v1) == 16 and struct.unpack_from("<I", v1, 8)[0] == 1
    (db / META_FILE).write_bytes(v1)
    head = bytearray(txlog._file_header(7))
    struct.pack_into("<I", head, 8, 1)
    struct.pack_into("<I", head, txlog._FILE_HEAD.size, zlib.crc32(bytes(head[: txlog._FILE_HEAD.size])))
    from armdb.maps import encode_key, encode_value

    rows = [["B", "docs", encode_key("old"), encode_value("sealed v1"), 500]]
    body = Sealer(LOGKEY).seal(msgpack.packb(rows, use_bin_type=True), (5).to_bytes(8, "little"))
    for f in (db / "txlog").glob("*.log"):
        f.unlink()
    (db / "txlog" / "00000007.log").write_bytes(bytes(head) + txlog.encode_record(5, body, txlog.FLAG_SEALED))
    with armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=LOGKEY)) as d:
        assert d.open_map("docs").get("old") == "sealed v1"
    meta = check_meta((db / META_FILE).read_bytes(), "db.meta")
    assert len(meta.db_id) == 16 and meta.log_key_check
    assert struct.unpack_from("<I", log_file(db).read_bytes(), 8)[0] == txlog.FORMAT_VERSION == 4
    with pytest.raises(WrongKey, match="log key"):
        armdb.Db.open(db, tx_config=TxConfig(log_encryption_key=OTHER_LOGKEY))
    assert armdb.check(db).ok


@pytest.mark.parametrize("version", [0, 5, 99])
def test_d5_log_file_of_an_unknown_version_is_a_format_error(tmp_path: Path, version: int) -> None:
    db = tmp_path / "db"
    make_db(db)
    head = bytearray(txlog._file_header(9))
    struct.pack_into("<I", head, 8, version)
    struct.pack_into("<I", head, txlog._FILE_HEAD.size, zlib.crc32(bytes(head[: txlog._FILE_HEAD.size])))
    (db / "txlog" / "00000009.log").write_bytes(bytes(head))
    refuse(db, tmp_path, exc=FormatError, match=f"format {version} is not supported")


def test_d5_db_meta_cut_back_to_its_first_16_bytes_is_not_read_as_version_1(tmp_path: Path) -> None:
    from armdb.db import META_FILE

    db = tmp_path / "db"
    make_db(db, key=LOGKEY)
    meta = db / META_FILE
    meta.write_bytes(meta.read_bytes()[:16])  # version 2 without its identity block
    refuse(db, tmp_path, exc=FormatError, match="identity block")
    assert not armdb.check(db).ok


def test_t2_well_formed_logged_rows_still_replay(tmp_path: Path) -> None:
    # The control for the refusals above: rows as a commit writes them are applied.
    from armdb.maps import encode_key, encode_value

    db = tmp_path / "db"
    make_db(db)
    add_rows(db, [["B", "docs", encode_key("b"), encode_value({"x": [1, 2]}), 500],
                  ["B", "docs", encode_key(7), None, 501]])
    with armdb.Db.open(db) as d:
        assert d.open_map("docs").get("b") == {"x": [1, 2]}
    assert armdb.check(db).ok
