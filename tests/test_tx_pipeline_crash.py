"""SIGKILL while threads commit durably and operate directly on the same shards (SPEC T2,
T3, T5, Q12, Q13, Q14, Q32; docs/transactions.md, the commit protocol and replay).

A child runs four threads of durable commits (a map put and a queue push that name the
same key, into a fixed and a var queue), a thread of direct pushes, direct puts into the
same map shards, leases and acks (direct, or in a durable commit with a marker put), and
a thread of batch leases and acks, all on two shards per collection.  Each call that
returns prints a journal line.  The parent kills the child at a seeded random moment,
reopens and checks: every journaled call is there (a commit with both rows), every
commit is all or nothing, no job or id twice, and the directory checks clean.  The
rounds run on one database, so a round's replay meets the next round's commits.

A protocol that applied a shard's commits out of log order, or let a direct write take a
gsn or slot version ahead of a logged but unapplied commit, loses that commit at the
replay after a kill (a Bitcask row is replayed only above its shard's highest gsn, a slot
only at a newer version): the first check below catches it.

Sizes: ``ARMDB_KILLS_TXPIPE`` kills (default 10); the slow form runs 40.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import Config, FixedConfig, QueueConfig
from armdb.maps import Map

from .conftest import spawn_child

JOB = np.dtype([("k", "<u8")])
LEASE_TIMEOUT = 4.0  # a lease cut by a kill comes back a few rounds later
COMMITTERS = 4
DIRECT_BASE = 1 << 40  # keys of direct pushes; committers' keys stay below
STALL = 30.0  # seconds without a journal line: the child is stuck
MARK = "ack"  # map keys of the tx acks' markers: ("ack", queue, id) as a string

CHILD = """
import faulthandler, os, random, signal, sys, threading
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's stack dump of a stuck child
import numpy as np
import armdb
from armdb import Config, FixedConfig, QueueConfig, TxConfig

# Small checkpoints: kills land in log rotations and store syncs too.
db = armdb.Db.open({path!r}, tx_config=TxConfig(checkpoint_bytes=8192))
def qcfg():
    header = FixedConfig.balanced().shard_count(2).grow_step(64).enable_fsync(False).build()
    body = Config.balanced().shard_count(1).enable_fsync(False).build()
    return (QueueConfig.balanced().header_config(header).payload_config(body)
            .lease_timeout({lease_timeout}).max_attempts(60000).build())
m = db.open_map("docs", Config.balanced().shard_count(2).enable_fsync(False).build())
qs = {{"f": db.open_queue(armdb.queue("pipe_f", payload=np.dtype([("k", "<u8")])), qcfg()),
      "v": db.open_queue(armdb.queue("pipe_v", payload=int, var=True), qcfg())}}

def out(line):
    os.write(1, (line + "\\n").encode())  # one write of a short line: whole, in order

def payload(qn, key):
    return (key,) if qn == "f" else key

def key_of(lz):
    return int(lz.payload["k"]) if isinstance(lz.payload, np.void) else int(lz.payload)

def committer(t):
    i = 0
    while True:
        key = {base} + t * 1_000_000 + i
        qn = "fv"[(i + t) % 2]
        (jid,) = db.tx().put(m, key, key).push(qs[qn], payload(qn, key)).durable().commit()
        out(f"C {{key}} {{qn}} {{jid}}")
        i += 1

def settle(qn, lz, rng):
    # The way a job is acked is fixed by its id, so a job leased again after a kill is
    # acked the same way: even ids directly, odd ids by a commit with a marker.
    q = qs[qn]
    k = key_of(lz)
    out(f"L {{qn}} {{lz.id}} {{k}}")
    if lz.id % 2 == 0:
        q.ack(lz)
        out(f"A {{qn}} {{lz.id}}")
    else:
        db.tx().ack(q, lz).put(m, f"{mark}-{{qn}}-{{lz.id}}", k).durable().commit()
        out(f"X {{qn}} {{lz.id}}")

def direct():
    rng = random.Random({seed})
    i = 0
    while True:
        key = {direct_base} + {base} + i
        qn = "fv"[rng.randrange(2)]
        jid = qs[qn].push(payload(qn, key))
        out(f"P {{key}} {{qn}} {{jid}}")
        m.put(-key, key)  # a direct write into the shards the commits write
        out(f"D {{-key}}")
        for qn2 in rng.sample("fv", 2):
            for lz in qs[qn2].lease(rng.randint(1, 3)):
                settle(qn2, lz, rng)
        i += 1

def batches():
    rng = random.Random({seed} + 1)
    while True:
        for qn in "fv":
            q = qs[qn]
            batch = q.lease_batch(rng.randint(1, 6))
            direct_acks = []
            for lz in batch:
                if lz.id % 2 == 0:
                    out(f"L {{qn}} {{lz.id}} {{key_of(lz)}}")
                    direct_acks.append(lz)
                else:
                    settle(qn, lz, rng)
            if direct_acks:
                q.ack_many(direct_acks)
                for lz in direct_acks:
                    out(f"A {{qn}} {{lz.id}}")

for t in range({committers}):
    threading.Thread(target=committer, args=(t,), daemon=True).start()
threading.Thread(target=direct, daemon=True).start()
threading.Thread(target=batches, daemon=True).start()
threading.Event().wait()
"""


def _open(d: armdb.Db) -> tuple[Map, dict[str, armdb.Queue[Any]]]:
    header = FixedConfig.balanced().shard_count(2).grow_step(64).enable_fsync(False).build()
    body = Config.balanced().shard_count(1).enable_fsync(False).build()
    cfg = (QueueConfig.balanced().header_config(header).payload_config(body).lease_timeout(LEASE_TIMEOUT)
           .max_attempts(60000).build())
    m = d.open_map("docs", Config.balanced().shard_count(2).enable_fsync(False).build())
    qs: dict[str, armdb.Queue[Any]] = {"f": d.open_queue(armdb.queue("pipe_f", payload=JOB), cfg),
          "v": d.open_queue(armdb.queue("pipe_v", payload=int, var=True), cfg)}
    return m, qs


def _key_of(payload: Any) -> int:
    return int(payload) if isinstance(payload, int) else int(payload["k"])


class Journal:
    """Every call the children's journals say returned, over all rounds."""

    def __init__(self) -> None:
        self.commits: dict[int, tuple[str, int]] = {}  # key -> (queue, id)
        self.pushes: dict[int, tuple[str, int]] = {}  # direct pushes: key -> (queue, id)
        self.puts: set[int] = set()  # direct puts (negative keys)
        self.leased: dict[tuple[str, int], int] = {}  # (queue, id) -> key
        self.acked: set[tuple[str, int]] = set()  # direct acks and ack_many
        self.tx_acked: set[tuple[str, int]] = set()  # acks committed with a marker

    def read(self, text: str) -> None:
        for line in text.splitlines():
            f = line.split()
            if not f:
                continue
            if f[0] == "C":
                self.commits[int(f[1])] = (f[2], int(f[3]))
            elif f[0] == "P":
                self.pushes[int(f[1])] = (f[2], int(f[3]))
            elif f[0] == "D":
                self.puts.add(int(f[1]))
            elif f[0] == "L":
                self.leased[(f[1], int(f[2]))] = int(f[3])
            elif f[0] == "A":
                self.acked.add((f[1], int(f[2])))
            elif f[0] == "X":
                self.tx_acked.add((f[1], int(f[2])))
            else:
                raise AssertionError(f"a journal line no child writes: {line!r}")


def _check(path: Path, j: Journal, r: int) -> None:
    with armdb.Db.open(path) as d:
        m, qs = _open(d)
        stored = dict(m.items())
        live: dict[tuple[str, int], int] = {}  # (queue, id) -> key
        for qn, q in qs.items():
            assert q.dead_len() == 0, f"round {r}: {qn} has dead rows; nothing dead-letters here"
            for job in (q.peek(1_000_000) if q.len() else []):
                assert (qn, job.id) not in live, f"round {r}: {qn} id {job.id} twice"
                live[(qn, job.id)] = _key_of(job.payload)
    where = f"round {r}"
    keys = list(live.values())
    assert len(keys) == len(set(keys)), f"{where}: a job is in the queues twice"
    live_keys = set(keys)
    gone = j.acked | j.tx_acked

    # T5: an id is handed out once, across crashes: a live row under a journaled id is
    # the job that id was returned for.
    journaled = {(qn, jid): key for key, (qn, jid) in (j.commits | j.pushes).items()}
    assert len(journaled) == len(j.commits) + len(j.pushes), f"{where}: one id returned for two pushes"
    for qid, key in live.items():
        assert journaled.get(qid, key) == key, f"{where}: {qid} holds {key}, its push returned it for {journaled[qid]}"
    for qid, key in j.leased.items():
        assert journaled.get(qid, key) == key, f"{where}: {qid} was leased as {key}, pushed as {journaled[qid]}"

    # T2/T3: every durable commit that returned is there whole: its put, and its job live
    # or leased (a lease returned it, so the job was there).
    for key, (qn, jid) in j.commits.items():
        assert stored.get(key) == key, f"{where}: commit {key} returned but its put is lost"
        assert (qn, jid) in live or (qn, jid) in j.leased, f"{where}: commit {key} returned but job {qn}/{jid} is lost"
    for key, (qn, jid) in j.pushes.items():
        assert (qn, jid) in live or (qn, jid) in j.leased, f"{where}: direct push {key} ({qn}/{jid}) is lost"
    for key in j.puts:
        assert stored.get(key) == -key, f"{where}: direct put {key} is lost"
    # Q14: an ack that returned holds.
    for qid in gone:
        assert qid not in live, f"{where}: {qid} was acked but is back"

    # T2: all or nothing, for every commit, journaled or cut by the kill.  A commit's key
    # is stored exactly when its job is live or was leased.
    leased_keys = set(j.leased.values())
    for key, value in stored.items():
        if isinstance(key, int) and 0 <= key < DIRECT_BASE:
            assert value == key
            assert key in live_keys or key in leased_keys, f"{where}: commit {key} has its put but not its job"
    for qid, key in list(live.items()) + list(j.leased.items()):
        if key < DIRECT_BASE:
            assert key in stored, f"{where}: job {qid} of commit {key} was there without its put"
    # A tx ack (odd ids) is all or nothing too: its marker exists exactly when its job is gone.
    for (qn, jid), key in j.leased.items():
        marker = f"{MARK}-{qn}-{jid}"
        if jid % 2:
            assert (marker in stored) == ((qn, jid) not in live), (
                f"{where}: tx ack of {qn}/{jid} is half applied: marker {marker in stored}, job gone "
                f"{(qn, jid) not in live}"
            )
            if marker in stored:
                assert stored[marker] == key
        else:
            assert marker not in stored
    for qid in j.tx_acked:
        assert f"{MARK}-{qid[0]}-{qid[1]}" in stored, f"{where}: tx ack {qid} returned but its marker is lost"
    # A marker's commit began after its lease was journaled, and it removed the job.
    for mk in (k for k in stored if isinstance(k, str)):
        _, qn, jid = mk.split("-")
        qid = (qn, int(jid))
        assert qid in j.leased and qid not in live, f"{where}: marker {mk} of a job never leased or still live"
    rep = armdb.check(path)
    assert rep.ok, f"{where}: {rep.findings}"


class Child:
    """A child whose stdout a thread reads line by line, so that the parent can wait for
    the journal with a timeout: a child that stops journaling (a deadlock) fails the
    test with every thread's stack instead of hanging it."""

    def __init__(self, code: str) -> None:
        self.p = spawn_child(code)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.eof = False
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait_lines(self, want: int, stall: float) -> bool:
        """Wait until ``want`` lines came; False when none came for ``stall`` seconds or
        the child ended."""
        with self.cond:
            while len(self.lines) < want and not self.eof:
                seen = len(self.lines)
                self.cond.wait(stall)
                if len(self.lines) == seen and not self.eof:
                    return False
            return len(self.lines) >= want

    def kill(self, stacks: bool = False) -> tuple[str, str]:
        """SIGKILL it (after dumping every thread's stack to stderr when ``stacks``);
        returns all of its stdout and stderr."""
        if stacks:
            os.kill(self.p.pid, signal.SIGUSR1)  # faulthandler in the child
            time.sleep(1.0)
        os.kill(self.p.pid, signal.SIGKILL)
        self.pump.join(30)  # the child is dead: its stdout reaches EOF
        assert not self.pump.is_alive()
        assert self.p.stdout is not None and self.p.stderr is not None
        self.p.stdout.close()
        with self.p.stderr:
            err = self.p.stderr.read()
        self.p.wait()
        return "".join(self.lines), err


def _run(db_path: Path, rounds: int, seed: int) -> Journal:
    rng = random.Random(seed)
    j = Journal()
    for r in range(rounds):
        code = CHILD.format(path=str(db_path), base=r * 10_000_000, seed=seed * 1000 + r, committers=COMMITTERS,
                            direct_base=DIRECT_BASE, mark=MARK, lease_timeout=LEASE_TIMEOUT)
        child = Child(code)
        try:
            want = rng.randint(40, 600)  # journal lines before the kill
            if not child.wait_lines(want, STALL):
                out, err = child.kill(stacks=True)
                raise AssertionError(
                    f"round {r}: the child stopped journaling after {len(out.splitlines())} of {want} lines "
                    f"(no line for {STALL:.0f} s: a deadlock, or a thread died); its threads and stderr:\n{err[-20000:]}"
                )
            time.sleep(rng.uniform(0, 0.03))
            out, err = child.kill()
        finally:
            if child.p.poll() is None:  # the test itself was interrupted: no child outlives it
                child.p.kill()
        assert "Traceback" not in err, f"round {r}: a child thread failed:\n{err}"
        j.read(out)
        _check(db_path, j, r)
    kinds = {"C": len(j.commits), "P": len(j.pushes), "L": len(j.leased), "A": len(j.acked), "X": len(j.tx_acked)}
    assert all(kinds.values()), f"a kind of call never returned before a kill: {kinds}"
    return j


# SPEC T2, T3, T5, Q14: SIGKILL at seeded moments while durable commits, direct writes
# and acks share shards: nothing journaled is lost, nothing is half applied.
@pytest.mark.crash
def test_t3_sigkill_amid_durable_commits_and_direct_ops_keeps_every_commit_whole(db_path: Path) -> None:
    _run(db_path, int(os.environ.get("ARMDB_KILLS_TXPIPE", "10")), seed=1)


# The same, 40 kills.
@pytest.mark.slow
@pytest.mark.crash
def test_t3_sigkill_amid_durable_commits_and_direct_ops_keeps_every_commit_whole_40_kills(db_path: Path) -> None:
    _run(db_path, 40, seed=2)
