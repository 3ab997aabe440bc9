"""The var queue's single-job cycle (push, lease(1), ack) killed mid-write (Q12, Q14, Q15,
T2): its push, lease and ack run their own lean paths (armdb.queue.Queue.push/lease,
armdb.tx.commit_settle), so they get their own SIGKILL and failpoint rounds.  After each
kill the Db is reopened: nothing acked returns, nothing pushed and not acked is lost (its
exact payload leasable), no header lacks its body, and ``armdb.check`` finds nothing."""

from __future__ import annotations

import hashlib
import os
import random
import time

import pytest

import armdb

from .conftest import child_env, kill_and_read, run_child, spawn_child

VarJobs = armdb.queue("jobs", payload=dict, var=True)

# Prints "P id n" once push returned, "L id" before an ack and "A id" once it returned.
# Every third job is left leased (not acked): the reopen must keep it too.
# How the children open the Db and the queue: as a user does (the defaults), the bench's
# tuned row (no fsync, long leases, a body cache: armdb._bench.open_armdb), and durable
# commits (the ack's log record synced before it is applied).  The lone ack commits in
# VarFast.ack (its _commit_ack) in each.
OPENERS = {
    "defaults": "db = armdb.Db.open({path!r})\nq = db.open_queue(armdb.queue('jobs', payload=dict, var=True))",
    "tuned": "from armdb import _bench\ndb, q = _bench.open_armdb({path!r}, armdb.queue('jobs', payload=dict, var=True), "
             "tuned=True)",
    "durable": "db = armdb.Db.open({path!r}, tx_config=armdb.TxConfig(durable=True))\n"
               "q = db.open_queue(armdb.queue('jobs', payload=dict, var=True))",
}

CYCLER = """
import armdb, hashlib
{opener}
n = {base}
while True:
    jid = q.push({{"n": n, "digest": hashlib.sha1(str(n).encode()).hexdigest(), "pad": "y" * (n % 200)}})
    print("P", jid, n, flush=True)
    for lz in q.lease(1):
        if lz.payload["n"] % 3:
            print("L", lz.id, flush=True)
            q.ack(lz.token)
            print("A", lz.id, flush=True)
    n += 1
"""


def _read(out: str, pushed: dict[int, int], acked: set[int], acking: set[int]) -> None:
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "P":
            pushed[int(parts[1])] = int(parts[2])
        elif len(parts) == 2 and parts[0] == "L":
            acking.add(int(parts[1]))
        elif len(parts) == 2 and parts[0] == "A":
            acked.add(int(parts[1]))


def _check_reopened(path: str, pushed: dict[int, int], acked: set[int], maybe: set[int]) -> None:
    """Every id pushed and not acked is there with its exact payload; no acked id is;
    ``maybe``: ids whose ack was cut short (either outcome, but whole).  ``check`` runs
    after the reopen only: a kill during an id reservation's atomic write leaves a
    ``seqmap.tmp`` that ``Db.open`` removes and ``check`` rightly reports until then."""
    with armdb.Db.open(path) as db:
        q = db.open_queue(VarJobs)
        assert len(q._payload) == q.len()  # one body per header after the orphan pass
        got: dict[int, int] = {}
        for job in q.peek(1_000_000):  # ready and leased rows alike
            n = job.payload["n"]
            assert job.payload["digest"] == hashlib.sha1(str(n).encode()).hexdigest()
            got[job.id] = n
        for jid, n in pushed.items():
            if jid in acked:
                assert jid not in got, f"acked row {jid} came back"
            elif jid not in maybe:
                assert got.get(jid) == n, (jid, n)
    assert armdb.check(path).ok


@pytest.mark.crash
@pytest.mark.parametrize("opener", sorted(OPENERS))
def test_q14_var_cycle_sigkill_acked_never_return_pushed_never_lost(tmp_path, opener):
    # SPEC Q12, Q14, Q15
    path = str(tmp_path / "db")
    rng = random.Random(17)
    pushed: dict[int, int] = {}
    acked: set[int] = set()
    acking: set[int] = set()
    rounds = int(os.environ.get("ARMDB_KILLS_QUEUE", "6"))
    for r in range(rounds):
        p = spawn_child(CYCLER.format(opener=OPENERS[opener].format(path=path), base=r * 1_000_000))
        _read(p.stdout.readline(), pushed, acked, acking)  # type: ignore[union-attr]  # open and cycling
        time.sleep(rng.uniform(0.0, 0.3))
        out, _ = kill_and_read(p)
        _read(out, pushed, acked, acking)
        _check_reopened(path, pushed, acked, acking - acked)
    assert len(acked) > 50 and len(pushed) > len(acked)


ONE_CYCLE = """
import armdb
{opener}
a = q.push({{"n": 1}})
b = q.push({{"n": 2}})
(lz,) = q.lease(1)
print(lz.id, flush=True)
q.ack(lz.token)
print("acked", flush=True)
"""


@pytest.mark.crash
@pytest.mark.parametrize("opener", sorted(OPENERS))
@pytest.mark.parametrize("point", ["txlog.after_append", "bitcask.after_append:2", "txlog.after_apply"])
def test_t2_var_ack_killed_after_its_log_record_is_replayed_whole(tmp_path, point, opener):
    # SPEC T2, Q14: the ack's record is in the log (the process died, the page cache kept
    # it), so the reopen applies all of it: the header and the body both go, the other
    # row stays.  bitcask.after_append:2 passes the two pushes' body writes and stops in
    # the ack's tombstone, after the header was freed.
    path = str(tmp_path / "db")
    r = run_child(ONE_CYCLE.format(opener=OPENERS[opener].format(path=path)), env=child_env(ARMDB_FAILPOINT=point))
    assert r.returncode == 86, r.stderr
    assert "acked" not in r.stdout
    leased = int(r.stdout.split()[0])
    assert armdb.check(path).ok
    with armdb.Db.open(path) as db:
        q = db.open_queue(VarJobs)
        assert q.len() == 1 and len(q._payload) == 1
        (lz,) = q.lease(5)
        assert lz.id != leased and lz.payload == {"n": 2}
        q.ack(lz)
        assert q.len() == 0 and len(q._payload) == 0
    assert armdb.check(path).ok


TWO_PUSHES = """
import armdb
db = armdb.Db.open({path!r})
q = db.open_queue(armdb.queue("jobs", payload=dict, var=True))
a = q.push({{"n": 1}})
print("pushed", a, flush=True)
b = q.push({{"n": 2}})
print("pushed", b, flush=True)
"""


@pytest.mark.crash
@pytest.mark.parametrize("point", ["bitcask.after_append:1", "queue.var_push.after_body:1"])
def test_q15_var_push_killed_between_its_body_and_its_header_leaves_no_row(tmp_path, point):
    # SPEC Q15: the compiled Bitcask put (PutKernel) writes the second push's body, then the
    # process dies before its header: after the reopen the first row is there whole, the
    # second is not, and its orphan body is gone (one body per header).
    path = str(tmp_path / "db")
    r = run_child(TWO_PUSHES.format(path=path), env=child_env(ARMDB_FAILPOINT=point))
    assert r.returncode == 86, r.stderr
    assert r.stdout.split() == ["pushed", r.stdout.split()[1]]  # only the first push returned
    first = int(r.stdout.split()[1])
    with armdb.Db.open(path) as db:
        q = db.open_queue(VarJobs)
        assert q.len() == 1 and len(q._payload) == 1
        (lz,) = q.lease(5)
        assert lz.id == first and lz.payload == {"n": 1}
        q.ack(lz)
    assert armdb.check(path).ok
