"""Faults and many processes on PostgreSQL (SPEC G3, G7).

* a worker killed with SIGKILL while it holds leases: its rows come back after their
  lease timeout (G7, Q12);
* the server stopped with ``pg_ctl -m immediate`` (a crash) under load and started
  again: calls in flight raise ``StorageError`` and nothing else, the pool reconnects,
  every push that returned is there and no acked job comes back (G7).  Rounds from fixed
  seeds: ``ARMDB_PG_RESTARTS`` (2 by default, 20 in the slow run);
* a client killed mid-commit leaves every transaction whole or absent (``ARMDB_PG_CLIENT_KILLS``);
* many processes, each with its own pool, lease and settle one queue: no (row, epoch)
  handed to two callers, no job lost, no job acked twice, no stale settle accepted, and
  every process got work (G3): ``ARMDB_PG_PROCS`` x ``ARMDB_PG_SECONDS`` (3 x 3 s by
  default, 8 x 30 s in the slow run).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

import armdb
import armdb.pg
from armdb import QueueConfig
from armdb.errors import StorageError
from tests import pgserver
from tests.conftest import child_env, kill_and_read, spawn_child

pytestmark = [pytest.mark.crash]

Work = armdb.queue("fault_work", payload=int, var=True)


def _live_and_dead_ids(dsn: str, ns: str) -> tuple[set[int], set[int]]:
    with psycopg.connect(dsn) as c:
        names = [r[0] for r in c.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "AND c.relkind = 'r' AND (c.relname LIKE 'q%%' OR c.relname LIKE 'd%%')", (ns,)).fetchall()]
        out: dict[str, set[int]] = {"q": set(), "d": set()}
        for n in names:
            out[n[0]] |= {r[0] for r in c.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(ns, n)))}
    return out["q"], out["d"]


def test_killed_worker_leases_come_back_after_the_timeout(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G7 Q12: kill -9 a worker holding leases; its rows are redelivered after the timeout
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        q = db.open_queue(Work, QueueConfig.balanced().lease_timeout(1.0).build())
        q.push_many(list(range(10)))
        child = spawn_child(f"""
            import armdb, armdb.pg, time
            from armdb import QueueConfig
            db = armdb.pg.connect({pg_dsn!r}, namespace={pg_namespace!r})
            q = db.open_queue(armdb.queue("fault_work", payload=int, var=True),
                              QueueConfig.balanced().lease_timeout(1.0).build())
            print(" ".join(str(lz.id) for lz in q.lease(5)), flush=True)
            time.sleep(60)
        """)
        assert child.stdout is not None
        held = {int(x) for x in child.stdout.readline().split()}
        killed_at = time.monotonic()
        kill_and_read(child)
        assert len(held) == 5
        mine = q.lease(10)
        assert held.isdisjoint(lz.id for lz in mine) and len(mine) == 5  # still leased by the dead worker
        for lz in mine:
            q.ack(lz)
        time.sleep(max(0.0, 1.1 - (time.monotonic() - killed_at)))
        back = q.lease(10)
        assert {lz.id for lz in back} == held and all(lz.attempt == 2 for lz in back)


def _restart_round(srv: Any, dsn: str, ns: str, seed: int, ack_in_lease: bool = False) -> dict[str, int]:
    """One crash of the server under a producer and a consumer (see the module docstring).
    ``ack_in_lease``: the consumer acks each batch in its next lease,
    ``lease_batch(8, ack=previous)``: one commit for the acks and the lease."""
    rng = random.Random(seed)
    pushed: set[int] = set()
    acked: set[int] = set()
    unsure: set[int] = set()  # acks that raised StorageError: committed or not (G7)
    errors: list[BaseException] = []
    failures = {"push": 0, "consume": 0}
    after_restart = {"push": 0}
    restarted = threading.Event()
    stop = threading.Event()
    with armdb.pg.connect(dsn, namespace=ns, pool_size=3) as db:
        q = db.open_queue(Work, QueueConfig.balanced().lease_timeout(30).build())

        def produce() -> None:
            i = 0
            while not stop.is_set():
                try:
                    pushed.add(q.push(i))
                    if restarted.is_set():
                        after_restart["push"] += 1
                except StorageError:
                    failures["push"] += 1
                    time.sleep(0.02)
                except BaseException as e:  # noqa: BLE001 - any other error type is a failure of the test
                    errors.append(e)
                    return
                i += 1

        def consume_with_ack_in_lease() -> None:
            previous = None
            while not stop.is_set():
                try:
                    got = q.lease_batch(8, ack=previous)
                except StorageError:
                    failures["consume"] += 1
                    previous = None  # its acks may or may not have committed: they stay unsure
                    time.sleep(0.02)
                    continue
                except BaseException as e:  # noqa: BLE001 - any other error type is a failure of the test
                    errors.append(e)
                    return
                if previous is not None:
                    done = previous.ids.tolist()
                    unsure.difference_update(done)
                    acked.update(done)
                unsure.update(got.ids.tolist())
                previous = got

        def consume() -> None:
            while not stop.is_set():
                try:
                    for lz in q.lease(8):
                        unsure.add(lz.id)
                        q.ack(lz)
                        unsure.discard(lz.id)
                        acked.add(lz.id)
                except StorageError:
                    failures["consume"] += 1
                    time.sleep(0.02)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
                    return

        threads = [threading.Thread(target=produce),
                   threading.Thread(target=consume_with_ack_in_lease if ack_in_lease else consume)]
        for t in threads:
            t.start()
        try:
            time.sleep(rng.uniform(0.2, 0.5))
            srv.stop("immediate")
            time.sleep(rng.uniform(0.05, 0.3))
            srv.start()
            pgserver.wait_ready(dsn)
            restarted.set()
            end = time.monotonic() + 10
            while after_restart["push"] < 20 and time.monotonic() < end:  # the pool reconnects
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors, f"calls raised something other than StorageError: {errors!r}"
        assert after_restart["push"] >= 20, "the pool did not reconnect after the restart"
        live, dead = _live_and_dead_ids(dsn, ns)
        lost = pushed - live - dead - acked - unsure
        assert not lost, f"pushes that returned are missing after the crash: {sorted(lost)[:10]}"
        returned = acked & live
        assert not returned, f"acked jobs came back after the crash: {sorted(returned)[:10]}"
        q.purge_dead()
        for lz in q.lease(100_000):
            q.ack(lz)
    return {"pushed": len(pushed), "acked": len(acked), **failures}


def test_server_crash_under_load_loses_no_commit(pg_server: Any, pg_namespace: str) -> None:
    # SPEC G7: pg_ctl -m immediate under load, then start: StorageError in flight, pool reconnects,
    # nothing committed is lost, no acked job returns
    rounds = int(os.environ.get("ARMDB_PG_RESTARTS", "2"))
    seen_failure = 0
    for seed in range(rounds):
        got = _restart_round(pg_server, pg_server.dsn, pg_namespace, seed)
        assert got["pushed"] > 0 and got["acked"] > 0
        seen_failure += got["push"] + got["consume"]
    assert seen_failure > 0, "no call failed while the server was down: the crash was not under load"


def test_server_crash_with_acks_in_the_lease_commit(pg_server: Any, pg_namespace: str) -> None:
    # SPEC G7 Q32: the same crash under a consumer whose acks ride in its next lease's commit
    # (lease_batch(ack=)): no acked job returns, no push that returned is lost
    rounds = int(os.environ.get("ARMDB_PG_RESTARTS", "2"))
    seen_failure = 0
    for seed in range(rounds):
        got = _restart_round(pg_server, pg_server.dsn, pg_namespace, 500 + seed, ack_in_lease=True)
        assert got["pushed"] > 0 and got["acked"] > 0
        seen_failure += got["push"] + got["consume"]
    assert seen_failure > 0, "no call failed while the server was down: the crash was not under load"


@pytest.mark.slow
def test_server_crash_under_load_many_rounds(pg_server: Any, pg_namespace: str) -> None:
    # SPEC G7: 20 rounds from fixed seeds
    for seed in range(int(os.environ.get("ARMDB_PG_RESTARTS_SLOW", "20"))):
        _restart_round(pg_server, pg_server.dsn, pg_namespace, 1000 + seed, ack_in_lease=seed % 2 == 1)


_WORKER = """
import json, os, sys, time, armdb, armdb.pg
from armdb import QueueConfig
from armdb.errors import StaleToken
seconds, seed = float(sys.argv[1]), int(sys.argv[2])
db = armdb.pg.connect({dsn!r}, namespace={ns!r}, pool_size=2)
q = db.open_queue(armdb.queue("fault_work", payload=int, var=True), QueueConfig.balanced().lease_timeout(5).build())
leases, acked, stale_accepted, stale_refused, settled_late = [], [], 0, 0, 0
end = time.monotonic() + seconds
i = 0
while time.monotonic() < end:
    i += 1
    short = i % 7 == 0
    got = q.lease(4, lease_timeout=0.05 if short else None)
    if not got:
        q.wait_due_timeout(0.05)
        continue
    for lz in got:
        leases.append([lz.id, lz.token.epoch])
    if short:
        time.sleep(0.08)  # the leases expire: another process may take the rows first
    for lz in got:
        try:
            q.ack(lz)
            acked.append(lz.id)
            if short:
                settled_late += 1
        except StaleToken:
            stale_refused += 1
            continue
        try:
            q.ack(lz)  # a second ack of the same lease must be refused
            stale_accepted += 1
        except StaleToken:
            pass
print(json.dumps(dict(leases=leases, acked=acked, stale_accepted=stale_accepted, stale_refused=stale_refused)))
db.close()
"""


def _many_processes(dsn: str, ns: str, procs: int, seconds: float) -> None:
    import subprocess
    import sys

    with armdb.pg.connect(dsn, namespace=ns) as db:
        q = db.open_queue(Work)
        pushed = set(q.push_many(list(range(500))))
        code = _WORKER.format(dsn=dsn, ns=ns)
        env = child_env()
        children = [subprocess.Popen([sys.executable, "-c", code, str(seconds), str(i)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for i in range(procs)]
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # keep the queue fed while they work
            pushed |= set(q.push_many(list(range(50))))
            time.sleep(0.05)
        results = []
        for ch in children:
            out, err = ch.communicate(timeout=seconds + 60)
            assert ch.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        pairs = [tuple(p) for r in results for p in r["leases"]]
        assert len(pairs) == len(set(pairs)), "a (row, epoch) lease was handed to two callers"
        acked = [a for r in results for a in r["acked"]]
        assert len(acked) == len(set(acked)), "a job was acked twice"
        assert sum(r["stale_accepted"] for r in results) == 0, "a stale settle was accepted"
        assert all(r["acked"] for r in results), "a process got no work"
        live, dead = _live_and_dead_ids(dsn, ns)
        assert not dead
        lost = pushed - set(acked) - live
        assert not lost, f"jobs lost: {sorted(lost)[:10]}"
        assert not (set(acked) & live), "an acked job is still in the queue"


def test_many_processes_share_one_queue(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G3: bounded CI slice
    _many_processes(pg_dsn, pg_namespace, int(os.environ.get("ARMDB_PG_PROCS", "3")),
                    float(os.environ.get("ARMDB_PG_SECONDS", "3")))


@pytest.mark.slow
def test_many_processes_share_one_queue_full(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G3: 8 processes, 30 s
    _many_processes(pg_dsn, pg_namespace, 8, 30.0)



def test_waiters_listen_again_after_a_server_restart(pg_server: Any, pg_namespace: str) -> None:
    # SPEC G4 G7: the listening connection reconnects and LISTENs again; a later push wakes the waiter
    dsn = pg_server.dsn
    with armdb.pg.connect(dsn, namespace=pg_namespace) as db:
        q = db.open_queue(Work, QueueConfig.balanced().wakeup_recheck(60).build())
        assert q.wait_due_timeout(0.05) is False  # the listener runs
        result: dict[str, Any] = {}

        def wait() -> None:
            start = time.monotonic()
            try:
                result["due"] = q.wait_due_timeout(40)
            except StorageError as e:  # a recheck while the server was down
                result["error"] = e
            result["took"] = time.monotonic() - start

        pg_server.stop("fast")
        pg_server.start()
        pgserver.wait_ready(dsn)
        time.sleep(0.5)  # the listener reconnects (it retries every 0.2 s)
        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)
        with armdb.pg.connect(dsn, namespace=pg_namespace) as other:
            other.open_queue(Work).push(1)
        t.join(45)
        assert result.get("due") is True, result
        assert result["took"] < 30  # woken by the notification, not the 60 s recheck


_COMMITTER = """
import armdb, armdb.pg
db = armdb.pg.connect({dsn!r}, namespace={ns!r})
q = db.open_queue(armdb.queue("fault_work", payload=int, var=True))
m = db.open_map("fault_state")
i = 0
while True:
    i += 1
    ids = db.tx().push(q, i).push(q, -i).put(m, i, "done").commit()
    print(i, ids[0], ids[1], flush=True)
    if i % 3 == 0:
        q.push_many([1000000 + i] * 5)
"""


def test_killed_client_mid_commit_leaves_all_or_nothing(pg_dsn: str, pg_namespace: str) -> None:
    # SPEC G7 T2: a client killed with SIGKILL at any moment leaves every transaction whole or absent
    rounds = int(os.environ.get("ARMDB_PG_CLIENT_KILLS", "2"))
    rng = random.Random(7)
    reported: dict[int, tuple[int, int]] = {}
    for _ in range(rounds):
        child = spawn_child(_COMMITTER.format(dsn=pg_dsn, ns=pg_namespace))
        assert child.stdout is not None
        first = child.stdout.readline()  # connected and committing
        assert first, child.stderr.read() if child.stderr else ""
        time.sleep(rng.uniform(0.05, 0.4))
        out, _err = kill_and_read(child)
        for line in [first, *out.splitlines()]:
            parts = line.split()
            if len(parts) == 3:
                reported[int(parts[0]) + 10_000 * _] = (int(parts[1]), int(parts[2]))
    with armdb.pg.connect(pg_dsn, namespace=pg_namespace) as db:
        q = db.open_queue(Work)
        m = db.open_map("fault_state")
        payloads: dict[int, list[int]] = {}
        for lz in q.lease(1_000_000):
            payloads.setdefault(lz.payload, []).append(lz.id)
        done = {k for k, _v in m.items()}
        # every map write has both of its pushes, and every push its map write
        for i in done:
            assert len(payloads.get(i, [])) == len(payloads.get(-i, [])) and payloads.get(i), i
        for p in payloads:
            if 0 < abs(p) < 1_000_000:
                assert abs(p) in done, f"a push of transaction {abs(p)} without its map write"
        batches = [p for p in payloads if p >= 1_000_000]
        assert all(len(payloads[p]) % 5 == 0 for p in batches), "a push_many was cut"
        # every commit the child reported is there
        live_ids = {rid for ids in payloads.values() for rid in ids}
        for a, b in reported.values():
            assert a in live_ids and b in live_ids
