"""Many processes, one queue: kills of clients and of the owner, the worker, fairness
(SPEC P3, P4, P6, P7, C5).  The children run tests/servekit.py.

Sizes: ``ARMDB_KILLS_SERVE`` owner kills (default 3; the slow form runs 24), and the
fairness run ``ARMDB_FAIR`` = ``processes,threads,seconds`` (default 4,2,4; slow 8,4,30).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import armdb
from tests import servekit
from tests.conftest import child_env, spawn_child
from tests.servekit import Task, Tasks, read_journal

ROOT = Path(__file__).resolve().parent.parent


def _start(code: str) -> subprocess.Popen[str]:
    return _start_line(code)[0]


def _start_line(code: str) -> tuple[subprocess.Popen[str], str]:
    """Start a child and read its first line (it says it is ready)."""
    p = spawn_child(code)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        _, err = p.communicate(timeout=10)
        raise AssertionError(f"child failed to start: {err}")
    return p, line


def _kill(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=10)


# -- P3: a killed client's leases come back at once ---------------------------------------------


def test_p3_sigkilled_client_leases_come_back_within_a_second(tmp_path: Path) -> None:
    # SPEC P3: a worker process holding leases (60 s lease timeout) is SIGKILLed; another
    # client gets those jobs within about a second, with the attempt counted
    db = armdb.Db.open(tmp_path / "db")
    try:
        q = db.open_queue(Tasks)
        ids = [q.push(Task(i, "held")) for i in range(5)]
        db.serve()
        p, line = _start_line(f"from tests.servekit import hold_leases; hold_leases({str(db.path)!r}, 5)")
        assert sorted(int(x) for x in line.split()) == ids
        with armdb.connect(db.path) as c:
            other = c.open_queue(Tasks)
            assert other.lease(5) == []  # all five are leased to the child
            t0 = time.monotonic()
            os.kill(p.pid, signal.SIGKILL)
            got: list[Any] = []
            while len(got) < 5:
                got += other.lease(5)
                assert time.monotonic() - t0 < 1.5, f"only {len(got)} of 5 leases came back"
                if len(got) < 5:
                    other.wait_due_timeout(0.05)
            assert sorted(lz.id for lz in got) == ids
            assert all(lz.attempt == 2 for lz in got)
            other.ack_many(got)
        p.communicate(timeout=10)
    finally:
        db.shutdown()
    assert armdb.check(tmp_path / "db").ok


# -- P4: the owner is killed under load ------------------------------------------------------------

KILLS = int(os.environ.get("ARMDB_KILLS_SERVE", "3"))
CLIENT_TIMEOUT = 3.0


def _owner_kill_round(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    path = str(tmp_path / f"db{seed}")
    owner = _start(f"from tests.servekit import serve_forever; serve_forever({path!r})")
    clients = []
    journals = []
    try:
        for k in range(4):
            jpath = str(tmp_path / f"j{seed}_{k}")
            journals.append(jpath)
            clients.append(_start(
                f"from tests.servekit import load_client; load_client({path!r}, {jpath!r}, {seed * 10 + k}, "
                f"{CLIENT_TIMEOUT})"))
        time.sleep(rnd.uniform(0.2, 0.8))
        killed_at = servekit.now_ms()
        os.kill(owner.pid, signal.SIGKILL)
        owner.communicate(timeout=10)
        for c in clients:
            try:
                c.communicate(timeout=CLIENT_TIMEOUT + 10)
            except subprocess.TimeoutExpired:
                raise AssertionError("a client hung after its owner was killed") from None
            assert c.returncode == 0, "a client raised something other than DbClosed"
    finally:
        for p in [owner, *clients]:
            _kill(p)
    pushed: set[int] = set()
    ack_sent: set[int] = set()
    acked: set[int] = set()
    for jpath in journals:
        lines = read_journal(jpath)
        assert lines and lines[-1][0] == "CLOSED", "a client's last call did not raise DbClosed"
        # SPEC P4: every call returns DbClosed within the client's timeout of the owner's death
        assert int(lines[-1][1]) - killed_at <= CLIENT_TIMEOUT * 1000 + 1500
        for ln in lines:
            if ln[0] == "P":
                pushed.add(int(ln[1]))
            elif ln[0] == "a":
                ack_sent.add(int(ln[1]))
            elif ln[0] == "A":
                acked.add(int(ln[1]))
    assert pushed, "the clients pushed nothing before the kill"
    with armdb.Db.open(path) as db:
        q = db.open_queue(Tasks)
        present = {int(i) for i in q.snapshot()["id"]}
    lost = pushed - present - ack_sent
    assert not lost, f"pushes that returned are gone: {sorted(lost)[:10]}"
    back = acked & present
    assert not back, f"acked jobs came back: {sorted(back)[:10]}"
    report = armdb.check(path)
    assert report.ok, report


@pytest.mark.parametrize("seed", range(KILLS))
def test_p4_owner_killed_under_load(tmp_path: Path, seed: int) -> None:
    # SPEC P4
    _owner_kill_round(tmp_path, 1000 + seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(KILLS, 24))
def test_p4_owner_killed_under_load_long(tmp_path: Path, seed: int) -> None:
    # SPEC P4: the long form (24 rounds in all from fixed seeds)
    _owner_kill_round(tmp_path, 1000 + seed)


# -- P6: the worker ------------------------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Any:
    d = armdb.Db.open(tmp_path / "db")
    yield d
    d.shutdown()


def _cfg(lease: float = 30.0) -> armdb.QueueConfig:
    return armdb.QueueConfig.balanced().lease_timeout(lease).backoff_secs([0.0]).build()


def _until(cond: Any, limit: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit
        time.sleep(0.01)


@pytest.mark.parametrize(("through", "threads"), [("db", 2), ("client", 2), ("client", 1)])
def test_p6_long_handler_is_delivered_once(db: armdb.Db, through: str, threads: int) -> None:
    # SPEC P6: a handler taking 3x the lease timeout is kept leased by the heartbeat
    # (through a client: the extends of a beat pipelined in one write; with one thread the
    # batch it leases ahead waits through two long handlers and must be kept leased too)
    q = db.open_queue(Tasks, _cfg(lease=0.2))
    source: Any = db
    if through == "client":
        db.serve()
        source = armdb.connect(db.path, timeout=10)
    calls: collections.Counter[int] = collections.Counter()

    def slow(task: Task) -> None:
        calls[task.n] += 1
        time.sleep(0.6)

    for i in range(4):
        q.push(Task(i, "slow"))
    w = armdb.Worker(source, Tasks, slow, threads=threads, batch=2).start()
    _until(lambda: q.len() == 0)
    w.stop()
    w.join()
    if source is not db:
        source.close()
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1}
    assert q.stats().expired_leases == 0 and w.counts() == (4, 0)


def test_p6_exception_nacks_and_lease_handler(db: armdb.Db, caplog: pytest.LogCaptureFixture) -> None:
    # SPEC P6: an exception nacks (logged with its traceback); a handler annotated Lease gets the lease
    q = db.open_queue(Tasks, _cfg())
    seen: list[int] = []

    def handler(lease: armdb.Lease[Task]) -> None:
        seen.append(lease.attempt)
        if lease.attempt == 1:
            raise RuntimeError("first try fails")

    q.push(Task(1, "x"))
    with caplog.at_level(logging.ERROR, logger="armdb"):
        w = armdb.Worker(db, Tasks, handler).start()
        _until(lambda: q.len() == 0)
        w.stop()
        w.join()
    assert seen == [1, 2] and w.counts() == (1, 1)
    assert "first try fails" in caplog.text and "Traceback" in caplog.text


@pytest.mark.parametrize("through", ["db", "client"])
def test_p6_stop_drains_and_releases_the_rest(db: armdb.Db, through: str) -> None:
    # SPEC P6: stop() lets the running handler finish and releases leases not yet started at
    # once, their attempt not counted (release_many)
    q = db.open_queue(Tasks, _cfg(lease=60))
    source: Any = db
    if through == "client":
        db.serve()
        source = armdb.connect(db.path, timeout=10)
    for i in range(8):
        q.push(Task(i, "x"))
    started = []
    finished = []

    def handler(task: Task) -> None:
        started.append(task.n)
        time.sleep(0.3)
        finished.append(task.n)

    w = armdb.Worker(source, Tasks, handler, batch=8).start()
    _until(lambda: started)
    w.stop()
    w.join()
    if source is not db:
        source.close()
    assert started == finished == [0]
    got = q.lease(8)  # due at once: no wait
    assert sorted(lz.payload.n for lz in got) == list(range(1, 8))
    assert all(lz.attempt == 1 for lz in got)
    assert q.stats().expired_leases == 0


def test_p6_worker_processes_over_a_served_db(db: armdb.Db, tmp_path: Path) -> None:
    # SPEC P6: Worker(processes=2) runs the handlers in child processes connected as clients
    q = db.open_queue(Tasks, _cfg())
    out = str(tmp_path / "calls")
    for i in range(100):
        q.push(Task(i, out))
    w = armdb.Worker(db, Tasks, servekit.record_pid, processes=2, threads=2, batch=8).start()
    _until(lambda: q.len() == 0, 60)
    w.stop()
    w.join()
    lines = Path(out).read_text().split()
    ns = [int(x) for x in lines[0::2]]
    assert sorted(ns) == list(range(100))  # each exactly once
    assert os.getpid() not in {int(x) for x in lines[1::2]}
    assert w.counts() == (100, 0)


def test_p6_a_batch_leased_ahead_is_released_on_stop(db: armdb.Db) -> None:
    # SPEC P6: through a client the next batch is leased while the second half of a
    # batch runs; stopping then gives that batch back at once, unstarted, its attempt not
    # counted
    q = db.open_queue(Tasks, _cfg(lease=60))
    db.serve()
    client = armdb.connect(db.path, timeout=10)
    for i in range(8):
        q.push(Task(i, "x"))
    started: list[int] = []

    def handler(task: Task) -> None:
        started.append(task.n)
        if task.n == 3:  # the first batch's second half: the next batch is leased meanwhile
            time.sleep(0.3)

    w = armdb.Worker(client, Tasks, handler, batch=4).start()
    _until(lambda: 3 in started)
    w.stop()
    w.join()
    client.close()
    assert started == [0, 1, 2, 3] and w.counts() == (4, 0)
    got = q.lease(8)  # due at once: no wait
    assert sorted(lz.payload.n for lz in got) == [4, 5, 6, 7] and all(lz.attempt == 1 for lz in got)


@pytest.mark.parametrize("through", ["db", "client"])
def test_p6_acks_go_out_in_batches_and_a_lost_lease_spares_the_others(db: armdb.Db, through: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # SPEC P6: a worker's acks go out together with its next lease (one round trip per
    # batch through a client); when ack_many refuses a batch because one lease in it was
    # lost (here: acked by the handler itself), the others are still acked, one by one
    q = db.open_queue(Tasks, _cfg())
    client = None
    if through == "client":
        db.serve()
        client = armdb.connect(db.path, timeout=10)
    source: Any = db if client is None else client
    handle = q if client is None else client.open_queue(Tasks)
    seen: list[int] = []

    def handler(lease: armdb.Lease[Task]) -> None:
        seen.append(lease.payload.n)
        if lease.payload.n == 5:
            handle.ack(lease)  # the worker's own ack of it will be stale

    for i in range(40):
        q.push(Task(i, "x"))
    try:
        with caplog.at_level(logging.WARNING, logger="armdb"):
            w = armdb.Worker(source, Tasks, handler, batch=8).start()
            _until(lambda: q.len() == 0 and w.counts()[0] >= 39)
            w.stop()
            w.join()
        assert sorted(seen) == list(range(40))  # each once: nothing redelivered
        assert w.counts() == (39, 0)
        assert "row 6 of queue tasks was no longer leased" in caplog.text
        assert q.stats().expired_leases == 0
    finally:
        if client is not None:
            client.close()


def test_c5_serve_command_and_work_command(tmp_path: Path) -> None:
    # SPEC C5, P1, P6: python -m armdb serve DIR stops cleanly on SIGTERM; work runs a handler
    path = str(tmp_path / "db")
    srv = subprocess.Popen([sys.executable, "-m", "armdb", "serve", path], env=child_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert srv.stderr is not None
        assert "serving" in srv.stderr.readline()
        with armdb.connect(path) as c:
            q = c.open_queue(Tasks)
            out = str(tmp_path / "calls")
            q.push_many([Task(i, out) for i in range(20)])
            work = subprocess.Popen([sys.executable, "-m", "armdb", "work", path, "tests.servekit:record_pid",
                                     "--queue", "tasks", "--batch", "4"], env=child_env(), cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _until(lambda: q.len() == 0, 30)
            finally:
                work.send_signal(signal.SIGTERM)
                _, werr = work.communicate(timeout=20)
            assert work.returncode == 0, werr
            assert "20 done" in werr
        srv.send_signal(signal.SIGTERM)
        _, err = srv.communicate(timeout=20)
        assert srv.returncode == 0 and "stopped" in err
    finally:
        _kill(srv)
    assert sorted(int(x) for x in Path(out).read_text().split()[0::2]) == list(range(20))
    assert armdb.check(path).ok


# -- P7: fairness and exclusivity across processes --------------------------------------------------


def _fair_sizes() -> tuple[int, int, float]:
    p, t, s = os.environ.get("ARMDB_FAIR", "4,2,4").split(",")
    return int(p), int(t), float(s)


def _fairness(tmp_path: Path, procs: int, threads: int, seconds: float) -> None:
    lease_timeout = 0.3
    db = armdb.Db.open(tmp_path / "db")
    try:
        q = db.open_queue(Tasks, _cfg(lease=lease_timeout))
        jobs = int(2000 * seconds)
        pushed = set()
        for start in range(0, jobs, 1000):
            for i in range(start, min(jobs, start + 1000)):
                pushed.add(q.push(Task(i, "f")))
        db.serve()
        journals = [str(tmp_path / f"fair{k}") for k in range(procs)]
        children = [spawn_child(f"from tests.servekit import fair_client; fair_client({str(db.path)!r}, "
                                f"{journals[k]!r}, {k}, {threads}, {seconds}, {lease_timeout})")
                    for k in range(procs)]
        for c in children:
            _, err = c.communicate(timeout=seconds + 120)
            assert c.returncode == 0, err
        # drain what is left (released or expired rows become due)
        acked_here: list[int] = []
        t0 = time.monotonic()
        while q.len():
            got = q.lease(1000)
            for lz in got:
                q.ack(lz)
                acked_here.append(lz.id)
            if not got:
                time.sleep(0.02)
            assert time.monotonic() - t0 < 30
    finally:
        db.shutdown()
    # the lease-overlap checker: per row, the windows in which a client surely held it
    # ([lease returned, min(settle sent, deadline)]) never overlap across all clients
    windows: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
    acked: collections.Counter[int] = collections.Counter()
    per_proc = []
    for k, jpath in enumerate(journals):
        lines = read_journal(jpath) if os.path.exists(jpath) else []
        open_: dict[tuple[int, str], tuple[int, int]] = {}  # (row, thread) -> (start, deadline)
        leases = 0
        for ln in lines:
            kind, rid = ln[0], int(ln[1])
            if kind == "L":
                leases += 1
                open_[(rid, ln[5])] = (int(ln[3]), int(ln[4]))
            elif kind in ("a", "n"):
                start, deadline = open_.pop((rid, ln[3]))
                windows[rid].append((start, min(int(ln[2]), deadline), k))
            elif kind == "A":
                acked[rid] += 1
        for (rid, _t), (start, deadline) in open_.items():  # held at the end: released at close
            windows[rid].append((start, deadline, k))
        per_proc.append(leases)
    overlaps = _overlaps(windows)
    for rid in acked_here:
        acked[rid] += 1
    dup = [rid for rid, n in acked.items() if n > 1]
    lost = pushed - set(acked)
    assert overlaps == 0, f"{overlaps} overlapping leases"
    assert not dup, f"rows acked twice: {dup[:10]}"
    assert not lost, f"{len(lost)} rows never acked"
    # SPEC P7: every client got work
    assert all(n > 0 for n in per_proc), f"leases per client process: {per_proc}"


def _overlaps(windows: dict[int, list[tuple[int, int, int]]]) -> int:
    """How many times a row's window starts before the previous window of that row ended."""
    n = 0
    for ws in windows.values():
        ws.sort()
        for (_s1, e1, _k1), (s2, _e2, _k2) in zip(ws, ws[1:]):
            if s2 < e1:
                n += 1
    return n


def test_p7_overlap_checker_finds_an_overlap() -> None:
    # SPEC P7: the checker itself (a row held by two clients at once is counted)
    assert _overlaps({1: [(0, 10, 0), (10, 20, 1)], 2: [(5, 9, 0)]}) == 0
    assert _overlaps({1: [(0, 10, 0), (9, 20, 1)]}) == 1


def test_p7_fairness_and_exclusivity(tmp_path: Path) -> None:
    # SPEC P7: several client processes x threads leasing, acking and nacking one queue
    procs, threads, seconds = _fair_sizes()
    _fairness(tmp_path, procs, threads, seconds)


@pytest.mark.slow
def test_p7_fairness_and_exclusivity_long(tmp_path: Path) -> None:
    # SPEC P7: the full size, 8 processes x 4 threads x 30 s
    _fairness(tmp_path, 8, 4, 30.0)


def test_p6_docs_example_producer_and_two_workers(tmp_path: Path) -> None:
    # SPEC P1, P2, P6: docs/examples/shared_queue.py runs as docs/processes.md shows it
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "shared_queue.py"), str(tmp_path / "db")],
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "100 jobs done by 2 worker processes" in r.stdout
    pids = {line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("process ")}
    assert 1 <= len(pids) <= 2  # (one worker may take all 100 before the other has connected)
    assert armdb.check(tmp_path / "db").ok


def test_c5_work_owns_and_serves_when_nobody_serves(tmp_path: Path) -> None:
    # SPEC C5, P6: `work` opens DIR itself, serves it, and runs 2 worker processes
    path = str(tmp_path / "db")
    out = str(tmp_path / "calls")
    with armdb.Db.open(path) as db:
        db.open_queue(Tasks).push_many([Task(i, out) for i in range(30)])
    work = subprocess.Popen([sys.executable, "-m", "armdb", "work", path, "tests.servekit:record_pid", "-p", "2"],
                            env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert work.stderr is not None
        assert "owning" in work.stderr.readline()
        with armdb.connect(path) as c:  # it serves DIR to others too
            q = c.open_queue(Tasks)
            _until(lambda: q.len() == 0, 60)
        work.send_signal(signal.SIGTERM)
        _, err = work.communicate(timeout=30)
        assert work.returncode == 0, err
    finally:
        _kill(work)
    assert sorted(int(x) for x in Path(out).read_text().split()[0::2]) == list(range(30))
    assert len(set(Path(out).read_text().split()[1::2])) >= 1
    assert armdb.check(path).ok
