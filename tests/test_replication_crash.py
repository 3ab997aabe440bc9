"""Replication under SIGKILL (R1, R3, R6): the primary killed under load, then the follower
promoted, holds a prefix of the primary's history per store and checks clean; a follower
killed mid-apply resumes from its persisted position and converges.

The default run keeps a small slice of rounds (``ARMDB_KILLS_REPL``, default 2); the
``slow`` variants run 20 rounds from fixed seeds."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb

from .conftest import FakeClock, child_env, kill_and_read, spawn_child
from .test_replication import Primary, _diff, files, returned_then_killed, settle

Fixed = armdb.queue("fixedq", payload=np.dtype("<u8"))
Var = armdb.queue("varq", payload=dict, var=True)
Work = armdb.queue("work", payload=np.dtype("<u8"))

PRIMARY = """
import armdb, numpy as np
db = armdb.Db.open({path!r})
addr = db.replicate(listen=("127.0.0.1", 0))
print("PORT", addr[1], flush=True)
fixed = db.open_queue(armdb.queue("fixedq", payload=np.dtype("<u8")))
var = db.open_queue(armdb.queue("varq", payload=dict, var=True))
work = db.open_queue(armdb.queue("work", payload=np.dtype("<u8")))
m = db.open_map("m")
i = 0
while True:
    fixed.push(i)
    var.push({{"i": i, "pad": "p" * (i % 200)}})
    m.put(i, i)
    work.push(i)
    if i % 4 == 0:
        with db.tx() as tx:
            tx.put(m, f"t{{i}}", i)
            for lz in work.lease(2):
                tx.ack(work, lz)
    if i % 7 == 0:
        for lz in work.lease(1):
            work.nack(lz, delay=1)
    i += 1
    if i % 50 == 0:
        print("N", i, flush=True)
"""


def _rounds(default: int) -> int:
    return int(os.environ.get("ARMDB_KILLS_REPL", str(default)))


def _start_primary(path: Path) -> tuple[Any, int]:
    p = spawn_child(PRIMARY.format(path=str(path)), env=child_env())
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("PORT"), line + (p.stderr.read() if p.stderr else "")
    return p, int(line.split()[1])


def _is_prefix(values: list[int]) -> bool:
    return sorted(values) == list(range(len(values)))


def _check_promoted(path: Path) -> dict[str, int]:
    db = armdb.Db.open(path)
    try:
        fixed = db.open_queue(Fixed)
        var = db.open_queue(Var)
        db.open_queue(Work)
        m = db.open_map("m")
        f_vals = [int(lz.payload) for lz in fixed.lease(len(fixed) + 10)] if len(fixed) else []
        v_vals = [lz.payload["i"] for lz in var.lease(len(var) + 10)] if len(var) else []
        m_vals = [k for k, _ in m.items() if isinstance(k, int)]
        # SPEC R6: per store, a prefix of the primary's history (no row from the future, no hole)
        assert _is_prefix(f_vals), sorted(f_vals)[-5:]
        assert _is_prefix(v_vals), sorted(v_vals)[-5:]
        assert _is_prefix(m_vals), sorted(m_vals)[-5:]
        counts = {"fixed": len(f_vals), "var": len(v_vals), "map": len(m_vals)}
    finally:
        db.close()
    report = armdb.check(path)
    assert report.ok, report.findings
    return counts


def _kill_primary_round(tmp_path: Path, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    ppath, fpath = tmp_path / f"p{seed}", tmp_path / f"f{seed}"
    proc, port = _start_primary(ppath)
    follower = None
    try:
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 0.3))  # sometimes the follower copies a snapshot of a loaded primary
        follower = armdb.Db.follow(fpath, primary=("127.0.0.1", port))
        deadline = time.monotonic() + 20
        while not follower.status()["snapshot_complete"]:
            assert time.monotonic() < deadline, follower.status()
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.5))
    finally:
        kill_and_read(proc)
    assert follower is not None
    time.sleep(0.05)
    db = follower.promote()  # SPEC R3
    db.close()
    return _check_promoted(fpath)


# SPEC R1, R3, R6
@pytest.mark.crash
def test_r6_primary_killed_then_promoted_holds_a_prefix(tmp_path: Path) -> None:
    for seed in range(_rounds(2)):
        counts = _kill_primary_round(tmp_path, seed)
        assert counts["fixed"] > 0, counts


# SPEC R1, R3, R6
@pytest.mark.slow
@pytest.mark.crash
def test_r6_primary_killed_then_promoted_holds_a_prefix_20_rounds(tmp_path: Path) -> None:
    for seed in range(100, 120):
        _kill_primary_round(tmp_path, seed)


FOLLOWER = """
import armdb, time
f = armdb.Db.follow({path!r}, primary=("127.0.0.1", {port}))
while True:
    time.sleep(0.01)
    st = f.status()
    print("SEQ", st["applied_seq"], st["snapshot_complete"], flush=True)
"""


def _kill_follower_round(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    ppath, fpath = tmp_path / f"p{seed}", tmp_path / f"f{seed}"
    p = Primary(ppath, FakeClock())
    try:
        p.load(0, 10)
        for _ in range(rng.randint(1, 3)):
            child = spawn_child(FOLLOWER.format(path=str(fpath), port=p.address[1]))
            assert child.stdout is not None
            child.stdout.readline()
            p.load(rng.randint(10, 1000) * 100, rng.randint(5, 30))  # applied while the child runs
            time.sleep(rng.uniform(0.0, 0.2))
            kill_and_read(child)  # SIGKILL mid-apply, perhaps between its files and its position
        follower = armdb.Db.follow(fpath, primary=p.address)
        try:
            p.load(200_000, 10)
            settle(p, follower)
            p.db.close()
            settle(p, follower)
        finally:
            follower.close()
        d = _diff(files(fpath), files(ppath))
        assert not d, "\n".join(d)  # SPEC R6: converged to the primary's bytes
    finally:
        p.db.shutdown()


# SPEC R1, R6
@pytest.mark.crash
def test_r6_follower_killed_resumes_and_converges(tmp_path: Path) -> None:
    for seed in range(_rounds(2)):
        _kill_follower_round(tmp_path, seed)


# SPEC R1, R6
@pytest.mark.slow
@pytest.mark.crash
def test_r6_follower_killed_resumes_and_converges_20_rounds(tmp_path: Path) -> None:
    for seed in range(200, 220):
        _kill_follower_round(tmp_path, seed)


DURABLE_PRIMARY = """
import armdb
db = armdb.Db.open({path!r}, tx_config=armdb.TxConfig(durable=True).sync_replicas(1))
addr = db.replicate(listen=("127.0.0.1", 0))
print("PORT", addr[1], flush=True)
m = db.open_map("m")
i = 0
while True:
    with db.tx() as tx:
        tx.put(m, i, i)
    print("C", i, flush=True)  # the durable commit returned
    i += 1
"""


def _sync_replica_round(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    ppath, fpath = tmp_path / f"sp{seed}", tmp_path / f"sf{seed}"
    follower, returned = returned_then_killed(DURABLE_PRIMARY.format(path=str(ppath)), "C", rng.randint(5, 60),
                                              fpath)
    db = follower.promote()
    try:
        m = db.open_map("m")
        missing = [i for i in returned if m.get(i) != i]
        assert not missing, missing  # SPEC R4: every durable commit that returned is on the follower
    finally:
        db.close()
    assert armdb.check(fpath).ok


# SPEC R4, R6
@pytest.mark.crash
def test_r4_sync_replicas_every_returned_durable_commit_survives_promotion(tmp_path: Path) -> None:
    for seed in range(_rounds(2)):
        _sync_replica_round(tmp_path, seed)


# SPEC R4, R6
@pytest.mark.slow
@pytest.mark.crash
def test_r4_sync_replicas_20_rounds(tmp_path: Path) -> None:
    for seed in range(400, 420):
        _sync_replica_round(tmp_path, seed)
