"""Hostile Bitcask files: crafted, CRC-valid content must never crash, hang, escape or wipe data.

Every file here is built with the module's own encoders, so each case passes the
CRC checks and reaches the code that must judge its content (SPEC S7, D5, D6).
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from pathlib import Path

import pytest

from armdb import bitcask
from armdb._core.fixed import bitcask_record
from armdb.bitcask import (
    DATA_START,
    FILE_HEADER_SIZE,
    RECORD_MAGIC,
    BitcaskStore,
    _file_header,
    check_dir,
)
from armdb.config import Config
from armdb.errors import CorruptionError


class Gsn:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def open_store(path: Path, gsn: Gsn | None = None) -> BitcaskStore:
    g = gsn or Gsn()
    store = BitcaskStore.open(str(path), Config(enable_fsync=False), g)
    g.n = max(g.n, store.max_gsn)
    return store


def shard(coll: Path) -> Path:
    return coll / "shard-000"


# -- item 7: deciding torn tail versus damage is linear ----------------------------------------


def worst_case_active(size: int, nonce: int = 7) -> bytes:
    """An active data file whose every 8-aligned slot after the header looks like a record
    header running to the end of the file, and none has a matching CRC.

    Slot ``j`` is ``magic | 0 | vlen`` read as little-endian fields: it is the magic and key
    length of the candidate two slots back, the CRC and value length of the one before,
    and the gsn of its own candidate.  The old search CRC'd each candidate to the end.
    """
    assert size % 8 == 0
    out = bytearray(_file_header(1, 0, 0, nonce))
    for c in range(FILE_HEADER_SIZE, size, 8):
        prev = c - 8  # the candidate whose value length this slot holds
        vlen = max(size - prev - 24, 0)
        out += struct.pack("<HHI", RECORD_MAGIC, 0, vlen)
    return bytes(out)


def crafted_collection(tmp_path: Path, size: int) -> Path:
    coll = tmp_path / "m"
    open_store(coll).close()
    path = shard(coll) / "00000001.data"
    path.write_bytes(worst_case_active(size))
    return coll


def test_s7_torn_or_damage_search_is_linear_on_a_crafted_active_file(tmp_path: Path) -> None:
    # SPEC S7: a torn tail is cut, damage is refused; deciding which must not be quadratic.
    coll = crafted_collection(tmp_path, 1 << 20)
    t0 = time.perf_counter()
    store = open_store(coll)
    elapsed = time.perf_counter() - t0
    try:
        assert len(store) == 0
    finally:
        store.close()
    assert elapsed < 3.0, f"open of a 1 MiB crafted active file took {elapsed:.2f} s"
    # No valid record follows the first bad one: it was a torn tail, cut where records start.
    assert (shard(coll) / "00000001.data").stat().st_size == DATA_START


def test_s7_linear_search_still_finds_a_valid_record_among_crafted_candidates(tmp_path: Path) -> None:
    # The same crafted slots, with one real record placed inside them: damage, refused.
    size = 64 * 1024
    coll = crafted_collection(tmp_path, size)
    path = shard(coll) / "00000001.data"
    raw = bytearray(path.read_bytes())
    # Flagged synced-before (gsn bit 62): it proves the bad bytes before it were synced.
    rec = bitcask_record(5 | (1 << 62), b"key", b"value", RECORD_MAGIC)
    at = 40_000
    raw[at : at + len(rec)] = rec
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match=f"followed by a valid record at offset {at}"):
        open_store(coll)
    assert path.read_bytes() == bytes(raw)  # nothing was cut


@pytest.mark.parametrize("seed", range(24))
def test_s7_linear_search_agrees_with_direct_crc_on_random_files(tmp_path: Path, seed: int) -> None:
    # The first valid record after a bad one, compared with a direct CRC of every candidate.
    import random

    rng = random.Random(seed)
    size = rng.choice([200, 512, 4096, 20_000])
    buf = bytearray(rng.randbytes(size))
    # Sprinkle real records, crafted candidates and magics at random aligned offsets.
    for _ in range(rng.randint(0, 12)):
        at = rng.randrange(0, size - 24) & ~7
        kind = rng.random()
        if kind < 0.3:
            rec = bitcask_record(rng.randint(1, 1 << 40), rng.randbytes(rng.randint(0, 20)), rng.randbytes(rng.randint(0, 300)), RECORD_MAGIC)
        elif kind < 0.5:
            rec = bitcask_record(rng.randint(1, 1 << 40) | (1 << 63), rng.randbytes(rng.randint(0, 20)), b"", RECORD_MAGIC)
        else:
            vlen = rng.randint(0, max(size - at - 20, 0))
            rec = struct.pack("<QIIHH", rng.randint(1, 1 << 40), rng.getrandbits(32), vlen, RECORD_MAGIC, 0)
        raw = rec[: size - at]
        buf[at : at + len(raw)] = raw
    path = tmp_path / "f"
    path.write_bytes(bytes(buf))
    fd = os.open(path, os.O_RDONLY)
    try:
        for after in sorted({0, 1, 7, 8, rng.randrange(size), rng.randrange(size)}):
            want = _direct_next_valid(bytes(buf), after)
            assert bitcask._next_valid(fd, size, after, False) == want, (seed, after)
        every = bitcask._ValidIndex(fd, size, 0, False)  # the one-pass index check and salvage use
        pos, direct = 0, []
        while (pos := _direct_next_valid(bytes(buf), pos)) is not None:
            direct.append(pos)
        assert every.offsets.tolist() == direct, seed
    finally:
        os.close(fd)


def _direct_next_valid(data: bytes, after: int) -> int | None:
    """The definition: the first 8-aligned offset > after whose record passes every check."""
    size = len(data)
    q = after + 8 - after % 8
    for c in range(q, size - 19, 8):
        gsn_word, crc, vlen, magic, klen = struct.unpack_from("<QIIHH", data, c)
        if not bitcask._plausible(gsn_word, magic, klen, vlen, False):
            continue
        n = 20 + klen + vlen
        if c + n + (-n % 8) > size:
            continue
        if zlib.crc32(data[c + 12 : c + n], zlib.crc32(data[c : c + 8])) == crc:
            return c
    return None


# -- item 9: a forged compaction.pending deletes nothing -----------------------------------------


def two_file_collection(tmp_path: Path) -> Path:
    """A map with records in an immutable file 1 and in the active file 2."""
    coll = tmp_path / "m"
    store = BitcaskStore.open(str(coll), Config(enable_fsync=False, max_file_size=4096), Gsn())
    g = Gsn()
    store.close()
    store = BitcaskStore.open(str(coll), Config(enable_fsync=False, max_file_size=4096), g)
    for i in range(200):
        store.put(b"k%03d" % i, b"v" * 40)
    store.close()
    assert len(list(shard(coll).glob("*.data"))) >= 2
    return coll


def files_of(coll: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(shard(coll).iterdir())}


def active_fid(coll: Path) -> int:
    return max(int(p.stem) for p in shard(coll).glob("*.data"))


@pytest.mark.parametrize(
    "fids",
    [
        pytest.param("active", id="names-the-active-file"),
        pytest.param("all", id="names-every-file"),
        pytest.param([1, 1], id="duplicate-ids"),
        pytest.param([0], id="id-zero"),
        pytest.param([2, 1], id="not-increasing"),
    ],
)
def test_s8_forged_compaction_marker_is_refused_and_deletes_nothing(tmp_path: Path, fids: object) -> None:
    # SPEC S8 (compaction is atomic) and D6: a marker no compaction could write is damage.
    coll = two_file_collection(tmp_path)
    act = active_fid(coll)
    if fids == "active":
        fids = [act]
    elif fids == "all":
        fids = list(range(1, act + 1))
    raw = bitcask._encode_pending(fids)  # type: ignore[arg-type]
    if fids == [act]:
        assert len(raw) == 24
    (shard(coll) / bitcask.PENDING_NAME).write_bytes(raw)
    before = files_of(coll)
    with pytest.raises(CorruptionError, match="compaction marker"):
        open_store(coll)
    assert files_of(coll) == before
    found = check_dir(str(coll))
    assert any("compaction marker" in f for f in found), found
    assert not any("next open finishes it" in f for f in found), found


def test_s8_real_marker_naming_files_already_unlinked_still_finishes(tmp_path: Path) -> None:
    # A crash after some unlinks leaves a marker naming files that are gone: still valid.
    coll = two_file_collection(tmp_path)
    act = active_fid(coll)
    assert act >= 3
    (shard(coll) / "00000001.data").unlink()  # as if the crash came after unlinking input 1
    hint = shard(coll) / "00000001.hint"
    if hint.exists():
        hint.unlink()
    (shard(coll) / bitcask.PENDING_NAME).write_bytes(bitcask._encode_pending([1, 2]))
    assert any("next open finishes it" in f for f in check_dir(str(coll)))
    open_store(coll).close()
    names = {p.name for p in shard(coll).iterdir()}
    assert bitcask.PENDING_NAME not in names and "00000002.data" not in names
    assert f"{act:08d}.data" in names


# -- item 10: a gsn no write could produce is refused, and the rest of the database works -------


def append_record(path: Path, gsn_word: int, key: bytes, value: bytes) -> int:
    """Append a CRC-valid record to a data file; returns its offset."""
    at = path.stat().st_size
    with open(path, "ab") as f:
        f.write(bitcask_record(gsn_word, key, value, RECORD_MAGIC))
    return at


def test_t5_gsn_beyond_the_reserved_block_is_refused_and_the_database_stays_usable(tmp_path: Path) -> None:
    # SPEC T5: every gsn is reserved in seqmap before it reaches a file; one beyond is damage.
    import armdb
    from armdb import Db
    from armdb.check import check
    from armdb.maps import encode_key, encode_value

    jobs = armdb.queue("hostile_jobs", payload=dict, var=True)
    db = Db.open(tmp_path / "db")
    db.open_map("a").put("x", 1)
    db.open_map("b").put("y", 2)
    db.open_queue(jobs).push({"n": 1})
    db.close()
    active = max((tmp_path / "db" / "collections" / "a" / "shard-000").glob("*.data"))
    at = append_record(active, (1 << 60) - 1, encode_key("evil"), encode_value(3))
    for _ in range(2):  # and again after a reopen: nothing was carried over
        db = Db.open(tmp_path / "db")
        try:
            with pytest.raises(CorruptionError, match=f"{active.name}: record at offset {at} has gsn"):
                db.open_map("a")
            m = db.open_map("b")
            m.put("z", 3)
            assert m.get("z") == 3
            q = db.open_queue(jobs)
            q.push({"n": 2})
        finally:
            db.close()
    report = check(tmp_path / "db")
    assert any("gsn not below" in f and f"offset {at}" in f for f in report.findings), report.findings


def test_t5_a_header_base_gsn_beyond_the_limit_is_refused(tmp_path: Path) -> None:
    coll = tmp_path / "m"
    open_store(coll).close()
    path = shard(coll) / "00000001.data"
    path.write_bytes(_file_header(1, 0, (1 << 60) - 1, 9))
    with pytest.raises(CorruptionError, match="base gsn"):
        open_store(coll)
    assert any("base gsn" in f for f in check_dir(str(coll)))


# -- item 11: CRC-valid content that does not decode is a typed error and a check finding --------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        pytest.param(b"zkey", None, id="unknown-key-tag"),
        pytest.param(b"s\xff\xfe", None, id="str-key-not-utf8"),
        pytest.param(None, b"\xc1", id="value-never-used-byte"),
        pytest.param(None, b"\x01\x02", id="value-extra-data"),
        pytest.param(None, b"\x91" * 5000 + b"\x00", id="value-too-deep"),
        pytest.param(None, b"\xd9\x02\xff\xfe", id="value-str-not-utf8"),
        pytest.param(None, b"\x81\x91\x01\x02", id="value-unhashable-dict-key"),
    ],
)
def test_d6_map_record_that_does_not_decode_is_typed_and_found_by_check(
    tmp_path: Path, key: bytes | None, value: bytes | None
) -> None:
    from armdb import Db
    from armdb.check import check
    from armdb.errors import ArmdbError
    from armdb.maps import encode_key, encode_value

    db = Db.open(tmp_path / "db")
    db.open_map("m").put("ok", 1)
    gsn = db.gsn()
    db.close()
    active = max((tmp_path / "db" / "collections" / "m" / "shard-000").glob("*.data"))
    at = append_record(active, gsn, key or encode_key("bad"), value if value is not None else encode_value(2))
    report = check(tmp_path / "db")
    assert any("do not decode" in f and f"offset {at}" in f for f in report.findings), report.findings
    db = Db.open(tmp_path / "db")
    try:
        m = db.open_map("m")
        with pytest.raises(ArmdbError):
            dict(m.items())
        if key is None:
            with pytest.raises(ArmdbError):
                m.get("bad")
        assert m.get("ok") == 1  # the rest of the map still reads
    finally:
        db.close()


def test_d5_seqmap_entry_at_the_top_of_the_id_space_is_a_format_error(tmp_path: Path) -> None:
    from armdb import Db, seqmap
    from armdb.check import check
    from armdb.errors import FormatError

    Db.open(tmp_path / "db").close()
    (tmp_path / "db" / "seqmap").write_bytes(seqmap.encode({"gsn": (1 << 64) - 1}))
    with pytest.raises(FormatError, match="sequence map entry"):
        Db.open(tmp_path / "db")
    assert any("sequence map entry" in f for f in check(tmp_path / "db").findings)
    for bad in ({"gsn": 0}, {"gsn": "x"}, {1: 5}, {"gsn": 2.5}):
        with pytest.raises(FormatError):
            seqmap.decode(seqmap.encode(bad), "seqmap")  # type: ignore[arg-type]
    raw = seqmap.encode({"gsn": 5})
    body = b"\xc1"
    forged = seqmap._HEAD.pack(seqmap.MAGIC, seqmap.FORMAT_VERSION, len(body)) + body
    forged += struct.pack("<I", zlib.crc32(forged))
    assert raw
    with pytest.raises(FormatError, match="does not decode"):
        seqmap.decode(forged, "seqmap")


def test_d6_check_of_a_meta_naming_four_billion_shards_ends_with_one_finding(tmp_path: Path) -> None:
    coll = tmp_path / "m"
    open_store(coll).close()
    meta = bitcask._Meta((1 << 32) - 1, False, b"s" * 16, b"")
    (coll / bitcask.META_NAME).write_bytes(bitcask._encode_meta(meta))
    t0 = time.perf_counter()
    found = check_dir(str(coll))
    assert time.perf_counter() - t0 < 5
    assert any("names 4294967295 shards" in f for f in found), found
    with pytest.raises(CorruptionError):
        open_store(coll)


# -- item 12: a hint must belong to its data file, and a hint that does not is only a cache ------


def hinted_collection(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A collection whose file 1 is immutable and has a hint; returns (coll, data, hint)."""
    coll = two_file_collection(tmp_path)
    data = shard(coll) / "00000001.data"
    hint = shard(coll) / "00000001.hint"
    assert hint.exists()
    return coll, data, hint


def read_hint(raw: bytes) -> tuple[bytes, list[list[object]]]:
    body = raw[FILE_HEADER_SIZE : len(raw) - bitcask.HINT_TRAILER.size]
    entries: list[list[object]] = []
    pos = 0
    while pos < len(body):
        g, off, vlen, klen = bitcask.HINT_ENTRY.unpack_from(body, pos)
        pos += bitcask.HINT_ENTRY.size
        entries.append([g, off, vlen, klen, bytes(body[pos : pos + klen])])
        pos += klen
    return raw[:FILE_HEADER_SIZE], entries


def write_hint(path: Path, head: bytes, entries: list[list[object]], data_size: int) -> None:
    body = b"".join(bitcask.HINT_ENTRY.pack(*e[:4]) + e[4] for e in entries)  # type: ignore[misc,operator]
    count = len(entries)
    tail = bitcask.HINT_TRAILER.pack(bitcask.HINT_END_MAGIC, data_size, count, zlib.crc32(body), 0)[:-4]
    path.write_bytes(head + body + tail + struct.pack("<I", zlib.crc32(tail)))


def reheader(head: bytes, identity: int) -> bytes:
    """The hint header with its identity slot (the u64 at offset 16) set, CRC resealed."""
    magic, version, flags, fid, _slot, nonce, _crc = bitcask.FILE_HEAD.unpack(head)
    raw = bitcask.FILE_HEAD.pack(magic, version, flags, fid, identity, nonce, 0)[:-4]
    return raw + struct.pack("<I", zlib.crc32(raw))


def keys_of(coll: Path) -> set[bytes]:
    store = open_store(coll)
    try:
        return set(store.keys())
    finally:
        store.close()


def test_s6_hint_turning_a_put_into_a_tombstone_does_not_hide_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A CRC-valid hint whose entry says "tombstone" for a record that holds a value.
    coll, data, hint = hinted_collection(tmp_path)
    want = keys_of(coll)
    head, entries = read_hint(hint.read_bytes())
    victim = entries[3]
    victim[0] = int(victim[0]) | bitcask.TOMBSTONE  # type: ignore[call-overload]
    write_hint(hint, head, entries, data.stat().st_size)
    assert any("hint" in f for f in check_dir(str(coll)))
    with caplog.at_level(logging.WARNING, logger="armdb"):
        assert keys_of(coll) == want
    assert any("hint file" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert check_dir(str(coll)) == []  # open rebuilt the hint from the data file


def test_s6_hint_of_another_incarnation_of_its_data_file_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Same file id, nonce and size, but the data file's header differs (base gsn): the hint
    # belongs to another file, and its renamed key must not hide the real one.
    coll, data, hint = hinted_collection(tmp_path)
    want = keys_of(coll)
    head, entries = read_hint(hint.read_bytes())
    victim = entries[0]
    key = victim[4]
    assert isinstance(key, bytes)
    victim[4] = b"X" + key[1:]
    write_hint(hint, head, entries, data.stat().st_size)
    raw = bytearray(data.read_bytes())
    _m, _v, flags, fid, base, nonce, _c = bitcask.FILE_HEAD.unpack_from(raw)
    raw[:FILE_HEADER_SIZE] = _file_header(fid, flags, base + 1, nonce)
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="armdb"):
        assert keys_of(coll) == want
    assert any("hint file" in r.getMessage() for r in caplog.records)


def test_s6_hint_entries_that_do_not_tile_fall_back_to_a_scan(tmp_path: Path) -> None:
    # A hint is a cache: one that does not match its data file is rebuilt, not fatal.
    coll, data, hint = hinted_collection(tmp_path)
    want = keys_of(coll)
    head, entries = read_hint(hint.read_bytes())
    entries[2][1] = int(entries[2][1]) + 8  # type: ignore[call-overload]
    write_hint(hint, head, entries, data.stat().st_size)
    assert keys_of(coll) == want
    assert check_dir(str(coll)) == []  # open rewrote the hint from the data file


def test_d5_hint_without_identity_from_an_older_armdb_still_opens(tmp_path: Path) -> None:
    # D5: a hint written before hints carried their data file's identity (slot 0) is read
    # by check as before and rebuilt by open from the data file.
    coll, data, hint = hinted_collection(tmp_path)
    want = keys_of(coll)
    head, entries = read_hint(hint.read_bytes())
    write_hint(hint, reheader(head, 0), entries, data.stat().st_size)
    assert check_dir(str(coll)) == []
    assert keys_of(coll) == want
    new_head = hint.read_bytes()[:FILE_HEADER_SIZE]
    assert bitcask.FILE_HEAD.unpack(new_head)[4] != 0  # rewritten with the identity
    assert check_dir(str(coll)) == []


def test_d6_check_of_many_bad_records_each_hiding_a_long_candidate_stays_linear(tmp_path: Path) -> None:
    # Each bad record is followed by a candidate that claims to run to the end of the file
    # and then by a valid record: asking "the next valid record" once per bad record used
    # to be a pass to the end of the file each time.
    size = 256 * 1024
    coll = tmp_path / "m"
    open_store(coll).close()
    out = bytearray(_file_header(1, 0, 0, 7))
    regions = 0
    while len(out) + 64 <= size:
        out += b"\xff" * 8  # not a record: the scan stops here
        c = len(out)
        out += struct.pack("<QIIHH", 3, 0, size - c - 20, RECORD_MAGIC, 0) + b"\0" * 4
        # flagged synced-before: the bad bytes before it are damage, not an unsynced tail
        out += bitcask_record((regions + 1) | bitcask.SYNCED_BEFORE, b"k%03d" % (regions % 1000), b"v" * 8, RECORD_MAGIC)
        regions += 1
    out += b"\0" * (size - len(out))
    (shard(coll) / "00000001.data").write_bytes(bytes(out))
    t0 = time.perf_counter()
    found = check_dir(str(coll))
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"check took {elapsed:.1f} s"
    assert sum("corrupt record at offset" in f for f in found) >= regions


def test_d6_check_reports_an_active_file_flagged_as_a_compaction_output(tmp_path: Path) -> None:
    # Open refuses a shard that holds only compaction outputs; check must not say OK.
    coll = tmp_path / "m"
    store = open_store(coll)
    store.put(b"k", b"v")
    store.close()
    path = shard(coll) / "00000001.data"
    raw = bytearray(path.read_bytes())
    _m, _v, flags, fid, base, nonce, _c = bitcask.FILE_HEAD.unpack_from(raw)
    raw[:FILE_HEADER_SIZE] = _file_header(fid, flags | bitcask.FLAG_COMPACTED, base, nonce)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="only compaction outputs"):
        open_store(coll)
    assert any("only compaction outputs" in f for f in check_dir(str(coll)))
