"""FixedStore: slot layout, version vector, version ring, torn slots, zero pages, sync failures
(SPEC S1-S5, S11, S12).

Layout tests read ``fixed.data`` byte by byte and rebuild every field with ``struct``
and ``zlib``, so the format in docs/format.md is pinned independently of the code
that writes it.  Corruption tests close the database, change bytes on disk, reopen,
and call :func:`armdb.check.check` afterwards (D6).
"""

from __future__ import annotations

import errno
import os
import struct
import time
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import armdb
from armdb import ConfigError, Db, FixedConfig, FormatError, QueueConfig, StorageError, _fs
from armdb._core import fixed as K
from armdb.check import check
from armdb.fixed import FixedShard

from .conftest import FakeClock

HEADER_PAGE = 4096
RING = 1 << 30
HALF = 1 << 29

PAYLOAD = np.dtype([("doc", "<u8"), ("flags", "<u4")])  # 12 bytes -> 8+16+32+12 = 68 -> 72-byte slots
SLOT = 128  # 8 + 16 + 32 + 12 = 68, rounded up to a power of two (no slot straddles a sector)
Pings = armdb.queue("pings", payload=PAYLOAD)


def qconfig(
    *,
    grow_step: int = 8,
    shard_count: int | None = None,
    sync_interval: float = 0.05,
    enable_fsync: bool = True,
) -> QueueConfig:
    h = FixedConfig.balanced().grow_step(grow_step).sync_interval(sync_interval).enable_fsync(enable_fsync)
    if shard_count is not None:
        h = h.shard_count(shard_count)
    return QueueConfig.balanced().header_config(h.build()).build()


def shard_file(db_path: Path, name: str = "pings", shard: int = 0) -> Path:
    return db_path / "collections" / name / f"shard-{shard:03d}" / "fixed.data"


def slot_of(path: Path, row_id: int, slot_size: int = SLOT) -> int:
    """Index of the occupied slot holding row ``row_id`` (parsed straight from the file)."""
    raw = path.read_bytes()
    n = (len(raw) - HEADER_PAGE) // slot_size
    for i in range(n):
        off = HEADER_PAGE + i * slot_size
        meta = struct.unpack_from("<I", raw, off)[0]
        if meta & 3 == 1 and struct.unpack_from(">Q", raw, off + 16)[0] == row_id:
            return i
    raise AssertionError(f"row {row_id} not found in {path}")


def assert_clean(db_path: Path) -> None:
    report = check(db_path)
    assert report.ok, str(report)


# ---------------------------------------------------------------------- S1: slot layout


def test_s1_header_page_and_slot_layout_are_byte_exact(tmp_path: Path) -> None:
    # No timed sync: on a loaded host 50 ms could pass between the open and a write, and
    # the writer's own sync then took generations of the mark before the close's.
    cfg = FixedConfig.balanced().grow_step(8).sync_interval(3600).build()
    shard = FixedShard(str(tmp_path / "s"), 3, 16, 32, cfg)
    assert shard.slot_size == 64  # 8 + 16 + 32 = 56, rounded up to a power of two
    body = bytes(range(1, 41))  # shorter than the 56-byte body: zero-padded
    a = shard.alloc()
    b = shard.alloc()
    assert (a, b) == (0, 1)  # lowest free slot first
    va = shard.write(a, body)
    vb = shard.write(b, b"\xff" * 48, version=7)
    assert (va, vb) == (1, 7)
    assert shard.versions.dtype == np.uint32 and shard.versions[a] == 1 and shard.versions[b] == 7
    shard.close()

    raw = (tmp_path / "s" / "fixed.data").read_bytes()
    assert len(raw) == HEADER_PAGE + 8 * 64
    # header page: magic, version, slot_size, key_size, value_size, shard index, crc32; then zeros
    assert struct.unpack_from("<8sIIIII", raw, 0) == (b"ARMFIXD1", 1, 64, 16, 32, 3)
    assert struct.unpack_from("<I", raw, 28)[0] == zlib.crc32(raw[:28])
    # then the high-water mark's copy A at 512 (two slots written; close writes copy B in
    # fixed.redo under generation 1, then copy A under generation 2)
    hwm = struct.Struct("<8sQQ")
    assert hwm.unpack_from(raw, 512) == (b"ARMHWM01", 2, 2)
    assert struct.unpack_from("<I", raw, 512 + 24)[0] == zlib.crc32(raw[512 : 512 + 24])
    assert raw[32:512] + raw[512 + 28 : HEADER_PAGE] == bytes(HEADER_PAGE - 32 - 28)

    def slot(i: int) -> bytes:
        return raw[HEADER_PAGE + i * 64 : HEADER_PAGE + (i + 1) * 64]

    s0 = slot(0)
    meta = struct.unpack_from("<I", s0, 0)[0]
    assert meta == (1 << 2) | 1  # version 1, occupied
    assert s0[8:] == body + bytes(16)  # a 56-byte body: zero-padded
    assert struct.unpack_from("<I", s0, 4)[0] == zlib.crc32(s0[0:4] + s0[8:])
    s1 = slot(1)
    assert struct.unpack_from("<I", s1, 0)[0] == (7 << 2) | 1
    assert struct.unpack_from("<I", s1, 4)[0] == zlib.crc32(s1[0:4] + s1[8:])
    # never-written slots are all zero (a sparse hole)
    assert raw[HEADER_PAGE + 2 * 64 :] == bytes(6 * 64)


def test_s1_freed_slot_is_deleted_with_next_version_and_zero_body(tmp_path: Path) -> None:
    shard = FixedShard(str(tmp_path / "s"), 0, 16, 32, FixedConfig.balanced().grow_step(8).build())
    i = shard.alloc()
    shard.write(i, b"\x01" * 48)
    v = shard.free(i)
    assert v == 2
    assert shard.alloc() == i  # a freed slot is reused first
    shard.unalloc(i)
    shard.close()
    raw = (tmp_path / "s" / "fixed.data").read_bytes()
    s = raw[HEADER_PAGE : HEADER_PAGE + 64]
    assert struct.unpack_from("<I", s, 0)[0] == (2 << 2) | 2  # version 2, deleted
    assert s[8:] == bytes(56)
    assert struct.unpack_from("<I", s, 4)[0] == zlib.crc32(s[:4] + bytes(56))


def test_s1_queue_row_key_and_header_are_byte_exact(db_path: Path) -> None:
    clock = FakeClock(1_700_000_000_123)
    t0 = clock.ms
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        rid = q.push((42, 7), delay=2.5)
        assert rid == 1
        path = shard_file(db_path)
        off = HEADER_PAGE + slot_of(path, rid) * SLOT
        raw = path.read_bytes()[off : off + SLOT]
        payload = np.array((42, 7), dtype=PAYLOAD).tobytes()
        key = struct.pack(">QQ", t0 + 2500, rid)
        header = struct.pack("<BBHIqQq", 0, 0, 0, 0, 0, 0, t0)  # READY, no lease, pushed at t0
        assert raw[8:] == key + header + payload + bytes(SLOT - 8 - 16 - 32 - 12)  # zero padding
        assert struct.unpack_from("<I", raw, 0)[0] == (1 << 2) | 1
        assert struct.unpack_from("<I", raw, 4)[0] == zlib.crc32(raw[:4] + raw[8:])

        clock.advance(3)
        (lease,) = q.lease(1)
        raw = path.read_bytes()[off : off + SLOT]
        header = struct.pack("<BBHIqQq", 1, 0, 1, 1, clock.ms + 30_000, 0, t0)  # LEASED, attempt 1, epoch 1
        assert raw[8:] == key + header + payload + bytes(SLOT - 8 - 16 - 32 - 12)
        assert struct.unpack_from("<I", raw, 0)[0] == (2 << 2) | 1  # updated in place: version 2

        q.nack(lease.token, dead=True)
        raw = path.read_bytes()[off : off + SLOT]
        dead_key = struct.pack(">QQ", (1 << 63) | clock.ms, rid)  # dead key class: bit 63 | dead-at
        assert raw[8:24] == dead_key
        assert raw[24] == 2 and raw[25] == 1  # DEAD, flags = dead-lettered explicitly
    assert_clean(db_path)


# ---------------------------------------------------------------------- S2: version vector, allocated file


@pytest.mark.parametrize("shards", [1, 2])
def test_s2_version_vector_is_400000_bytes_per_shard(db_path: Path, shards: int) -> None:
    with Db.open(db_path, clock=FakeClock()) as db:
        q = db.open_queue(Pings, qconfig(grow_step=100_000, shard_count=shards))
        q.push((1, 1))
        st_ = q.stats()
        assert st_.version_vector_bytes == 400_000 * shards
        assert st_.slots_allocated == 100_000 * shards
        assert all(s.versions.nbytes == 400_000 and s.versions.dtype == np.uint32 for s in q._headers.shards)
        for i in range(shards):
            path = shard_file(db_path, shard=i)
            logical = path.stat().st_size
            assert logical == HEADER_PAGE + 100_000 * SLOT
            physical = path.stat().st_blocks * 512
            # Blocks allocated when the file grows, not sparse: on a full disk a store
            # into the map would otherwise be a SIGBUS (tests/test_full_disk.py).
            assert logical <= physical < logical + 1024 * 1024, (physical, logical)
        assert st_.header_file_logical_bytes == shards * (HEADER_PAGE + 100_000 * SLOT)


def test_s2_queue_preset_grow_step_is_100000(db_path: Path) -> None:
    with Db.open(db_path, clock=FakeClock()) as db:
        q = db.open_queue(Pings)  # the default QueueConfig: the queue preset
        assert q.stats().version_vector_bytes == 400_000
        assert shard_file(db_path).stat().st_size == HEADER_PAGE + 100_000 * SLOT


def test_s2_file_grows_by_grow_step_when_full(db_path: Path) -> None:
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig(grow_step=8))
        path = shard_file(db_path)
        assert path.stat().st_size == HEADER_PAGE + 8 * SLOT
        ids = [q.push((i, i)) for i in range(8)]
        assert q.stats().slots_allocated == 8
        assert path.stat().st_size == HEADER_PAGE + 8 * SLOT
        ids.append(q.push((8, 8)))  # the 9th row needs a new grow step
        assert q.stats().slots_allocated == 16
        assert q.stats().version_vector_bytes == 16 * 4
        assert path.stat().st_size == HEADER_PAGE + 16 * SLOT
        leases = q.lease(20)
        assert [le.id for le in leases] == ids
        assert [int(le.payload["doc"]) for le in leases] == list(range(9))
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig(grow_step=8))
        assert q.stats().slots_allocated == 16
        assert q.len() == 9
    assert_clean(db_path)


# ---------------------------------------------------------------------- S3: the version ring


def ref_compare(a: int, b: int) -> int:
    """Pure-Python reference: signed distance on the 30-bit ring, in [-2^29, 2^29)."""
    d = ((a % RING) - (b % RING) + HALF) % RING - HALF
    if d == 0:
        return K.EQUAL
    if d == -HALF:
        return K.STALE  # exactly half a ring apart: order unknowable
    return K.NEWER if d > 0 else K.OLDER


u32 = st.integers(0, 2**32 - 1)
ring = st.integers(0, RING - 1)


def test_s3_ring_constants() -> None:
    assert (K.RING_BITS, K.RING_MASK, K.RING_HALF) == (30, RING - 1, HALF)
    assert (K.OLDER, K.EQUAL, K.NEWER, K.STALE) == (-1, 0, 1, 2)


@settings(max_examples=300, deadline=None)
@given(u32, u32)
def test_s3_compare_matches_reference(a: int, b: int) -> None:
    assert K.compare(a, b) == ref_compare(a, b)


@settings(max_examples=200, deadline=None)
@given(ring, st.integers(1, HALF - 1))
def test_s3_compare_across_wraparound(a: int, k: int) -> None:
    b = (a + k) % RING  # b is k steps ahead of a, possibly past the wrap
    assert K.compare(b, a) == K.NEWER
    assert K.compare(a, b) == K.OLDER
    assert K.compare(a, a) == K.EQUAL
    # bits above the ring are ignored
    assert K.compare(a | (1 << 30), a) == K.EQUAL
    assert K.compare(b | (3 << 30), a) == K.NEWER


@settings(max_examples=200, deadline=None)
@given(ring)
def test_s3_exact_half_ring_is_stale_both_ways(a: int) -> None:
    b = (a + HALF) % RING
    assert K.compare(a, b) == K.STALE
    assert K.compare(b, a) == K.STALE
    assert K.compare(a, (b + 1) % RING) == K.NEWER  # just past half: wrapped
    assert K.compare(a, (b - 1) % RING) == K.OLDER


def test_s3_ring_next_wraps_and_skips_zero() -> None:
    assert K.ring_next(0) == 1
    assert K.ring_next(RING - 2) == RING - 1
    assert K.ring_next(RING - 1) == 1  # never 0, so a written meta is never 0
    assert K.compare(K.ring_next(RING - 1), RING - 1) == K.NEWER


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(u32, u32), max_size=64))
def test_s3_compare_many_matches_reference(pairs: list[tuple[int, int]]) -> None:
    a = np.array([p[0] for p in pairs], dtype=np.uint32)
    b = np.array([p[1] for p in pairs], dtype=np.uint32)
    out = np.full(len(pairs), 99, dtype=np.int8)
    K.compare_many(a, b, out)
    assert out.tolist() == [ref_compare(x, y) for x, y in pairs]


def test_s3_compare_many_edge_cases_and_length_check() -> None:
    a = np.array([0, RING - 1, 5, HALF, 7, 2**32 - 1], dtype=np.uint32)
    b = np.array([RING - 1, 0, 5 + HALF, 0, 7, RING - 1], dtype=np.uint32)
    out = np.zeros(6, dtype=np.int8)
    K.compare_many(a, b, out)
    assert out.tolist() == [K.NEWER, K.OLDER, K.STALE, K.STALE, K.EQUAL, K.EQUAL]
    with pytest.raises(ValueError, match="one length"):
        K.compare_many(a, b[:3], out)


# ---------------------------------------------------------------------- S4: torn slots


def test_s4_torn_slot_is_not_served_and_repaired_on_open(db_path: Path) -> None:
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        ids = [q.push((i, 0)) for i in range(3)]
    path = shard_file(db_path)
    off = HEADER_PAGE + slot_of(path, ids[1]) * SLOT + 8 + 16 + 12  # inside the header's deadline
    data = bytearray(path.read_bytes())
    data[off] ^= 0x40
    path.write_bytes(bytes(data))

    before = check(db_path)
    assert not before.ok
    assert any("fail their CRC" in f for f in before.findings), str(before)

    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        assert q.len() == 2
        assert q.stats().repaired_on_open == 1
        assert sorted(int(i) for i in q.snapshot()["id"]) == [ids[0], ids[2]]
        assert [le.id for le in q.lease(10)] == [ids[0], ids[2]]  # the torn row is never leased
    assert_clean(db_path)
    with Db.open(db_path, clock=clock) as db:  # the repair was persisted
        q = db.open_queue(Pings, qconfig())
        assert q.stats().repaired_on_open == 0
        assert q.len() == 2
    assert_clean(db_path)


def test_s4_redo_record_binds_its_head_to_one_complete_image() -> None:
    """The redo record's CRC covers its head and the image's meta and slot CRC; the
    image's body is bound by that slot CRC, which restore_slot checks."""
    size = 64
    slots = np.zeros((4, size), dtype=np.uint8)
    redo = np.zeros(K.REDO_OFFSET + K.REDO_HEAD + size, dtype=np.uint8)
    sf = K.SlotFile(0)
    sf.bind(slots, np.zeros(4, dtype=np.uint32), np.zeros(4, dtype=np.uint8), redo)
    sf.put(1, K.OCCUPIED, b"old body")
    old_image = bytes(redo[K.REDO_OFFSET + K.REDO_HEAD:])
    sf.put(2, K.OCCUPIED, b"new body", copy=False)
    slot, image = K.redo_record(redo, size)
    assert slot == 2 and image[8:16] == b"new body"

    torn = redo.copy()  # head of the new record over the complete previous image
    torn[K.REDO_OFFSET + K.REDO_HEAD:] = np.frombuffer(old_image, dtype=np.uint8)
    assert K.redo_record(torn, size) is None
    torn = redo.copy()  # a new meta and CRC over half of the old body
    torn[K.REDO_OFFSET + K.REDO_HEAD + 8:K.REDO_OFFSET + K.REDO_HEAD + 12] = np.frombuffer(b"old ", np.uint8)
    slot, image = K.redo_record(torn, size)  # the head and meta agree ...
    assert K.restore_slot(slots, np.zeros(4, dtype=np.uint32), slot, image) == -1  # ... the body does not

    legacy = redo.copy()  # a record written when the CRC hashed the whole image
    head = legacy[K.REDO_OFFSET:K.REDO_OFFSET + 12].tobytes()
    crc = zlib.crc32(head + legacy[K.REDO_OFFSET + K.REDO_HEAD:].tobytes())
    legacy[K.REDO_OFFSET + 12:K.REDO_OFFSET + 16] = np.frombuffer(struct.pack("<I", crc), np.uint8)
    assert K.redo_record(legacy, size) == (2, image[:8] + b"new body" + image[16:])


def test_s4_torn_first_write_body_without_meta_is_repaired(db_path: Path) -> None:
    """A first write whose body landed but whose meta did not (meta 0, body non-zero)."""
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        q.push((1, 1))
    path = shard_file(db_path)
    data = bytearray(path.read_bytes())
    off = HEADER_PAGE + 5 * SLOT
    assert data[off : off + SLOT] == bytes(SLOT)
    data[off + 8 : off + 24] = struct.pack(">QQ", clock.ms, 77)
    path.write_bytes(bytes(data))
    assert not check(db_path).ok
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        assert q.len() == 1
        assert q.stats().repaired_on_open == 1
        assert 77 not in q.snapshot()["id"].tolist()
    assert_clean(db_path)


def test_s4_torn_var_header_leaves_an_orphan_body_that_is_collected(db_path: Path) -> None:
    Jobs = armdb.queue("jobs", payload=bytes, var=True)
    cfg = QueueConfig.balanced().header_config(FixedConfig.balanced().grow_step(8).build()).build()
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Jobs, cfg)
        ids = [q.push(b"body-%d" % i) for i in range(3)]
    path = shard_file(db_path, "jobs")
    var_slot = 64  # 8 + 16 + 32 = 56, rounded up to a power of two
    data = bytearray(path.read_bytes())
    data[HEADER_PAGE + slot_of(path, ids[0], var_slot) * var_slot + 30] ^= 1
    path.write_bytes(bytes(data))
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Jobs, cfg)
        st_ = q.stats()
        assert st_.repaired_on_open == 1
        assert st_.orphans_collected == 1
        assert [le.payload for le in q.lease(10)] == [b"body-1", b"body-2"]
    assert_clean(db_path)


# ---------------------------------------------------------------------- S11: zero pages


def test_s11_all_zero_slots_are_free() -> None:
    slots = np.zeros((16, 72), dtype=np.uint8)
    versions = np.full(16, 9, dtype=np.uint32)
    status = np.full(16, 7, dtype=np.uint8)
    assert K.validate(slots, versions, status) == (0, 0)
    assert status.tolist() == [K.FREE] * 16
    assert versions.tolist() == [0] * 16
    # crc32 of nothing is 0: a zero meta must never be CRC-validated as a row
    assert zlib.crc32(b"") == 0 and K.crc32(np.zeros(0, np.uint8)) == 0


@pytest.mark.parametrize("extra", ["three_slots_and_a_ragged_tail", "ftruncate_one_mib"])
def test_s11_zero_extended_file_has_no_phantom_rows(db_path: Path, extra: str) -> None:
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        ids = [q.push((i, 0)) for i in range(3)]
    path = shard_file(db_path)
    size = path.stat().st_size
    if extra == "three_slots_and_a_ragged_tail":
        with path.open("ab") as f:
            f.write(bytes(3 * SLOT + 5))
    else:
        os.truncate(path, size + (1 << 20))
    assert check(db_path).ok  # zeros are free slots, not damage
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        assert q.len() == 3
        assert q.stats().repaired_on_open == 0
        assert [le.id for le in q.lease(100)] == ids
        q.push((9, 9))
        assert q.len() == 4
    assert_clean(db_path)


# ---------------------------------------------------------------------- S12: failed syncs


class MsyncFails(_fs.RealFS):
    """RealFS whose msync raises EIO once ``fail`` is set."""

    fail = False

    def _msync(self, mf: _fs.MappedFile, offset: int, length: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "injected msync failure")
        super()._msync(mf, offset, length)


class FsyncFails(_fs.RealFS):
    """RealFS whose fsync and fdatasync raise EIO once ``fail`` is set."""

    fail = False

    def fsync(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "injected fsync failure")
        super().fsync(fd)

    def fdatasync(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "injected fsync failure")
        super().fdatasync(fd)


def test_s12_failed_msync_refuses_later_writes_until_reopen(db_path: Path) -> None:
    clock = FakeClock()
    fs = MsyncFails()
    with _fs.use(fs):
        db = Db.open(db_path, clock=clock)
        try:
            # No background sync: the push below must be the one whose sync fails (on a
            # loaded host the flusher's tick met the failing msync first, and the push was
            # refused before it was applied).
            flusher = db._workers[0]
            flusher.stop()
            flusher.join()
            q = db.open_queue(Pings, qconfig(sync_interval=0))
            returned = [q.push((i, 0)) for i in range(5)]
            (lease,) = q.lease(1)
            fs.fail = True
            with pytest.raises(StorageError, match="injected msync failure"):
                q.push((99, 0))  # sync_interval 0: this write syncs, and the sync fails
            fs.fail = False  # never retried: even a healthy disk does not un-poison the store
            with pytest.raises(StorageError, match="refused until the database is reopened"):
                q.push((100, 0))
            with pytest.raises(StorageError, match="refused"):
                q.ack(lease.token)
            with pytest.raises(StorageError, match="refused"):
                q.lease(1)
            # reads keep working
            assert q.len() in (5, 6)
            assert set(returned) <= set(q.snapshot()["id"].tolist())
            assert q.stats().pushes == q.len() == 6  # the failed-sync push is applied in RAM and counted
        finally:
            db.shutdown()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig(sync_interval=0))
        ids = set(q.snapshot()["id"].tolist())
        assert set(returned) <= ids  # every push that returned survives
        assert len(ids) in (5, 6)  # the failed push may or may not have reached the disk
        q.push((7, 7))  # writable again after the reopen
    assert_clean(db_path)


def test_s12_failed_background_msync_refuses_later_writes(db_path: Path) -> None:
    """The flusher's sync of an idle tail fails: the next write is refused, not retried."""
    clock = FakeClock()
    fs = MsyncFails()
    with _fs.use(fs):
        db = Db.open(db_path, clock=clock)
        try:
            q = db.open_queue(Pings, qconfig(sync_interval=3600))  # writes never sync inline
            first = q.push((1, 0))
            fs.fail = True
            second = q.push((2, 0))  # returns: its sync is left to the background flusher
            shard = q._headers.shards[0]
            deadline = time.monotonic() + 10
            while shard.poisoned is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert isinstance(shard.poisoned, OSError)
            fs.fail = False
            with pytest.raises(StorageError, match="injected msync failure"):
                q.push((3, 0))
            assert q.len() == 2
        finally:
            db.shutdown()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())
        assert {first, second} <= set(q.snapshot()["id"].tolist())
    assert_clean(db_path)


def test_s12_failed_fsync_of_a_fixed_queue_write_raises_storage_error(db_path: Path) -> None:
    """A fixed queue's push fsyncs only when it reserves a new id block (seqmap, T5)."""
    from armdb.seqmap import ID_BLOCK

    clock = FakeClock()
    fs = FsyncFails()
    with _fs.use(fs):
        db = Db.open(db_path, clock=clock)
        try:
            q = db.open_queue(Pings, qconfig(grow_step=4096, sync_interval=0, enable_fsync=False))
            returned = [q.push((i, 0)) for i in range(ID_BLOCK)]  # ids 1..1024: the first block
            fs.fail = True
            with pytest.raises(StorageError, match="injected fsync failure"):
                q.push((1, 1))  # needs the next id block: seqmap write + fsync fails
            with pytest.raises(StorageError):
                q.push((2, 2))
            assert q.len() == len(returned)
            assert len(q.snapshot()) == len(returned)
        finally:
            fs.fail = False
            db.shutdown()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig(grow_step=4096))
        assert q.len() == len(returned)
        assert q.push((3, 3)) not in returned
    assert_clean(db_path)


def test_s12_failed_fdatasync_of_a_var_queue_refuses_later_writes(db_path: Path) -> None:
    Jobs = armdb.queue("jobs", payload=bytes, var=True)
    cfg = (
        QueueConfig.balanced()
        .header_config(FixedConfig.balanced().grow_step(8).sync_interval(0).build())
        .payload_config(armdb.Config.balanced().sync_interval(0).build())
        .build()
    )
    clock = FakeClock()
    fs = FsyncFails()
    with _fs.use(fs):
        db = Db.open(db_path, clock=clock)
        try:
            q = db.open_queue(Jobs, cfg)
            returned = {q.push(b"job-%d" % i): b"job-%d" % i for i in range(4)}
            fs.fail = True
            with pytest.raises(StorageError, match="injected fsync failure"):
                q.push(b"job-x")
            fs.fail = False
            with pytest.raises(StorageError):
                q.push(b"job-y")
            assert q.len() == 4
            assert set(returned) <= set(q.snapshot()["id"].tolist())
        finally:
            db.shutdown()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Jobs, cfg)
        got = {le.id: le.payload for le in q.lease(10)}
        assert {k: got[k] for k in returned} == returned
    assert_clean(db_path)


# ---------------------------------------------------------------------- S5: FixedConfig


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        (lambda b: b.grow_step(0), "grow_step must be at least 1"),
        (lambda b: b.grow_step(1.5), "grow_step must be an int"),
        (lambda b: b.grow_step(True), "grow_step must be an int"),
        (lambda b: b.shard_count(0), "shard_count must be at least 1"),
        (lambda b: b.shard_count("2"), "shard_count must be an int"),
        (lambda b: b.sync_interval(-0.001), "sync_interval must not be negative"),
        (lambda b: b.sync_interval(timedelta(seconds=-1)), "sync_interval must not be negative"),
        (lambda b: b.sync_interval("50ms"), "sync_interval must be a datetime.timedelta or a number"),
        (lambda b: b.enable_fsync(1), "enable_fsync must be True or False"),
        (lambda b: b.reversed("no"), "reversed must be True or False"),
    ],
)
def test_s5_fixed_config_validation(builder, message: str) -> None:
    b = builder(FixedConfig.balanced())  # setters only record
    with pytest.raises(ConfigError, match=message):
        b.build()


def test_s5_fixed_config_defaults_and_durations() -> None:
    c = FixedConfig.balanced().build()
    assert (c.shard_count, c.sync_interval, c.enable_fsync, c.reversed) == (None, 0.05, True, False)
    c = FixedConfig.balanced().sync_interval(timedelta(milliseconds=5)).shard_count(3).reversed().build()
    assert (c.sync_interval, c.shard_count, c.reversed) == (0.005, 3, True)
    with pytest.raises(AttributeError):
        c.grow_step = 1  # type: ignore[misc]  # frozen
    # a queue's header config is never reversed (Q5)
    q = QueueConfig.balanced().header_config(c).build()
    assert q.header_config.reversed is False and q.header_config.shard_count == 3
    with pytest.raises(ConfigError, match="header_config takes a built FixedConfig"):
        QueueConfig.balanced().header_config(FixedConfig.balanced()).build()


def test_s5_shard_count_is_fixed_at_creation(db_path: Path) -> None:
    clock = FakeClock()
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig(shard_count=2))
        ids = [q.push((i, 0)) for i in range(6)]
        assert q.stats().shards == 2
    assert shard_file(db_path, shard=1).exists()
    coll = db_path / "collections"
    tree = {p: p.read_bytes() for p in coll.rglob("*") if p.is_file()}
    with (
        Db.open(db_path, clock=clock) as db,
        pytest.raises(ConfigError, match=r"has 2 header shard\(s\).*shard_count=3"),
    ):
        db.open_queue(Pings, qconfig(shard_count=3))
    assert {
        p: p.read_bytes() for p in coll.rglob("*") if p.is_file()
    } == tree  # the failed open wrote nothing
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig())  # unset: the stored count
        assert q.stats().shards == 2
        assert sorted(int(i) for i in q.snapshot()["id"]) == ids
    with Db.open(db_path, clock=clock) as db:
        q = db.open_queue(Pings, qconfig(shard_count=2))  # the same count explicitly
        assert q.len() == 6
    assert_clean(db_path)


def test_s5_slot_geometry_mismatch_raises_format_error(tmp_path: Path) -> None:
    cfg = FixedConfig.balanced().grow_step(8).build()
    FixedShard(str(tmp_path / "s"), 0, 16, 32, cfg).close()
    with pytest.raises(FormatError, match=r"slots are 16\+32 bytes on disk"):
        FixedShard(str(tmp_path / "s"), 0, 16, 40, cfg)


def test_d5_files_are_created_whole_and_a_cut_creation_is_cleaned_up(db_path: Path) -> None:
    # SPEC D5: a file under its final name always carries its whole header (it is built
    # as <name>.tmp, fsynced and renamed), so a torn header can only mean damage.  The
    # .tmp a crash leaves behind is deleted by the next open, and check() stays clean.
    spec = armdb.queue("jobs", payload=np.dtype("<u4"))
    db = Db.open(db_path)
    q = db.open_queue(spec, None)
    q.push(7)
    db.close()
    sdir = db_path / "collections" / "jobs" / "shard-000"
    leftovers = [sdir / "fixed.data.tmp", sdir / "fixed.redo.tmp", db_path / "txlog" / "00000099.log.tmp"]
    for p in leftovers:
        p.write_bytes(os.urandom(100))
    db = Db.open(db_path)
    try:
        q = db.open_queue(spec, None)
        assert [int(x.payload) for x in q.lease(5)] == [7]
    finally:
        db.close()
    assert not any(p.exists() for p in leftovers)
    assert check(db_path).ok


def test_d5_create_file_failure_leaves_no_file(tmp_path: Path) -> None:
    # SPEC D5/S12: if the fsync inside a creation fails, neither the final name nor the
    # .tmp exists afterwards, and the error reaches the caller.
    class FailingSync(_fs.RealFS):
        def fsync(self, fd: int) -> None:
            raise OSError(errno.EIO, "injected")

    with _fs.use(FailingSync()), pytest.raises(OSError):
        _fs.FS.create_file(str(tmp_path / "f.data"), b"HEAD", 4096)
    assert sorted(os.listdir(tmp_path)) == []
