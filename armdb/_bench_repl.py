"""Replication workloads of ``python -m armdb bench`` (issue 20; rows declared in armdb._bench).

Each workload runs a primary in this process and its follower (``Db.follow``) in a
child process on loopback, as a standby on another machine would run: the follower's
apply and fsyncs do not share this process's interpreter lock.

- :func:`lag_ms`: the replication lag under a push→lease→ack cycle: for one cycle in
  :data:`SAMPLE_EVERY`, the time from the cycle's return to the moment the follower
  confirms (its ``A`` frame) that it holds the cycle's writes on disk.  A percentile of
  those samples, in milliseconds; the cycle runs flat out, so the figure includes any
  backlog the follower builds up.
- :func:`cycle_rate`: the same cycle's rate with a follower attached (against the
  ``cycle/*`` rows, which have none).
- :func:`durable_commit_rate`: durable transactions per second (``TxConfig(durable=True)``),
  with ``sync_replicas(1)`` and a follower, or with no replica at all.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .config import TxConfig
from .db import Db
from .queue import QueueSpec

__all__ = ["SAMPLE_EVERY", "cycle_rate", "durable_commit_rate", "lag_ms"]

SAMPLE_EVERY = 10  # cycles per lag sample
_LISTEN = ("127.0.0.1", 0)
_FOLLOWER = """
import sys, time, armdb
f = armdb.Db.follow(sys.argv[1], primary=(sys.argv[2], int(sys.argv[3])))
while not f.status()["snapshot_complete"]:
    time.sleep(0.005)
print("READY", flush=True)
sys.stdin.read()
f.close()
"""


class _Follower:
    """A follower of ``address`` in a child process, into ``path``; ready once it holds a
    complete copy.  ``stop()`` closes it (stdin closed) and waits."""

    def __init__(self, path: str, address: tuple[str, int]) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FOLLOWER, path, address[0], str(address[1])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.proc.kill()
            _, err = self.proc.communicate()
            raise RuntimeError(f"the bench's follower did not start: {line}{err[-500:]}")

    def stop(self) -> None:
        """Close its stdin (it closes the follower and exits) and collect it."""
        try:
            self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _primary(path: str) -> tuple[Db, Any]:
    db = Db.open(os.path.join(path, "primary"))
    try:
        address = db.replicate(listen=_LISTEN)
        return db, _Follower(os.path.join(path, "follower"), address)
    except BaseException:
        db.close()
        raise


def lag_ms(path: str, n: int, spec: QueueSpec, make: Callable[[int], Any], pct: float, *,
           warmup: int = 200) -> float:
    """The ``pct`` percentile of the replication lag, in ms, under ``n`` push→lease→ack
    cycles of a queue at its defaults, payload ``make(i)`` (see the module docstring)."""
    db, follower = _primary(path)
    try:
        q = db.open_queue(spec)
        primary = db._primary
        assert primary is not None
        acks: list[tuple[int, float]] = []
        primary.ack_listener = lambda seq, t: acks.append((seq, t))
        samples: list[tuple[int, float]] = []
        for i in range(warmup + n):
            q.push(make(i))
            (lease,) = q.lease(1)
            q.ack(lease.token)
            if i >= warmup and i % SAMPLE_EVERY == 0:
                samples.append((primary.seq, time.monotonic()))
        end = primary.seq
        deadline = time.monotonic() + 120
        while (not acks or acks[-1][0] < end) and time.monotonic() < deadline:
            time.sleep(0.005)
        if not acks or acks[-1][0] < end:
            raise RuntimeError("the follower did not confirm the run within 120 s")
        primary.ack_listener = None
        seqs = np.array([a[0] for a in acks], dtype=np.int64)
        times = np.array([a[1] for a in acks])
        k = np.searchsorted(seqs, np.array([s for s, _ in samples], dtype=np.int64), side="left")
        lags = times[k] - np.array([t for _, t in samples])
        return float(np.percentile(np.maximum(lags, 0.0), pct) * 1000.0)
    finally:
        db.shutdown()
        follower.stop()


def cycle_rate(path: str, spec: QueueSpec, run: Callable[[Any], float]) -> float:
    """``run(queue)`` (armdb._bench's push→lease→ack rate) on a queue at its defaults,
    with a follower attached."""
    db, follower = _primary(path)
    try:
        return run(db.open_queue(spec))
    finally:
        db.shutdown()
        follower.stop()


def durable_commit_rate(path: str, n: int, *, sync_replica: bool, warmup: int = 20) -> float:
    """Durable one-row map transactions per second: with ``sync_replica``, each returns
    once a follower (child process) has it on disk (``sync_replicas(1)``); without it,
    the database does not replicate at all."""
    cfg = TxConfig(durable=True).sync_replicas(1) if sync_replica else TxConfig(durable=True)
    db = Db.open(os.path.join(path, "primary"), tx_config=cfg)
    follower = None
    try:
        if sync_replica:
            follower = _Follower(os.path.join(path, "follower"), db.replicate(listen=_LISTEN))
        m = db.open_map("effects")
        for i in range(warmup):
            with db.tx() as tx:
                tx.put(m, -1 - i, "warm")
        gc.collect()
        t0 = time.perf_counter()
        for i in range(n):
            with db.tx() as tx:
                tx.put(m, i, "effect")
        return n / (time.perf_counter() - t0)
    finally:
        db.shutdown()
        if follower is not None:
            follower.stop()

