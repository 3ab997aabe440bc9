"""Copies of only what differs (R5), resuming across a primary restart (R1, R6),
synchronous replicas for durable direct pushes (R4), and the primary's lag figures.

A follower that holds a complete copy of the database, and that its primary cannot
resume from the in-memory backlog (the primary restarted, or the follower fell out of
the backlog), gets only what differs: FixedStore slots compared by their version on the
ring of S3 and their CRC, other files by block digest.  docs/replication.md."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import FixedConfig, QueueConfig
from armdb._core import fixed as _k

from .conftest import FakeClock, child_env, kill_and_read, spawn_child
from .test_replication import LOCAL, Primary, _diff, files, returned_then_killed, settle

RING = 1 << 30
HALF = 1 << 29
HEADER_PAGE = 4096


def _slots(path: Path) -> tuple[bytearray, int]:
    raw = bytearray(path.read_bytes())
    slot_size = int.from_bytes(raw[12:16], "little")
    return raw, slot_size


def _set_version(raw: bytearray, slot_size: int, slot: int, version: int, body: bytes | None = None) -> None:
    """Give slot ``slot`` the version ``version`` (its status kept) and a valid CRC."""
    off = HEADER_PAGE + slot * slot_size
    meta = int.from_bytes(raw[off : off + 4], "little")
    new_meta = (version % RING) << 2 | (meta & 3)
    if body is not None:
        raw[off + 8 : off + 8 + len(body)] = body
    crc = _k.slot_crc(new_meta, bytes(raw[off + 8 : off + slot_size]))
    raw[off : off + 4] = new_meta.to_bytes(4, "little")
    raw[off + 4 : off + 8] = crc.to_bytes(4, "little")


def _version(raw: bytearray, slot_size: int, slot: int) -> int:
    off = HEADER_PAGE + slot * slot_size
    return int.from_bytes(raw[off : off + 4], "little") >> 2


def _restart(path: Path, port: int, clock: FakeClock) -> Any:
    from .test_replication import schema

    db = armdb.Db.open(path, clock=clock, schema=schema())
    db.replicate(listen=("127.0.0.1", port))
    return db


# SPEC R5: a follower's slots are compared with the primary's on the 30-bit ring; one
# more than 2^29 versions behind (it reads as ahead), one exactly half the ring away,
# one behind, one of the same version with another body: each is recopied, never kept
def test_r5_stale_slots_are_detected_on_the_ring_and_recopied(tmp_path: Path, clock: FakeClock) -> None:
    p = Primary(tmp_path / "primary", clock)
    follower = armdb.Db.follow(tmp_path / "f", primary=p.address)
    p.load(0, 20)
    settle(p, follower)
    port = p.address[1]
    p.db.close()
    settle(p, follower)
    follower.close()
    data = tmp_path / "f" / "collections" / "fixedq" / "shard-000" / "fixed.data"
    raw, slot_size = _slots(data)
    v = [_version(raw, slot_size, i) for i in range(4)]
    assert all(v), v  # four written slots
    _set_version(raw, slot_size, 0, v[0] - HALF - 3)  # far behind: on the ring it reads as ahead
    _set_version(raw, slot_size, 1, v[1] + HALF)  # exactly half the ring: cannot be ordered
    _set_version(raw, slot_size, 2, v[2] - 1)  # simply behind
    _set_version(raw, slot_size, 3, v[3], body=b"\xee" * 8)  # same version, another history
    data.write_bytes(bytes(raw))
    (tmp_path / "f" / "stray").write_bytes(b"gone on the primary")  # what the primary does not list goes
    (tmp_path / "f" / "collections" / "stray_dir").mkdir()
    (tmp_path / "f" / "collections" / "stray_dir" / "x").write_bytes(b"x")
    db = _restart(tmp_path / "primary", port, clock)
    try:
        follower = armdb.Db.follow(tmp_path / "f", primary=("127.0.0.1", port))
        assert follower._mode == "delta"
        assert follower.wait_applied(int(db.replication_status()["seq"]), timeout=20), follower.status()
        last = follower.status()["last_copy"]
        assert last["mode"] == "delta", last
        assert last["slots_stale"] >= 2, last  # the far-behind and the half-ring slot
        assert last["slots_behind"] >= 1, last
        assert last["slots_diverged"] >= 1, last
    finally:
        db.close()
    try:
        assert follower.wait_applied(int(db.replication_status()["seq"]), timeout=20)
    finally:
        follower.close()
    d = _diff(files(tmp_path / "f"), files(tmp_path / "primary"))
    assert not d, "\n".join(d)  # every tampered slot is the primary's again, no stray file
    assert not (tmp_path / "f" / "collections" / "stray_dir").exists()


# SPEC R5: files other than slots are compared per block digest; a follower asks for the
# blocks that differ and for what its copy lacks
def test_r5_block_digests_ask_for_what_differs(tmp_path: Path, clock: FakeClock) -> None:
    from armdb.replication import _ranges_to_ask

    counts = {"slots_behind": 0, "slots_stale": 0, "slots_diverged": 0, "slots_missing": 0}
    missing = _ranges_to_ask(str(tmp_path / "nope"), 10, "blocks", 1 << 16, b"x" * 16, counts)
    assert missing == [0, 10]  # a file the follower lacks: all of it
    f = tmp_path / "blk"
    f.write_bytes(b"a" * 100_000)
    from armdb.replication import BLOCK, _block_digests

    fd = os.open(f, os.O_RDONLY)
    try:
        same = _block_digests(fd, 100_000)
    finally:
        os.close(fd)
    assert _ranges_to_ask(str(f), 100_000, "blocks", BLOCK, same, counts) == []
    other = same[:16] + b"\0" * 16
    assert _ranges_to_ask(str(f), 100_000, "blocks", BLOCK, other, counts) == [BLOCK, 100_000 - BLOCK]
    g = tmp_path / "grown"
    g.write_bytes(b"a" * 100_000 + b"b" * 100_000)  # the primary's file grew
    fd = os.open(g, os.O_RDONLY)
    try:
        grown = _block_digests(fd, 200_000)
    finally:
        os.close(fd)
    assert _ranges_to_ask(str(f), 200_000, "blocks", BLOCK, grown, counts) == [BLOCK, 200_000 - BLOCK]


PRIMARY = """
import armdb, numpy as np, time
db = armdb.Db.open({path!r})
addr = db.replicate(listen=("127.0.0.1", {port}))
print("PORT", addr[1], flush=True)
fixed = db.open_queue(armdb.queue("fixedq", payload=np.dtype("<u8")))
var = db.open_queue(armdb.queue("varq", payload=dict, var=True))
m = db.open_map("m")
if {wait}:  # a restarted primary: the follower reconnects (and copies what differs) first
    while not any(f["phase"] == "streaming" for f in db.replication_status()["followers"]):
        time.sleep(0.01)
i = {start}
while i < {stop}:
    fixed.push(i)
    var.push({{"i": i, "pad": "p" * (i % 200)}})
    m.put(i, i)
    if i % 5 == 0:
        for lz in fixed.lease(2):
            fixed.ack(lz)
    i += 1
    if i % 50 == 0:
        print("N", i, flush=True)
db.close()
print("END", db.replication_status()["seq"], flush=True)

"""


def _spawn(path: Path, port: int, start: int, stop: int) -> tuple[Any, int]:
    proc = spawn_child(PRIMARY.format(path=str(path), port=port, start=start, stop=stop, wait=port != 0), env=child_env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT"), line + (proc.stderr.read() if proc.stderr else "")
    return proc, int(line.split()[1])


def _restart_round(tmp_path: Path, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ppath, fpath = tmp_path / f"p{seed}", tmp_path / f"f{seed}"
    proc, port = _spawn(ppath, 0, 0, 10**9)
    follower = armdb.Db.follow(fpath, primary=("127.0.0.1", port))
    try:
        deadline = time.monotonic() + 20
        while not follower.status()["snapshot_complete"]:
            assert time.monotonic() < deadline, follower.status()
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.4))
        kill_and_read(proc)  # SIGKILL under load: the follower loses its stream
        # The primary restarts on the same address, writes more, and closes cleanly.
        proc, _ = _spawn(ppath, port, 10**6, 10**6 + rng.randint(20, 200))
        assert proc.stdout is not None
        end = None
        for line in proc.stdout:
            if line.startswith("END"):
                end = int(line.split()[1])
                break
        assert end is not None
        assert follower.wait_applied(end, timeout=30), follower.status()
        st = follower.status()
    finally:
        follower.close()
        kill_and_read(proc)
    last = st["last_copy"]
    assert last["mode"] == "delta", st  # it kept its copy: only what differs came
    total = sum(len(b) for b in files(ppath).values())
    assert last["bytes"] < total // 2, (last, total)
    d = _diff(files(fpath), files(ppath))
    assert not d, "\n".join(d)  # SPEC R6: converged to the restarted primary's bytes
    db = follower.promote()
    db.close()
    assert armdb.check(fpath).ok
    return last


def _rounds(default: int) -> int:
    return int(os.environ.get("ARMDB_KILLS_REPL", str(default)))


# SPEC R1, R5, R6: the primary SIGKILLed under load and restarted; the follower resumes
# with what differs, not a full copy, and converges byte for byte
@pytest.mark.crash
def test_r6_primary_killed_and_restarted_follower_resumes_with_what_differs(tmp_path: Path) -> None:
    for seed in range(_rounds(1)):
        _restart_round(tmp_path, seed)


# SPEC R1, R5, R6
@pytest.mark.slow
@pytest.mark.crash
def test_r6_primary_restart_20_rounds(tmp_path: Path) -> None:
    for seed in range(600, 620):
        _restart_round(tmp_path, seed)


def durable_cfg() -> Any:
    return QueueConfig.balanced().header_config(FixedConfig.balanced().sync_interval(0).build()).build()


Durable = armdb.queue("dq", payload=np.dtype("<u8"))


# SPEC R4: a durable direct push (no transaction) waits for the synchronous follower too
def test_r4_a_durable_push_waits_for_a_follower(tmp_path: Path) -> None:
    db = armdb.Db.open(tmp_path / "p", tx_config=armdb.TxConfig(durable=True).sync_replicas(1))
    address = db.replicate(listen=LOCAL)
    q = db.open_queue(Durable, durable_cfg())  # opening does not wait: no write of a user yet
    done = threading.Event()

    def push() -> None:
        q.push(7)
        done.set()

    t = threading.Thread(target=push)
    t.start()
    follower = None
    try:
        assert not done.wait(0.5)  # no follower: the durable push waits
        follower = armdb.Db.follow(tmp_path / "f", primary=address)
        assert done.wait(10), follower.status()
        t.join()
        st = db.replication_status()
        assert st["sync_replicas"] == 1 and len(st["followers"]) == 1, st
        lz = q.lease(1)[0]  # a durable lease: the follower confirms it too
        follower.close()  # the only follower goes away: a durable ack waits ...
        done.clear()
        t = threading.Thread(target=lambda: (q.ack(lz), done.set()))
        t.start()
        assert not done.wait(0.3)
        db.close()  # ... until the primary closes
        t.join(10)
        assert not t.is_alive()
    finally:
        if follower is not None:
            follower.close()
        db.close()
    # What the follower confirmed is in its copy: the push, and its lease.
    fdb = follower.promote()
    try:
        snap = fdb.open_queue(Durable, durable_cfg()).snapshot()
        assert snap["state"].tolist() == [1], snap  # one row, leased
    finally:
        fdb.close()


DURABLE_PUSHER = """
import armdb, numpy as np
from armdb import FixedConfig, QueueConfig
db = armdb.Db.open({path!r}, tx_config=armdb.TxConfig(durable=True).sync_replicas(1))
addr = db.replicate(listen=("127.0.0.1", 0))
print("PORT", addr[1], flush=True)
cfg = QueueConfig.balanced().header_config(FixedConfig.balanced().sync_interval(0).build()).build()
q = db.open_queue(armdb.queue("dq", payload=np.dtype("<u8")), cfg)
i = 0
while True:
    q.push(i)
    print("P", i, flush=True)  # the durable push returned
    i += 1
"""


def _durable_push_round(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    ppath, fpath = tmp_path / f"dp{seed}", tmp_path / f"df{seed}"
    follower, returned = returned_then_killed(DURABLE_PUSHER.format(path=str(ppath)), "P", rng.randint(5, 80),
                                              fpath)
    db = follower.promote()
    try:
        q = db.open_queue(Durable, durable_cfg())
        got_ids = {int(lz.payload) for lz in q.lease(len(q) + 10)} if len(q) else set()
        missing = [i for i in returned if i not in got_ids]
        assert not missing, missing  # SPEC R4: every durable push that returned is on the follower
    finally:
        db.close()
    assert armdb.check(fpath).ok


# SPEC R4, R6: the primary SIGKILLed while pushing durably with sync_replicas(1)
@pytest.mark.crash
def test_r4_every_returned_durable_push_survives_promotion(tmp_path: Path) -> None:
    for seed in range(_rounds(1)):
        _durable_push_round(tmp_path, seed)


# SPEC R4, R6
@pytest.mark.slow
@pytest.mark.crash
def test_r4_durable_push_20_rounds(tmp_path: Path) -> None:
    for seed in range(700, 720):
        _durable_push_round(tmp_path, seed)


# SPEC R1: the primary reports each follower's lag in operations, bytes and seconds
def test_r1_replication_status_reports_lag_in_bytes_and_seconds(tmp_path: Path, clock: FakeClock) -> None:
    p = Primary(tmp_path / "primary", clock)
    follower = armdb.Db.follow(tmp_path / "f", primary=p.address)
    try:
        p.load(0, 5)
        settle(p, follower)
        deadline = time.monotonic() + 10
        while True:  # the follower's ack of its last batch arrives just after it applied it
            (f,) = p.db.replication_status()["followers"]
            if f["lag_bytes"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert f["phase"] == "streaming" and f["lag_bytes"] == 0 and f["lag_seconds"] == 0.0, f
        with follower._lock:  # the follower stalls: nothing applied, nothing acknowledged
            p.fixed.push(1)
            p.plain.put("big", "x" * 50_000)
            time.sleep(0.3)
            (f,) = p.db.replication_status()["followers"]
            assert f["lag_frames"] >= 2 and f["lag_bytes"] >= 50_000 and f["lag_seconds"] >= 0.25, f
        settle(p, follower)
        deadline = time.monotonic() + 10
        while p.db.replication_status()["followers"][0]["lag_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.db.replication_status()["followers"][0]["lag_bytes"] == 0
    finally:
        follower.close()
        p.db.shutdown()


# SPEC R1: a write larger than a frame may carry travels in pieces and arrives whole
def test_r1_a_large_value_is_streamed_in_pieces(tmp_path: Path, clock: FakeClock) -> None:
    p = Primary(tmp_path / "primary", clock)
    follower = armdb.Db.follow(tmp_path / "f", primary=p.address)
    try:
        big = os.urandom(3 << 20)
        p.plain.put("big", big)
        p.db.close()
        settle(p, follower)
    finally:
        follower.close()
    d = _diff(files(tmp_path / "f"), files(tmp_path / "primary"))
    assert not d, "\n".join(d)
    db = follower.promote(clock=clock)
    try:
        assert db.open_map("plain").get("big") == big
    finally:
        db.close()
