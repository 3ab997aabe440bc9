"""``Db.close()`` racing other threads (issue 14, item 1).

Eight threads hammer a fixed queue, a var queue and a map (push, lease, ack, nack,
stats, snapshot, len, map put/get/delete, a transaction) while the main thread
closes the Db at a random moment.  Every call that races the close must raise
``DbClosed`` (never a builtin, never a signal: compiled code used to write into a
mapping that close had unmapped), ``close()`` must return, and the database must
then pass ``armdb.check`` and reopen.

A round that crashes the interpreter would take pytest down with it, so the
child-process test runs first: there a segfault shows as a signal exit code.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb.config import FixedConfig, QueueConfig
from armdb.maps import Map
from tests.conftest import run_child
from tests.reliability.journal import report_line

THREADS = 8
FIXED = armdb.queue("race_fixed", payload=np.dtype([("a", "<u8"), ("b", "<u4")]))
VAR = armdb.queue("race_var", payload=dict, var=True)

# (header shards, header grow step): one shard (single-lock lease path) and three
# (scan, merge, claim); a small grow step makes pushes grow and remap the file.
VARIANTS = [(1, 64), (3, 64), (1, 4096), (2, 256)]
IN_PROCESS_ROUNDS = 48  # per variant: 4 x 48 = 192, and 8 more in child processes
CHILD_ROUNDS = 4
# Opening a fresh database per round costs dozens of fsyncs; on tmpfs they are free.
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


# Figures of this module's rounds, for its RELIABILITY line (the CI figures table):
# rounds (with those run in child processes), the worker calls that met DbClosed, and
# the violations: signals, untyped exceptions, close() raising, hung workers, check.
FIGURES = {"rounds": 0, "child_rounds": 0, "db_closed": 0, "signals": 0, "untyped_exceptions": 0,
           "close_errors": 0, "hangs": 0, "check_failures": 0}


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    f = FIGURES
    report_line(
        f"RELIABILITY close-race rounds={f['rounds'] + f['child_rounds']} child_rounds={f['child_rounds']} "
        f"threads={THREADS} db_closed={f['db_closed']} violations={f['close_errors']} "
        f"signals={f['signals']} untyped_exceptions={f['untyped_exceptions']} hangs={f['hangs']} "
        f"check_failures={f['check_failures']} seconds={time.monotonic() - t0:.0f}",
        request,
    )


def _queue_config(shards: int, grow: int) -> QueueConfig:
    return (
        QueueConfig.balanced()
        .lease_timeout(0.02)
        .backoff_secs([0])
        .max_attempts(3)
        .header_config(FixedConfig(shard_count=shards, grow_step=grow))
        .build()
    )


# (operation, queue): pushes, leases and acks of both queues, a nack, and stats,
# snapshots and map writes alongside.
FOCUS = [(0, 0), (3, 0), (5, 0), (0, 1), (3, 1), (6, 0), (7, 1), (10, 0)]


def _worker(db: armdb.Db, fq: armdb.Queue, vq: armdb.Queue, m: Map, seed: int,
            errors: list[BaseException], stop: threading.Event) -> None:
    rnd = random.Random(seed)
    tokens: list[tuple[armdb.Queue, object]] = []
    # Each thread mostly repeats one operation (tight loops on the hot paths are what
    # keep a thread waiting on a shard lock while close runs), with some of the rest.
    focus = FOCUS[seed % len(FOCUS)]
    try:
        while not stop.is_set():
            if rnd.random() < 0.9:
                op, q = focus[0], (fq, vq)[focus[1]]
            else:
                op, q = rnd.randrange(14), (fq, vq)[rnd.randrange(2)]
            if op <= 2:
                q.push((rnd.randrange(1 << 40), 7) if q is fq else {"n": rnd.randrange(1000)})
            elif op <= 4:
                tokens.extend((q, lz.token) for lz in q.lease(rnd.choice((1, 3, 20))))
            elif op == 5:
                if not tokens:
                    tokens.extend((q, lz.token) for lz in q.lease(10))
                    continue
                q2, tok = tokens.pop(rnd.randrange(len(tokens)))
                try:
                    q2.ack(tok)
                except armdb.StaleToken:
                    pass
            elif op == 6:
                if not tokens:
                    tokens.extend((q, lz.token) for lz in q.lease(10))
                    continue
                q2, tok = tokens.pop(rnd.randrange(len(tokens)))
                try:
                    q2.nack(tok, dead=rnd.random() < 0.2)
                except armdb.StaleToken:
                    pass
            elif op == 7:
                q.stats()
            elif op == 8:
                q.snapshot()
            elif op == 9:
                q.len()
                q.dead_len()
                q.next_delay()
            elif op == 10:
                m.put(rnd.randrange(64), "v" * rnd.randrange(100))
            elif op == 11:
                m.get(rnd.randrange(64))
                m.delete(rnd.randrange(64))
            elif op == 12:
                tx = db.tx()
                tx.push(vq, {"tx": 1})
                tx.push(fq, (1, 2))
                tx.put(m, rnd.randrange(64), "tx")
                tx.commit()
            else:
                db.stats()
    except armdb.DbClosed:
        FIGURES["db_closed"] += 1
        return
    except BaseException as e:  # anything else is the failure this test looks for
        errors.append(e)


class _SlowClock:
    """Wall-clock milliseconds, sometimes after a short sleep.

    Queue operations read the clock after their closed check and before they take a
    shard lock; a sleep there (the GIL released) leaves a thread inside that window
    while close runs, which is the race this file is about.
    """

    def __init__(self, seed: int) -> None:
        self._rnd = random.Random(seed)

    def __call__(self) -> int:
        if self._rnd.random() < 0.2:
            time.sleep(0.0005)
        return time.time_ns() // 1_000_000


def one_round(path: str, shards: int, grow: int, seed: int) -> None:
    """Race ``close`` against the workers once; raise AssertionError on a violation
    (counted in FIGURES first)."""
    FIGURES["rounds"] += 1
    rnd = random.Random(seed)
    db = armdb.Db.open(path, clock=_SlowClock(seed))
    cfg = _queue_config(shards, grow)
    fq = db.open_queue(FIXED, cfg)
    vq = db.open_queue(VAR, cfg)
    m = db.open_map("race_map")
    for i in range(20):
        fq.push((i, i))
        vq.push({"i": i})
    errors: list[BaseException] = []
    stop = threading.Event()
    threads = [threading.Thread(target=_worker, args=(db, fq, vq, m, seed * 100 + i, errors, stop))
               for i in range(THREADS)]
    for t in threads:
        t.start()
    time.sleep(rnd.random() * 0.03)
    try:
        db.close()  # must return, whatever the workers are doing
    except BaseException:
        FIGURES["close_errors"] += 1
        raise
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    FIGURES["hangs"] += sum(t.is_alive() for t in threads)
    FIGURES["untyped_exceptions"] += len(errors)
    assert not any(t.is_alive() for t in threads), "a worker hung after close"
    assert not errors, f"workers raised something other than DbClosed: {errors[:3]!r}"
    report = armdb.check(path)
    FIGURES["check_failures"] += not report.ok
    assert report.ok, str(report)
    with armdb.Db.open(path) as db2:  # reopens and serves every row
        for spec in (FIXED, VAR):
            q = db2.open_queue(spec, cfg)
            q.snapshot()
            for lz in q.lease(1000):
                q.ack(lz.token)
        len(db2.open_map("race_map"))
    report = armdb.check(path)
    FIGURES["check_failures"] += not report.ok
    assert report.ok, str(report)


def test_close_race_in_child_processes() -> None:
    """A few rounds in a child: a crash is a signal exit code, not a dead pytest."""
    base = tempfile.mkdtemp(prefix="armdb-close-race-", dir=SCRATCH)
    try:
        _child_rounds(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _child_rounds(base: str) -> None:
    for k, (shards, grow) in enumerate(VARIANTS[:2]):
        code = f"""
            import json, shutil, sys
            sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
            from tests.test_close_race import FIGURES, one_round
            try:
                for r in range({CHILD_ROUNDS}):
                    p = {base!r} + "/child-{k}-%d" % r
                    one_round(p, {shards}, {grow}, 90_000 + {k} * 100 + r)
                    shutil.rmtree(p)
            finally:
                print("FIGURES " + json.dumps(FIGURES), flush=True)
            print("ok")
        """
        res = run_child(code, timeout=120)
        for line in res.stdout.splitlines():
            if line.startswith("FIGURES "):
                child = json.loads(line[8:])
                for key in ("db_closed", "untyped_exceptions", "close_errors", "hangs", "check_failures"):
                    FIGURES[key] += child[key]
                FIGURES["child_rounds"] += child["rounds"]
        FIGURES["signals"] += res.returncode < 0
        assert res.returncode == 0, (
            f"child exited with {res.returncode} (negative: killed by signal {-res.returncode})\n"
            f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        )
        assert res.stdout.strip().endswith("ok")


@pytest.mark.parametrize("shards,grow", VARIANTS)
def test_close_race_in_process(shards: int, grow: int) -> None:
    base = tempfile.mkdtemp(prefix="armdb-close-race-", dir=SCRATCH)
    try:
        for r in range(IN_PROCESS_ROUNDS):
            p = f"{base}/r{r}"
            one_round(p, shards, grow, shards * 10_000 + grow + r)
            shutil.rmtree(p)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_commit_holding_its_locks_while_close_starts_still_applies(tmp_path: Path, monkeypatch) -> None:
    """A commit that passed its checks under its locks and logs its record just as close
    begins closing its store applies in full (close waits for the lock it holds); it
    is not refused half way, after its record is logged (that was a TxFailedAfterLog)."""
    from armdb.txlog import TxLog

    path = tmp_path / "db"
    db = armdb.Db.open(path)
    m = db.open_map("m")
    store = m.store
    append = TxLog.append

    def append_once_close_began(self, rows, packed=None, behind=False):  # in the committing thread, locks held
        limit = time.monotonic() + 5
        while not store._closed and time.monotonic() < limit:
            time.sleep(0.001)
        assert store._closed, "close did not begin"
        return append(self, rows, packed, behind)

    monkeypatch.setattr(TxLog, "append", append_once_close_began)
    result: list[object] = []

    def commit() -> None:
        try:
            result.append(db.tx().put(m, "k", "v").commit())
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=commit)
    t.start()
    while not store.lock_for(b"\x00").locked() and t.is_alive():  # the commit holds its shard lock
        time.sleep(0.001)
    db.close()
    t.join(10)
    assert result == [[]], result
    monkeypatch.setattr(TxLog, "append", append)
    with armdb.Db.open(path) as db2:
        assert db2.open_map("m").get("k") == "v"
    assert armdb.check(path).ok


def test_id_reservation_after_close_is_refused(tmp_path: Path) -> None:
    """A push that reaches its id block's end after close must not write ``seqmap``: the
    directory lock is released by then and another process may own the database."""
    path = tmp_path / "db"
    db = armdb.Db.open(path)
    q = db.open_queue(FIXED, _queue_config(1, 64))
    q.push((1, 1))
    db.close()
    before = (path / "seqmap").read_bytes()
    with pytest.raises(armdb.DbClosed):
        db.seqmap.next("q:a_name_with_no_block_yet")
    assert (path / "seqmap").read_bytes() == before
