"""What the multi-process tests of tests/test_processes.py run in their children: a queue
declaration, worker handlers (importable by name, as ``Worker(processes=N)`` needs), an
owner that serves, and clients that write a journal of what returned to them.

A journal is a text file written with one ``os.write`` per line (unbuffered, so a line
that a SIGKILL did not cut is whole): ``P id`` a push returned, ``L id attempt t deadline``
a lease returned at wall time ``t`` (ms) with its deadline (ms), ``a id t`` an ack is about
to be sent (the lease was held until ``t``), ``A id`` the ack returned, ``n id t`` a nack is
about to be sent, ``S id`` a settle raised StaleToken, ``CLOSED t`` a call raised
``DbClosed`` at wall time ``t`` (ms).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import threading
import time

import armdb


@dataclasses.dataclass
class Task:
    n: int
    body: str


Tasks = armdb.queue("tasks", payload=Task, var=True)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Journal:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.lock = threading.Lock()

    def line(self, *parts: object) -> None:
        data = (" ".join(str(p) for p in parts) + "\n").encode()
        with self.lock:
            os.write(self.fd, data)


def read_journal(path: str) -> list[list[str]]:
    with open(path) as f:
        return [ln.split() for ln in f.read().splitlines() if ln.strip()]


# -- the owner ---------------------------------------------------------------------------------


def serve_forever(path: str) -> None:
    """Open, serve, say ``ready``, sleep until killed."""
    db = armdb.Db.open(path)
    db.open_queue(Tasks, armdb.QueueConfig.balanced().backoff_secs([0.0]).build())
    db.serve()
    print("ready", flush=True)
    while True:
        time.sleep(60)


# -- load clients (P4) ---------------------------------------------------------------------------


def load_client(path: str, journal: str, seed: int, timeout: float) -> None:
    """Push, lease, ack and nack until the owner goes; journal what returned."""
    rnd = random.Random(seed)
    j = Journal(journal)
    try:
        c = armdb.connect(path, timeout=timeout)
        q = c.open_queue(Tasks)
        print("ready", flush=True)
        i = 0
        while True:
            i += 1
            r = rnd.random()
            if r < 0.5:
                for rid in (q.push_many([Task(i, "x" * rnd.randrange(64))] * rnd.randrange(1, 4))
                            if r < 0.1 else [q.push(Task(i, "y"))]):
                    j.line("P", rid)
            else:
                for lz in q.lease(rnd.randrange(1, 5)):
                    j.line("L", lz.id, lz.attempt, now_ms(), armdb.wire.dt_to_ms(lz.deadline))
                    if rnd.random() < 0.85:
                        j.line("a", lz.id, now_ms())
                        q.ack(lz)
                        j.line("A", lz.id)
                    else:
                        j.line("n", lz.id, now_ms())
                        q.nack(lz, delay=0)
    except armdb.DbClosed:
        j.line("CLOSED", now_ms())
        sys.exit(0)


# -- lease holders (P3) and fairness clients (P7) ---------------------------------------------------


def hold_leases(path: str, n: int) -> None:
    """Lease ``n`` rows (60 s lease timeout), print their ids, sleep until killed."""
    c = armdb.connect(path)
    q = c.open_queue(Tasks)
    got = q.lease(n, lease_timeout=60)
    print(" ".join(str(lz.id) for lz in got), flush=True)
    while True:
        time.sleep(60)


def fair_client(path: str, journal: str, seed: int, threads: int, seconds: float, lease_timeout: float) -> None:
    """``threads`` threads leasing, acking, nacking and letting leases expire for ``seconds``."""
    j = Journal(journal)
    c = armdb.connect(path, timeout=30)
    q = c.open_queue(Tasks)
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        rnd = random.Random(seed * 100 + k)
        while time.monotonic() < stop:
            got = q.lease(rnd.randrange(1, 4), lease_timeout=lease_timeout)
            if not got:
                q.wait_due_timeout(0.05)
                continue
            for lz in got:
                j.line("L", lz.id, lz.attempt, now_ms(), armdb.wire.dt_to_ms(lz.deadline), k)
            for lz in got:
                r = rnd.random()
                if r < 0.03:
                    time.sleep(lease_timeout * 1.5)  # let it expire; the settle below may be stale
                t = now_ms()
                try:
                    if r < 0.8:
                        j.line("a", lz.id, t, k)
                        q.ack(lz)
                        j.line("A", lz.id)
                    else:
                        j.line("n", lz.id, t, k)
                        q.nack(lz, delay=0)
                except armdb.StaleToken:
                    j.line("S", lz.id)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    c.close()


# -- worker handlers (P6) ------------------------------------------------------------------------

CALLS: dict[int, int] = {}
CALLS_LOCK = threading.Lock()


def count_call(task: Task) -> None:
    with CALLS_LOCK:
        CALLS[task.n] = CALLS.get(task.n, 0) + 1


def spin(task: Task) -> None:
    """About 1 ms of pure Python."""
    x = 0
    for i in range(20_000):
        x += i * i
    if task.n < 0:
        raise ValueError("negative")


def record_pid(task: Task) -> None:
    """Append this process's pid to the file the task names (one line per call)."""
    fd = os.open(task.body, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"{task.n} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
