"""Queue crash safety with real processes (Q12, Q15): SIGKILL and failpoints, then reopen and check."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import armdb
from armdb import QueueConfig

from .conftest import child_env, kill_and_read, run_child, spawn_child

VarJobs = armdb.queue("jobs", payload=dict, var=True)

PRODUCER = """
import armdb, hashlib
db = armdb.Db.open({path!r})
q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
n = {base}
while True:
    jid = q.push({{"n": n, "digest": hashlib.sha1(str(n).encode()).hexdigest(), "pad": "x" * (n % 300)}})
    print(jid, n, flush=True)
    n += 1
"""


@pytest.mark.crash
def test_q15_var_push_sigkill_never_leaves_header_without_body(tmp_path):
    """20+ rounds: every push that returned is leasable with its exact payload; no header
    lacks its body (a lease would raise); orphan bodies are collected."""
    import hashlib

    path = tmp_path / "db"
    rng = random.Random(7)
    returned: dict[int, int] = {}
    for r in range(int(os.environ.get("ARMDB_KILLS_QUEUE", "20"))):
        p = spawn_child(PRODUCER.format(path=str(path), base=r * 1_000_000))
        first = p.stdout.readline()  # type: ignore[union-attr]  # the queue is open and pushing
        parts = first.split()
        if len(parts) == 2:
            returned[int(parts[0])] = int(parts[1])
        time.sleep(rng.uniform(0.0, 0.4))
        out, _ = kill_and_read(p)
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2:
                returned[int(parts[0])] = int(parts[1])
        with armdb.Db.open(path) as db:  # recovery runs on open; check() judges what it left
            db.open_queue(VarJobs, QueueConfig.balanced().build())
        rep = armdb.check(path)
        assert rep.ok, rep.findings
    with armdb.Db.open(path) as db:
        q = db.open_queue(VarJobs, QueueConfig.balanced().build())
        assert len(q._payload) == q.len()  # bodies match headers one to one after the orphan pass
        got = {}
        for lz in q.lease(1_000_000):  # armdb.queue.MAX_LEASE: every row the test pushed
            n = lz.payload["n"]
            assert lz.payload["digest"] == hashlib.sha1(str(n).encode()).hexdigest()
            got[lz.id] = n
        for jid, n in returned.items():
            assert got.get(jid) == n, (jid, n)
        assert len(returned) > 100
    assert armdb.check(path).ok


def test_q15_crash_between_body_and_header_leaves_invisible_orphan(db_path):
    code = f"""
    import armdb
    db = armdb.Db.open({str(db_path)!r})
    q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
    q.push({{"n": 1}})
    q.push({{"n": 2}})
    """
    r = run_child(code, env=child_env(ARMDB_FAILPOINT="queue.var_push.after_body:1"))
    assert r.returncode == 86, r.stderr
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(VarJobs, QueueConfig.balanced().build())
        st = q.stats()
        assert st.orphans_collected == 1 and q.len() == 1
        assert [lz.payload for lz in q.lease(5)] == [{"n": 1}]
        assert len(q._payload) == 1
    assert armdb.check(db_path).ok


CONSUMER = """
import armdb
db = armdb.Db.open({path!r})
q = db.open_queue(armdb.queue("jobs", payload=dict, var=True),
                  armdb.QueueConfig.balanced().lease_timeout(0.5).build())
for lz in q.lease(100):
    if lz.payload["n"] % 2 == 0:
        q.ack(lz.token)
        print("acked", lz.payload["n"], flush=True)
    else:
        print("holding", lz.payload["n"], flush=True)
print("ready", flush=True)
import time
time.sleep(60)
"""


@pytest.mark.crash
@pytest.mark.parametrize("flavour", ["var", "fixed"])
def test_q12_killed_consumer_jobs_redelivered_acked_never_return(db_path, flavour):
    import numpy as np

    spec = VarJobs if flavour == "var" else armdb.queue("jobs", payload=np.dtype([("n", "<u8")]))
    code = CONSUMER if flavour == "var" else CONSUMER.replace(
        'armdb.queue("jobs", payload=dict, var=True)', 'armdb.queue("jobs", payload=__import__("numpy").dtype([("n", "<u8")]))'
    ).replace('lz.payload["n"] % 2', 'int(lz.payload["n"]) % 2').replace('lz.payload["n"], flush', 'int(lz.payload["n"]), flush')
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(spec, QueueConfig.balanced().build())
        for n in range(20):
            q.push({"n": n} if flavour == "var" else (n,))
    p = spawn_child(code.format(path=str(db_path)))
    acked, held = set(), set()
    for line in p.stdout:  # type: ignore[union-attr]
        parts = line.split()
        if parts[0] == "acked":
            acked.add(int(parts[1]))
        elif parts[0] == "holding":
            held.add(int(parts[1]))
        elif parts[0] == "ready":
            break
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    assert len(acked) == 10 and len(held) == 10
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(spec, QueueConfig.balanced().build())
        assert q.len() == 10
        assert q.lease(100) == []  # still leased by the dead consumer
        deadline = time.monotonic() + 10
        redelivered = []
        while time.monotonic() < deadline and len(redelivered) < 10:
            redelivered += q.lease(100)
            time.sleep(0.05)
        got = {int(lz.payload["n"]) for lz in redelivered}
        assert got == held and all(lz.attempt == 2 for lz in redelivered)
        for lz in redelivered:
            q.ack(lz.token)
        assert q.len() == 0 and q.lease(100) == []  # acked jobs never come back
    assert armdb.check(db_path).ok


@pytest.mark.parametrize("flavour", ["fixed", "var"])
def test_s4_slot_torn_mid_update_is_restored_from_redo(db_path, flavour):
    """A kill between composing a slot image and finishing its in-place copy leaves
    a torn slot; the redo record restores it, so the row is not lost (S4, I1)."""
    import numpy as np

    from armdb.fixed import HEADER_PAGE

    spec = VarJobs if flavour == "var" else armdb.queue("jobs", payload=np.dtype([("n", "<u8")]))
    cfg = QueueConfig.balanced().lease_timeout(600).build()
    data = db_path / "collections" / "jobs" / "shard-000" / "fixed.data"
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(spec, cfg)
        jid = q.push({"n": 1} if flavour == "var" else (1,))
        slot_size = q._shards[0].fixed.slot_size
    before = data.read_bytes()
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(spec, cfg)
        (lz,) = q.lease()
        slot = q._shards[0].live.get(lz.token.due, lz.token.seq)[0]
    after = bytearray(data.read_bytes())
    off = HEADER_PAGE + slot * slot_size
    after[off : off + 8] = before[off : off + 8]  # the new body landed, the new meta and CRC did not
    data.write_bytes(bytes(after))
    with armdb.Db.open(db_path) as db:
        q = db.open_queue(spec, cfg)
        st = q.stats()
        assert q.len() == 1 and st.leased == 1 and st.repaired_on_open == 1
        snap = q.snapshot()
        assert int(snap["id"][0]) == jid and int(snap["attempts"][0]) == 1
    assert armdb.check(db_path).ok
