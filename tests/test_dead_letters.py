"""SPEC Q33 (peek) and Q34 (redrive, purge_dead): dead letters users can see and move.

A redrive or a purge is one logged commit: after a crash (a kill at a random moment, or
at the log append) either every row it moves is in its new state or none is, no row is
lost or in both states, and ``armdb.check`` is clean.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import armdb
from armdb import Db, QueueConfig, State
from armdb.errors import ConfigError, QueueFull, StaleToken

from .conftest import FakeClock, child_env, kill_and_read, run_child, spawn_child

PING = np.dtype([("doc", "<u8")])


@dataclass
class Job:
    doc: int


FixedQ = armdb.queue("fq", payload=PING)
VarQ = armdb.queue("vq", payload=Job, var=True)


def cfg(**kw) -> QueueConfig:
    b = QueueConfig.balanced().max_attempts(1)
    for k, v in kw.items():
        b = getattr(b, k)(v)
    return b.build()


def make(flavour: str, i: int):
    return (i,) if flavour == "fixed" else Job(i)


def doc_of(payload) -> int:
    return int(payload["doc"]) if isinstance(payload, np.void) else payload.doc


@pytest.fixture(params=["fixed", "var"])
def flavour(request) -> str:
    return request.param


def open_q(db: Db, flavour: str, **kw):
    return db.open_queue(FixedQ if flavour == "fixed" else VarQ, cfg(**kw))


def dead_rows(q, clock: FakeClock, n: int) -> list[int]:
    """Push ``n`` rows and dead-letter them one second apart (max_attempts 1); their ids."""
    ids = [q.push(make("fixed" if not q.spec.var else "var", i)) for i in range(n)]
    for lease in q.lease(n):
        q.nack(lease)
        clock.advance(1)
    assert q.dead_len() == n
    return ids


# -- Q33 peek ----------------------------------------------------------------------------------------


def test_q33_peek_reads_live_rows_in_key_order_and_changes_nothing(db, clock, flavour):
    q = open_q(db, flavour)
    q.push(make(flavour, 3), delay=20)
    q.push(make(flavour, 1))
    q.push(make(flavour, 2), delay=10)
    (leased,) = q.lease(1)
    before = (q.stats(), q.snapshot().tolist())
    jobs = q.peek(10)
    assert [doc_of(j.payload) for j in jobs] == [1, 2, 3]  # key order: due, then id
    assert [j.state for j in jobs] == [State.LEASED, State.READY, State.READY]
    assert jobs[0].attempts == 1 and jobs[1].attempts == 0
    assert jobs[2].due - jobs[1].due == timedelta(seconds=10)
    assert q.peek(2) == jobs[:2]
    assert (q.stats(), q.snapshot().tolist()) == before  # nothing changed
    q.ack(leased)


def test_q33_peek_dead_rows_oldest_dead_lettered_first(db, clock, flavour):
    q = open_q(db, flavour)
    ids = dead_rows(q, clock, 4)
    jobs = q.peek(3, dead=True)
    assert [j.id for j in jobs] == ids[:3] and all(j.state == State.DEAD for j in jobs)
    assert jobs[1].due - jobs[0].due == timedelta(seconds=1)  # when each was dead-lettered
    assert [doc_of(j.payload) for j in jobs] == [0, 1, 2]
    assert q.peek(dead=False) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", None, True, 2_000_000])
def test_q33_peek_bad_n_is_a_config_error(db, bad):
    q = open_q(db, "fixed")
    with pytest.raises(ConfigError, match=r"peek\(n\)"):
        q.peek(bad)
    with pytest.raises(ConfigError, match="dead must be True or False"):
        q.peek(1, dead="yes")


# -- Q34 redrive and purge_dead --------------------------------------------------------------------------


def test_q34_redrive_moves_dead_rows_back_with_attempts_reset(db, clock, flavour):
    q = open_q(db, flavour)
    ids = dead_rows(q, clock, 5)
    assert q.redrive([ids[1], ids[3], 10**9], delay=30) == 2  # an unknown id is ignored
    assert q.len() == 2 and q.dead_len() == 3
    assert q.lease(5) == []  # due in 30 s
    clock.advance(30)
    got = q.lease(5)
    assert sorted(lz.id for lz in got) == [ids[1], ids[3]]  # ids and bodies kept
    assert sorted(doc_of(lz.payload) for lz in got) == [1, 3] and all(lz.attempt == 1 for lz in got)
    assert q.redrive() == 3 and q.dead_len() == 0  # every dead row


def test_q34_old_tokens_stay_stale_after_a_redrive(db, clock, flavour):
    q = open_q(db, flavour)
    q.push(make(flavour, 1))
    (lz,) = q.lease(1)
    q.nack(lz, dead=True)
    assert q.redrive() == 1
    with pytest.raises(StaleToken):
        q.ack(lz)
    (again,) = q.lease(1)
    q.ack(again)


def test_q34_redrive_counts_against_max_depth_and_moves_nothing_when_full(db, clock, flavour):
    q = open_q(db, flavour, max_depth=3)
    dead_rows(q, clock, 3)
    q.push(make(flavour, 9))
    with pytest.raises(QueueFull, match="max_depth=3"):
        q.redrive()
    assert q.dead_len() == 3 and q.len() == 1
    assert q.redrive(q.peek(2, dead=True)[i].id for i in range(2)) == 2 and q.len() == 3


def test_q34_purge_dead_deletes_rows_and_bodies(db, clock, flavour):
    q = open_q(db, flavour)
    ids = dead_rows(q, clock, 4)
    assert q.purge_dead(ids[:2]) == 2 and q.dead_len() == 2
    assert [j.id for j in q.peek(dead=True)] == ids[2:]
    if flavour == "var":
        store = q._payload
        assert store.get(ids[0].to_bytes(8, "big")) is None and store.get(ids[2].to_bytes(8, "big")) is not None
    assert q.purge_dead() == 2 and q.dead_len() == 0 and q.len() == 0
    assert q.purge_dead() == 0 and q.redrive() == 0


@pytest.mark.parametrize("bad", ["12", 5, [1, "x"], [0], [-3], [True], [2**64]])
def test_q34_bad_ids_are_a_config_error_and_change_nothing(db, clock, bad):
    q = open_q(db, "var")
    dead_rows(q, clock, 2)
    for call in (lambda: q.redrive(bad), lambda: q.purge_dead(bad)):
        with pytest.raises(ConfigError, match="ids must be"):
            call()
    with pytest.raises(ConfigError, match="delay must not be negative"):
        q.redrive(delay=-1)
    assert q.dead_len() == 2 and q.len() == 0


def test_q34_redrive_wakes_a_waiting_consumer(db, clock):
    import threading

    q = open_q(db, "fixed")
    dead_rows(q, clock, 1)
    woke: list[bool] = []
    t = threading.Thread(target=lambda: woke.append(q.wait_due_timeout(timedelta(seconds=20))))
    t.start()
    time.sleep(0.2)
    q.redrive()
    t.join(10)
    assert woke == [True]


def test_q34_moves_survive_a_reopen_and_check_is_clean(tmp_path: Path, flavour):
    clock = FakeClock()
    path = tmp_path / "db"
    with Db.open(path, clock=clock) as db:
        q = open_q(db, flavour)
        ids = dead_rows(q, clock, 6)
        q.redrive(ids[:3])
        q.purge_dead(ids[3:5])
    assert armdb.check(path).ok
    with Db.open(path, clock=clock) as db:
        q = open_q(db, flavour)
        assert q.len() == 3 and [j.id for j in q.peek(dead=True)] == [ids[5]]


# -- crash safety: all or nothing -----------------------------------------------------------------------

N_ROWS = 400  # enough rows that a kill at a random moment often lands inside the apply


def _golden(tmp_path: Path, flavour: str) -> tuple[Path, list[int]]:
    """A database with N_ROWS dead rows, made once per test and copied for each round."""
    path = tmp_path / f"golden-{flavour}"
    with Db.open(path) as db:
        q = open_q(db, flavour)
        ids = [q.push(make(flavour, i)) for i in range(N_ROWS)]
        for lease in q.lease(N_ROWS):
            q.nack(lease)
        assert q.dead_len() == N_ROWS
    return path, ids


CHILD = """
import armdb
from tests.test_dead_letters import FixedQ, VarQ
spec = FixedQ if {flavour!r} == "fixed" else VarQ
db = armdb.Db.open({path!r})
q = db.open_queue(spec, armdb.QueueConfig.balanced().max_attempts(1).build())
print("open", flush=True)
n = q.{op}()
print("done", n, flush=True)
"""


def _judge(path: Path, flavour: str, op: str, ids: list[int]) -> str:
    with Db.open(path) as db:
        q = open_q(db, flavour)
        live, dead = q.len(), q.dead_len()
        snap = q.snapshot()
        if flavour == "var":
            bodies = sum(q._payload.get(i.to_bytes(8, "big")) is not None for i in ids)
    assert sorted(snap["id"].tolist()) == (sorted(ids) if (live, dead) != (0, 0) else [])
    if op == "redrive":
        assert (live, dead) in ((0, N_ROWS), (N_ROWS, 0)), (live, dead)  # every row, or none
        outcome = "moved" if live else "none"
        if flavour == "var":
            assert bodies == N_ROWS  # a redrive keeps every body
    else:
        assert (live, dead) in ((0, 0), (0, N_ROWS)), (live, dead)
        outcome = "moved" if dead == 0 else "none"
        if flavour == "var" and outcome == "none":
            assert bodies == N_ROWS  # no body of a row still there was deleted
    report = armdb.check(path)
    assert report.ok, report
    return outcome


@pytest.mark.crash
@pytest.mark.parametrize("op", ["redrive", "purge_dead"])
def test_q34_kill_at_a_random_moment_moves_every_row_or_none(tmp_path: Path, flavour, op):
    golden, ids = _golden(tmp_path, flavour)
    rng = random.Random(f"{flavour}-{op}")
    rounds = int(os.environ.get("ARMDB_DEAD_ROUNDS", "10"))
    outcomes: list[str] = []
    for r in range(rounds):
        path = tmp_path / f"round-{r}"
        shutil.copytree(golden, path)
        p = spawn_child(CHILD.format(flavour=flavour, path=str(path), op=op))
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "open"
        time.sleep(rng.uniform(0, 0.006))
        kill_and_read(p)
        outcomes.append(_judge(path, flavour, op, ids))
        shutil.rmtree(path)
    assert len(outcomes) == rounds


@pytest.mark.crash
@pytest.mark.parametrize("op", ["redrive", "purge_dead"])
def test_q34_crash_after_the_log_append_is_finished_by_replay(tmp_path: Path, flavour, op):
    # The record is logged, nothing is applied yet: the next open applies every row.
    golden, ids = _golden(tmp_path, flavour)
    r = run_child(CHILD.format(flavour=flavour, path=str(golden), op=op),
                  env=child_env(ARMDB_FAILPOINT="txlog.after_append"))
    assert r.returncode == 86, r.stderr
    assert _judge(golden, flavour, op, ids) == "moved"
