"""CPU cost of the queue hot path, and the pure-Python floor of its API (docs/performance.md).

Usage::

    .venv/bin/python asv_bench/scripts/cycle_profile.py            # fixed and var cycles
    .venv/bin/python asv_bench/scripts/cycle_profile.py --floor    # the floor skeleton too
    .venv/bin/python asv_bench/scripts/cycle_profile.py --profile  # cProfile of the fixed cycle
    .venv/bin/python asv_bench/scripts/cycle_profile.py --wall     # the bench's fixed loop, wall rate

Times are CPU time of this process (``time.process_time``), which a shared machine
disturbs less than wall time.  Queues are configured as ``python -m armdb bench``
configures them (no fsync).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import pstats
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from armdb import _bench as B


def _per_op(n: int, fn: Callable[[int], Any]) -> float:
    t = time.process_time()
    for i in range(n):
        fn(i)
    return (time.process_time() - t) / n * 1e6


def queue_costs(spec: Any, make: Callable[[int], Any], n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        db, q = B.open_armdb(d, spec)
        try:
            def cycle(i: int) -> None:
                q.push(make(i))
                (lease,) = q.lease(1)
                q.ack(lease.token)

            _per_op(2000, cycle)
            c = _per_op(n, cycle)
            push = _per_op(n, lambda i: q.push(make(i)))
            leases: list[Any] = []
            lease = _per_op(n, lambda i: leases.append(q.lease(1)[0]))
            ack = _per_op(n, lambda i: q.ack(leases[i].token))
        finally:
            db.shutdown()
    print(f"{spec.name}: cycle {c:.1f} us ({1e6 / c:,.0f}/s); push {push:.1f} us, "
          f"lease(1) {lease:.1f} us, ack {ack:.1f} us")


class _Token(NamedTuple):
    handle: int
    shard: int
    due: int
    seq: int
    epoch: int


class _Lease(NamedTuple):
    id: int
    payload: Any
    attempt: int
    deadline: datetime.datetime
    token: _Token


class _Skeleton:
    """The API surface of push/lease/ack with every storage step removed."""

    dtype = np.dtype([("a", "<u8"), ("b", "<u4")])
    row = struct.Struct("<QI")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0
        self.rows: dict[int, bytes] = {}

    def push(self, payload: tuple[int, int], *, delay: float | None = None) -> int:
        _now = time.time_ns() // 1_000_000
        body = self.row.pack(*payload)
        with self.lock:
            self.seq += 1
            self.rows[self.seq] = body
            return self.seq

    def lease(self, n: int = 1, *, lease_timeout: float | None = None) -> list[_Lease]:
        now = time.time_ns() // 1_000_000
        with self.lock:
            seq, body = next(iter(self.rows.items()))
        rec = np.frombuffer(body, self.dtype)[0]
        dl = datetime.datetime.fromtimestamp((now + 30_000) / 1000, datetime.timezone.utc)
        return [_Lease(seq, rec, 1, dl, _Token(1, 0, now, seq, 1))]

    def ack(self, token: _Token) -> None:
        if not isinstance(token, _Token) or token.handle != 1:
            raise ValueError("stale")
        with self.lock:
            del self.rows[token.seq]


def floor(n: int) -> None:
    s = _Skeleton()

    def cycle(i: int) -> None:
        s.push((i, 1))
        (lease,) = s.lease(1)
        s.ack(lease.token)

    _per_op(5000, cycle)
    c = _per_op(n, cycle)
    print(f"floor (API surface, no storage): {c:.2f} us per cycle ({1e6 / c:,.0f}/s)")


def wall(repeats: int = 5, n: int = 100_000) -> None:
    """The bench's own fixed cycle loop (wall time, id reservations included), in fresh
    directories; ``--wall-no-reservations`` makes id blocks huge to show their share."""
    rates = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            rates.append(B.armdb_cycle(d, n, B.BenchFixed))
    print("fixed cycle, wall:", ", ".join(f"{r:,.0f}/s" for r in sorted(rates)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--wall", action="store_true")
    ap.add_argument("--wall-no-reservations", action="store_true")
    ap.add_argument("-n", type=int, default=20_000)
    a = ap.parse_args()
    if a.wall or a.wall_no_reservations:
        if a.wall_no_reservations:
            import armdb.seqmap

            armdb.seqmap.ID_BLOCK = 1 << 30  # an experiment only: T5 needs blocks of 1024
        wall()
        return
    queue_costs(B.BenchFixed, lambda i: (i, 1), a.n)
    queue_costs(B.BenchVar, B.body, a.n // 2)
    if a.floor:
        floor(a.n * 5)
    if a.profile:
        with tempfile.TemporaryDirectory() as d:
            db, q = B.open_armdb(d, B.BenchFixed)
            try:
                prof = cProfile.Profile()
                prof.enable()
                for i in range(a.n):
                    q.push((i, 1))
                    (lease,) = q.lease(1)
                    q.ack(lease.token)
                prof.disable()
            finally:
                db.shutdown()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
