"""Durable transaction commits: one thread vs 8 (group commit), and what bounds the ratio.

Run: .venv/bin/python asv_bench/scripts/tx_rates.py [repeats]  (figures in docs/performance.md)

The workload is the benchmark's (``armdb._bench.armdb_tx_commit``: a map put and a
fixed-queue push per commit).  Repeats are interleaved (repeat 1 of every row, then
repeat 2, ...) in fresh directories; each row prints the median.

* ``P`` (hot): µs of Python per commit, from non-durable commits in a loop.
* ``S``: µs inside one log ``fdatasync`` (timed by the native group-commit path).
* one thread, durable: ``1 / (P1 + S)``, where ``P1`` (the wall time per commit
  minus ``S``) is larger than the hot ``P``: the thread sleeps in every sync.
* 8 threads: commits per sync and the share of the wall time the disk spent syncing.
* log only: the same threads doing only a commit's log part (``TxLog.append`` of a
  2-row record, ``sync_to``, ``done``): the ceiling of the group commit itself.
* ``cpu``: the process's user + system CPU as a share of the wall time (getrusage);
  100% is one of the two cores.
"""

from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
from typing import Any

from armdb import Db
from armdb._bench import _threaded_rate, armdb_tx_commit, raw_fdatasync

# A commit's log record as the benchmark's 2-row transaction writes it (a header slot, a map row).
_ROWS: list[Any] = [["F", "q", 0, 5, 7, 1, b"x" * 32], ["B", "effects", b"12345678", b"effect", 12345]]


def log_only(path: str, n: int, *, threads: int, stats: dict[str, float]) -> float:
    """Commits per second of only the log part of a durable commit, from ``threads`` threads."""
    db = Db.open(path)
    try:
        txlog = db.txlog

        def commit(i: int) -> None:
            txlog.sync_to(txlog.append(_ROWS))
            txlog.done()

        for i in range(20):
            commit(i)
        c0, s0, t0 = txlog.commits, txlog.syncs, txlog._group.sync_seconds
        rate = _threaded_rate(n, threads, commit)
        stats.update(commits=txlog.commits - c0, syncs=txlog.syncs - s0, sync_seconds=txlog._group.sync_seconds - t0)
        return rate
    finally:
        db.close()


def main(repeats: int = 5) -> None:
    rows: dict[str, list[dict[str, float]]] = {}

    def run(name: str, n: int, **kw: object) -> None:
        stats: dict[str, float] = {}
        fn: Any = log_only if kw.pop("log_only", False) else armdb_tx_commit
        with tempfile.TemporaryDirectory() as d:
            r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            rate = fn(d, n, stats=stats, **kw)
            r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        stats["rate"] = rate
        stats["cpu"] = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (w1 - w0)
        rows.setdefault(name, []).append(stats)

    for _ in range(repeats):
        run("non-durable, 1 thread", 5000, durable=False, warmup=200)
        run("durable, 1 thread", 400, durable=True, warmup=20)
        run("durable, 8 threads", 1600, durable=True, threads=8, warmup=20)
        run("durable, 8 threads, 64 shards", 1600, durable=True, threads=8, warmup=20, shards=64)
        run("durable, 8 threads, 256 shards", 1600, durable=True, threads=8, warmup=20, shards=256)
        run("log only, 1 thread", 400, log_only=True, threads=1)
        run("log only, 8 threads", 3200, log_only=True, threads=8)
        with tempfile.TemporaryDirectory() as d:
            rows.setdefault("raw pwrite+fdatasync", []).append({"rate": raw_fdatasync(d, 400)})

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    for name, rs in rows.items():
        line = f"{name:32s} {med(name, 'rate'):9,.0f}/s  (min {min(r['rate'] for r in rs):,.0f}, " \
               f"max {max(r['rate'] for r in rs):,.0f})"
        if rs[0].get("syncs"):
            s_us = statistics.median(r["sync_seconds"] / r["syncs"] * 1e6 for r in rs)
            per_sync = statistics.median(r["commits"] / r["syncs"] for r in rs)
            busy = statistics.median(r["sync_seconds"] * r["rate"] / r["commits"] for r in rs)
            line += f"  S={s_us:.0f} µs  commits/sync={per_sync:.2f}  disk busy={busy:.0%}"
        if "cpu" in rs[0]:
            line += f"  cpu={statistics.median(r['cpu'] for r in rs):.0%}"
        print(line)
    p_hot = 1e6 / med("non-durable, 1 thread", "rate")
    one = med("durable, 1 thread", "rate")
    s1 = statistics.median(r["sync_seconds"] / r["syncs"] * 1e6 for r in rows["durable, 1 thread"])
    p1 = 1e6 / one - s1
    eight = med("durable, 8 threads", "rate")
    print(f"P (hot) = {p_hot:.1f} µs; one thread: P1 = {p1:.0f} µs + S = {s1:.0f} µs per commit")
    print(f"8 threads / 1 thread = {eight / one:.2f}x; GIL bound (P1 + S) / P = {(p1 + s1) / p_hot:.1f}x")
    log1, log8 = med("log only, 1 thread", "rate"), med("log only, 8 threads", "rate")
    print(f"log only: 8 threads / 1 thread = {log8 / log1:.2f}x; 8 threads: a full commit reaches "
          f"{eight / log8:.0%} of the log-only rate")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
