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
from armdb import FixedConfig, QueueConfig, TxConfig, txlog
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


# -- item 7: the torn-tail search is linear -----------------------------------------------------------------------


def crafted_log(size: int, *, valid_at_end: bool = False) -> bytes:
    """A header, then a record head every 24 bytes whose length reaches the end of the
    file and whose CRC fails: the search for a valid record after the first bad one once
    CRC'd every candidate to the end (quadratic)."""
    raw = bytearray(txlog._file_header(1)) + bytearray(size - txlog.FILE_HEADER_SIZE)
    tail = txlog.encode_record(3, b"tail", 0) if valid_at_end else b""
    end = size - len(tail)
    end -= end % 8
    for p in range(txlog.FILE_HEADER_SIZE, end - txlog.REC_HEAD_SIZE, 24):
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
        if (p - txlog.FILE_HEADER_SIZE) % 8 == 0 and txlog._parse_one(raw, p) is not None:
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
        with pytest.raises(CorruptionError, match="offset 32"):
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
    assert hits > 100
